"""Measure layer: wall-clock and byte figures taken live, side by side in one run.

Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .cluster import find_mpiexec, mpi_arguments, mpi_environment


def bare_mpiexec_seconds(n: int = 4, code: str = "import physicsnemo", timeout_s: float = 180.0) -> float:
    """Seconds for ``mpiexec -n n python -c code``: the floor under any MPI cluster start."""
    cmd = [find_mpiexec(), "-n", str(n), *mpi_arguments(n), sys.executable, "-c", code]
    env = os.environ | mpi_environment()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"mpiexec -n {n} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def local_bytes(t) -> int:
    """Bytes this rank holds for a tensor: the local shard of a ShardTensor/DTensor, else the tensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class SavedActivations:
    """Bytes autograd saves for backward inside ``with`` (unique tensors, parameters excluded).

    On CPU this is the activation memory a backward pass will need; on GPU compare it with
    ``torch.cuda.max_memory_allocated``.
    """

    def __init__(self, exclude=()):
        self._exclude = {p.data_ptr() for p in exclude}
        self._seen: set[tuple[int, tuple]] = set()
        self.bytes = 0
        self.tensors = 0

    def _pack(self, t):
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.data_ptr(), tuple(local.shape))
        if local.data_ptr() not in self._exclude and key not in self._seen:
            self._seen.add(key)
            self.bytes += local_bytes(local)
            self.tensors += 1
        return t

    def __enter__(self):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _collective_counter_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        """Counts collectives and the bytes of the tensors handed to them, plus the largest tensor seen."""

        NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

        def __init__(self):
            super().__init__()
            self.ops: dict[str, dict[str, int]] = {}
            self.largest_tensor_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch.utils._pytree import tree_flatten

            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            for t in tensors:
                self.largest_tensor_bytes = max(self.largest_tensor_bytes, t.numel() * t.element_size())
            if func.namespace in self.NAMESPACES and not func.__name__.startswith(("wait_tensor", "_wrap")):
                name = str(func.overloadpacket).split(".")[-1]
                entry = self.ops.setdefault(name, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                entry["bytes"] += sum(t.numel() * t.element_size() for t in inputs)
            return out

    return CollectiveBytes()


def collective_bytes():
    """A ``with`` block that records, on this rank, each collective's calls and input bytes
    (``.ops``) and the largest tensor any op touched (``.largest_tensor_bytes``)."""
    return _collective_counter_mode()


def activation_bytes_by_domain_size(model, field, sizes=(1, 2, 4), dim: int = 2) -> dict[int, int]:
    """On this rank: bytes saved for backward by ``model(field)`` with the field sharded over N domain ranks.

    Call on every rank together; for each N it builds a (world/N, N) mesh and scatters the field
    along ``dim`` (N = 1 runs the plain tensor).
    """
    import torch.distributed as dist
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    world = dist.get_world_size()
    result = {}
    for n in sizes:
        if world % n:
            raise ValueError(f"domain size {n} does not divide the world size {world}")
        if n == 1:
            x = field.clone()
        else:
            mesh = init_device_mesh("cpu" if field.device.type == "cpu" else "cuda", (world // n, n),
                                    mesh_dim_names=("ddp", "domain"))
            x = scatter_tensor(field, dist.get_global_rank(mesh["domain"].get_group(), 0), mesh["domain"], (Shard(dim),))
        with SavedActivations(exclude=model.parameters()) as saved:
            model(x)
        result[n] = saved.bytes
    return result


def ideal_activation_ratio(n: int, height: int, kernel_size: int) -> float:
    """1/N of the rows, plus the k//2 halo rows on each side that a sharded conv input carries."""
    return 1.0 if n == 1 else 1.0 / n + 2 * (kernel_size // 2) / height


def max_diff_to_source(module, group, src: int) -> float:
    """Largest |value − value on the source rank| over a module's parameters and buffers, across ``group``.

    Every rank of the group gets the same answer (0.0 means the module is in sync).
    """
    import torch
    import torch.distributed as dist

    worst = 0.0
    for t in [*module.parameters(), *module.buffers()]:
        ref = t.detach().clone()
        dist.broadcast(ref, src=src, group=group)
        worst = max(worst, (t.detach().float() - ref.float()).abs().max().item())
    device = next(iter([*module.parameters(), *module.buffers()])).device
    worst = torch.tensor([worst], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()


def _activation_report(args) -> dict:
    import torch.distributed as dist

    from .data import load_darcy
    from .launch import init_distributed
    from .models import conv_stack

    state = init_distributed(args.timeout)
    field = load_darcy(samples=1)["permeability"].to(state.device)
    model = conv_stack(width=args.width, layers=args.layers, kernel_size=args.kernel_size).to(state.device)
    mine = activation_bytes_by_domain_size(model, field, sizes=args.sizes)
    everyone = [None] * state.world_size
    dist.all_gather_object(everyone, mine)
    height = field.shape[2]
    rows = []
    base = max(r[1] for r in everyone) if 1 in args.sizes else None
    for n in args.sizes:
        largest = max(r[n] for r in everyone)
        ratio = largest / base if base else float("nan")
        ideal = ideal_activation_ratio(n, height, args.kernel_size)
        rows.append({"N": n, "bytes_max_rank": largest, "ratio": ratio, "ideal_halo": ideal, "ideal_1_over_N": 1 / n,
                     "ratio_over_ideal": ratio / ideal})
    return {"rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "model": f"conv_stack(width={args.width}, layers={args.layers}, kernel_size={args.kernel_size})",
            "field": list(field.shape), "rows": rows}


def main(argv=None) -> int:
    """``python -m shardlab.measure activation-memory``: activation bytes per rank for N = 1, 2, 4, one table."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m shardlab.measure", description=main.__doc__)
    parser.add_argument("what", choices=["activation-memory"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="domain sizes (default 1 2 4)")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--kernel-size", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--json", help="also write the table as JSON to this file")
    args = parser.parse_args(argv)

    from .launch import detect_launch

    if detect_launch().launcher == "none":
        # Not under a launcher: start one rank per slot of the largest domain size, same arguments.
        n = max(args.sizes)
        argv = sys.argv[1:] if argv is None else list(argv)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               "-m", "shardlab.measure", *argv]
        return subprocess.run(cmd, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600).returncode

    report = _activation_report(args)
    if report["rank"] == 0:
        print(f"# activation memory per rank: bytes saved for backward by {report['model']} on a "
              f"{'x'.join(map(str, report['field']))} Darcy field, fp32")
        print(f"# {report['world_size']} ranks, backend {report['backend']}, device {report['device']}; "
              "ratio = largest rank's bytes at N / at N=1")
        print(f"{'N':>3} {'bytes_max_rank':>15} {'ratio':>8} {'ideal_1/N+halo':>15} {'ideal_1/N':>10} {'ratio/ideal':>12}")
        for r in report["rows"]:
            print(f"{r['N']:>3} {r['bytes_max_rank']:>15} {r['ratio']:>8.4f} {r['ideal_halo']:>15.4f} "
                  f"{r['ideal_1_over_N']:>10.4f} {r['ratio_over_ideal']:>12.4f}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
