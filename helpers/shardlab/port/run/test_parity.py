"""Parity: this run's model, laid out and fed as train.py does it, against one process on the whole sample.

    torchrun --nproc-per-node 4 test_parity.py             # every rank on domain, the sizes run.json names
    torchrun --nproc-per-node 4 test_parity.py --domain 2 --sizes 64 65

In float64: the output and every parameter's gradient, relative to the largest value of the reference, within
1e-10 (what a sum split differently rounds to), for each size (one the domain size does not divide splits
unevenly). Exits 1 when a size does not hold. Lesson 13 shows the harness this follows.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import train  # train.py, next to this file: the run this test checks
from physicsnemo.distributed import DistributedManager

TOLERANCE = 1e-10
ZERO = 1e-4  # a gradient below this share of the largest is zero in exact arithmetic: measured against that share


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def relative(got, want, floor: float = 0.0) -> float:
    got = whole(got)
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    return (got - want).abs().max().item() / (max(want.abs().max().item(), floor) or 1.0)


def parity_at(size: int, mesh) -> dict:
    device, dtype = DistributedManager().device, torch.float64
    dataset = train.SyntheticSamples(size, 1, dtype)
    sample = {name: t.to(device) for name, t in dataset[0].items()}
    reference = train.new_model(size, dtype, device)  # one process, the whole sample, on every rank alike
    want = train.call(reference, {name: sample[name] for name in train.CONFIG["inputs"]})
    train.mse(want, sample["target"]).backward()

    model = train.new_model(size, dtype, device)
    wrapped = train.wrap(model, mesh)
    inputs, target = train.batch(0, mesh, (dataset, None), device, dtype)
    got = train.call(wrapped, inputs)
    train.mse(got, target).backward()

    pairs = [(name, p, q) for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(),
                                                       strict=True) if q.grad is not None]
    floor = ZERO * max((q.grad.abs().max().item() for _, _, q in pairs), default=0.0)
    grads = {name: float("inf") if p.grad is None else relative(p.grad, q.grad, floor) for name, p, q in pairs}
    worst = max(grads, key=grads.get) if grads else None
    return {"size": size, "output": relative(got, want), "gradient": grads.get(worst, 0.0), "worst": worst,
            "parameters": len(grads)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", type=int, help="ranks per domain group (default: every rank)")
    parser.add_argument("--sizes", type=int, nargs="+", help="sizes N to check (default: run.json's for the domain)")
    args = parser.parse_args(argv)
    ours = not DistributedManager.is_initialized()  # a process that already was a rank keeps its process group
    mesh = train.start(domain=args.domain or _world())
    domain = mesh["domain"].size()
    sizes = args.sizes or train.CONFIG["parity_sizes"].get(str(domain)) or [16 * domain, 16 * domain + 1]
    held = True
    for size in sizes:
        row = parity_at(size, mesh)
        ok = row["output"] <= TOLERANCE and row["gradient"] <= TOLERANCE
        held &= ok
        if dist.get_rank() == 0:
            print(f"parity at size {size} on ddp {mesh['ddp'].size()} x domain {domain}: output {row['output']:.1e}, "
                  f"worst gradient {row['gradient']:.1e} ({row['worst']}) of {row['parameters']} parameters: "
                  f"{'holds' if ok else 'FAILS'} (bound {TOLERANCE:.0e})", flush=True)
    if ours:
        DistributedManager.cleanup(barrier=True)
    return 0 if held else 1


def _world() -> int:
    import os

    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE"):
        if name in os.environ:
            return int(os.environ[name])
    return 1


if __name__ == "__main__":
    sys.exit(main())
