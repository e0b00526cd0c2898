"""Start-up and step costs, measured side by side in one run: ``python -m shardlab.tools.bench [--json FILE]``.

Two comparisons, each against the same work done without the cluster:

- starting the ``%%px`` cluster vs an ``mpiexec`` script that does the same per-rank work
  (launch, ``DistributedManager``, ShardTensor operators ready), with where the seconds go;
- five DDP steps in ``%%px`` cells vs the same steps in a ``torchrun`` script.

Byte ratios are the measurement script's job (``python -m shardlab.measure``), not repeated here.
Timings are this machine's, on the CPU ranks it has; they say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from ..ranks.devices import default_ranks, place_ranks, usable_cores, visible_gpus
from ..ranks.launch import run_job, write_job_result
from ..report import Table

STEPS = 5


def same_work() -> dict[str, float]:
    """On every rank of a job: the per-rank work of a cluster start, without the cluster; the slowest rank's
    seconds per phase."""
    import torch.distributed as dist

    from ..ranks.launch import init_distributed

    state = init_distributed(60)
    rows = [None] * state.world_size
    dist.all_gather_object(rows, state.phases)
    return {k: max(r[k] for r in rows) for k in rows[0]}


def ddp_steps() -> float:
    """On every rank, DistributedManager ready: seconds for STEPS DDP steps of the surrogate on a
    (ddp, domain=2) mesh, after one warm-up step (first-call costs are not the workload)."""
    from ..mesh import build_mesh
    from ..models import conv_stack
    from ..ranks.launch import default_device
    from ..train import Trainer

    trainer = Trainer(conv_stack(seed=0).to(default_device()), build_mesh(ddp=-1, domain=2), "ddp")
    trainer.step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        trainer.step()
    return time.perf_counter() - t0


def _on_ranks(name: str) -> None:
    """What ``python -m shardlab.tools.bench --job NAME`` runs on every rank of a job."""
    import torch.distributed as dist

    from ..ranks.launch import init_distributed, shutdown_distributed

    if name == "same-work":
        result = same_work()
    else:
        init_distributed(60)
        result = ddp_steps()
    if dist.get_rank() == 0:
        write_job_result(result)
    shutdown_distributed()


def _job(launcher: str, n: int, name: str, device: str):
    """(wall seconds, rank 0's result) of ``--job NAME`` on n ranks of ``device``."""
    job = run_job(launcher, n, "shardlab.tools.bench", ["--job", name], timeout_s=600, device=device)
    return job.seconds, job.result


def run(n: int | None = None) -> list[dict]:
    """The rows, on ``n`` ranks (default: one per GPU, an even count: the workload's mesh has domain groups of 2;
    4 CPU ranks without two GPUs)."""
    from ..ranks.cluster import RankCluster  # here: the ranks of a --job import only what the same work needs

    rows = []
    gpus = visible_gpus()
    n = n or default_ranks(gpus)
    device = place_ranks(n, gpus).device  # the cluster and both jobs alike
    same_work_s, phases = _job("openmpi", n, "same-work", device)
    with RankCluster(n=n, device=device) as cluster:
        start_s = cluster.start_seconds
        cluster_phases = cluster.timings
        rank_phases = {k: max(s["phases"][k] for s in cluster.states) for k in cluster.states[0]["phases"]}
        t0 = time.perf_counter()
        cluster.run("import shardlab.tools.bench\nworkload_s = shardlab.tools.bench.ddp_steps()", timeout_s=300,
                    what="run the workload")
        px_wall = time.perf_counter() - t0
        px_workload = max(cluster.view.pull("workload_s"))
    torchrun_wall, torchrun_workload = _job("torchrun", n, "ddp-steps", device)

    rows.append({"measurement": f"mpiexec -n {n} script: launch + DistributedManager + ShardTensor ops",
                 "value": same_work_s, "unit": "s"})
    for phase, seconds in phases.items():
        rows.append({"measurement": f"  of which, slowest rank: {phase}", "value": seconds, "unit": "s"})
    rows.append({"measurement": f"cluster start, {n} ranks, same work + controller + engines", "value": start_s,
                 "unit": "s"})
    for phase, seconds in cluster_phases.items():
        rows.append({"measurement": f"  of which: {phase}", "value": seconds, "unit": "s"})
    for phase, seconds in rank_phases.items():
        rows.append({"measurement": f"    in DistributedManager ready, slowest rank: {phase}", "value": seconds,
                     "unit": "s"})
    rows += [
        {"measurement": "cluster start / mpiexec script (same per-rank work)", "value": start_s / same_work_s,
         "unit": "x"},
        {"measurement": f"{STEPS} DDP steps in %%px cells (cluster already up)", "value": px_workload, "unit": "s"},
        {"measurement": f"{STEPS} DDP steps as a torchrun script", "value": torchrun_workload, "unit": "s"},
        {"measurement": f"%%px / torchrun, same {STEPS} steps", "value": px_workload / torchrun_workload, "unit": "x"},
        {"measurement": "%%px cell round trip incl. warm-up step", "value": px_wall, "unit": "s"},
        {"measurement": f"torchrun script end to end (start, init, warm-up, {STEPS} steps)", "value": torchrun_wall,
         "unit": "s"},
    ]
    return rows


def machine() -> str:
    import torch

    gpus = visible_gpus()
    kind = f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    return (f"{platform.machine()}, {usable_cores()} CPU cores, {kind}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, help="ranks of the cluster and of the scripts (default: one per GPU, an "
                                                  "even count, with two or more; else 4)")
    parser.add_argument("--json", help="also write the rows, machine and date as JSON to this file")
    parser.add_argument("--job", choices=("same-work", "ddp-steps"), help=argparse.SUPPRESS)  # on the ranks of a job
    args = parser.parse_args(argv)
    if args.job:
        _on_ranks(args.job)
        return 0
    t0 = time.perf_counter()
    rows = run(args.ranks)
    print(f"# shardlab bench, {time.strftime('%Y-%m-%d')}, {machine()}; {time.perf_counter() - t0:.0f} s")
    print(Table(rows, floatfmt=".2f", tablefmt="plain"))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
