"""The ranks' part of ``python -m shardlab.port``: the audit, then parity, at the small sizes of the case, on every
rank together (``python -m shardlab.port.job SPEC.json``, started by ``steps.on_ranks``). Rank 0 prints each step as
it starts and hands back what is done so far, so a job that ends mid-way still says where. Parity is skipped when the
audit found an op without a handler: DTensor's fallback for it may leave the ranks out of step (a hang, or gloo
aborting the process), and the audit already says what to change."""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict) -> dict:
    import torch
    import torch.distributed as dist

    from .. import parity
    from ..mesh import build_mesh
    from ..ranks.launch import write_job_result
    from ..workarounds import register_shard_ops_on_cpu
    from .spec import job_case

    case = job_case(spec)
    world = dist.get_world_size()
    rank0 = dist.get_rank() == 0
    if not torch.cuda.is_available():
        register_shard_ops_on_cpu(everything=True)  # as the written run does: every handler GPUs register
    mesh = build_mesh(ddp=world // spec["domain"], domain=spec["domain"])
    row = {"ranks": world, "domain": spec["domain"], "audit": None, "parity": []}

    def say(text):
        if rank0:
            print(f"      {text}", flush=True)
            write_job_result(row)

    sizes = spec["sizes"]
    say(f"audit at size {sizes[0]} on {world} ranks ...")
    t0 = time.perf_counter()
    row["audit"] = parity.attempt("the audit", parity.audit_at, case, sizes[0], mesh, torch.float64)
    row["audit"]["seconds"] = time.perf_counter() - t0
    if row["audit"].get("unpatched") or row["audit"].get("error") and "findings" not in row["audit"]:
        say("parity skipped: the audit found what to change first")
        return row
    for size in sizes:
        say(f"parity at size {size} ...")
        t0 = time.perf_counter()
        result = parity.attempt(f"parity at {size}", parity.parity_at, case, size, mesh, torch.float64)
        row["parity"].append(result | {"size": size, "seconds": time.perf_counter() - t0})
    say("done")
    return row


def _main(argv: list[str]) -> None:
    import torch.distributed as dist

    from shardlab.port import job  # the module itself, not this __main__ copy
    from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result

    init_distributed(120)
    row = job.run(json.loads(open(argv[0]).read()))
    if dist.get_rank() == 0:
        write_job_result(row)
    shutdown_distributed()


if __name__ == "__main__":
    _main(sys.argv[1:])
