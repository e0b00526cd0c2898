"""Judges of ``notebooks/04_domain_parallel_ops.ipynb``: a mean resolved across the ranks but kept distributed, a
guard that tells whether two ShardTensors split their rows the same way, and a halo exchange built by hand matched
against the ShardTensor convolution.

Each judge works out what is right from the rank's own state (its shard, its place in the mesh) and the library's
own result. ``halo_conv`` calls collectives (the library's convolution and the learner's exchange): every rank
runs it together, as ``sl.check.on_ranks`` does; the other two judges communicate with no one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from ..measure import strict_fp32


def _shard_tensor():
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor


def replicated_mean(answer, x, whole) -> str | None:
    """On a rank: ``answer`` must be a ShardTensor replicated over ``x``'s mesh that holds the mean of all of ``x``,
    whose whole field this rank also holds as ``whole`` (so the truth needs no communication)."""
    if tuple(whole.shape) != tuple(x.shape):
        return "the field given to the check is not x's (the check cell passes the wrong names)"
    truth = whole.double().mean().item()
    if not isinstance(answer, _shard_tensor()):
        kind = type(answer).__name__
        return (f"answer is a {kind}, not a ShardTensor: compute it from the sharded x and keep the result "
                "distributed (a plain value does not say where it lives or whether the ranks agree)")
    if any(p.is_partial() for p in answer.placements):
        return (f"answer is placed {tuple(answer.placements)}: each rank still holds only its own share of the "
                "sum, not the mean")
    if tuple(answer.placements) != (Replicate(),):
        return f"answer is placed {tuple(answer.placements)}: a mean that every rank holds whole is replicated"
    if answer.device_mesh.mesh.tolist() != x.device_mesh.mesh.tolist():
        return "answer lives on other ranks than x: compute it from x"
    value = answer.to_local()
    if value.numel() != 1:
        return f"answer holds {value.numel()} values on this rank; a mean over the whole field is one number"
    if not math.isclose(value.item(), truth, rel_tol=1e-5, abs_tol=1e-6):
        return f"answer holds {value.item():.6g} on this rank, which is not the mean over all of x's rows"
    return None


def _from_sizes(rows: list[int], mesh, device, width: int = 3):
    """A ShardTensor of ``sum(rows)`` × ``width`` zeros split along dim 0 with ``rows[r]`` rows on mesh rank r."""
    me = mesh.get_local_rank()
    local = torch.zeros(rows[me], width, device=device)
    return _shard_tensor().from_local(local, mesh, (Shard(0),), sharding_shapes={0: [(r, width) for r in rows]})


def layout_guard(fn, x) -> str | None:
    """On a rank: ``fn(a, b)`` must be True exactly when a and b have the same placements and the same shard sizes
    on every rank, for pairs built here on ``x``'s mesh (no communication)."""
    mesh = x.device_mesh
    n = mesh.size()
    short_last = [2] * (n - 1) + [1]  # 2n - 1 rows: the short shard on the last rank (torch.chunk's habit) ...
    short_first = short_last[::-1]  # ... or on the first: the same global shape, other rows on each rank
    ShardTensor = _shard_tensor()
    replicated = ShardTensor.from_local(torch.zeros(2 * n - 1, 3, device=x.device), mesh, (Replicate(),),
                                        sharding_shapes="chunk", global_shape=(2 * n - 1, 3))
    cases = [
        ("two tensors split the same way, the short shard on the last rank", short_last, short_last, True),
        ("two tensors of the same global shape, the short shard on the last rank in one and on the first rank in "
         "the other", short_last, short_first, False),
        ("two tensors split the same way, the short shard on the first rank", short_first, short_first, True),
        ("a tensor split over the ranks and a replicated one of the same global shape", short_last, None, False),
    ]
    for what, rows_a, rows_b, same in cases:
        a = _from_sizes(rows_a, mesh, x.device)
        b = replicated if rows_b is None else _from_sizes(rows_b, mesh, x.device)
        got = fn(a, b)
        if not isinstance(got, bool):
            return f"same_layout returned {got!r} ({type(got).__name__}); it should return True or False"
        if got != same:
            return f"same_layout says {'same' if got else 'different'} for {what}"
    return None


def _diagnose(got, expected, halo: int, rank: int, n: int) -> str | None:
    """What is wrong with a rank's convolution output, by where the wrong rows sit in its slab."""
    if tuple(got.shape) != tuple(expected.shape):
        return (f"it returned shape {tuple(got.shape)} on this rank, but this rank's slab gives an output of another "
                "shape (the output has as many rows as the rank owns)")
    scale = max(1.0, expected.abs().max().item())
    # One flag per output row of the slab: does any value in that row differ?
    wrong_rows = ((got - expected).abs() > 1e-5 * scale).any(dim=-1).flatten(0, -2).any(dim=0)
    if not wrong_rows.any():
        return None
    rows = wrong_rows.nonzero().flatten().tolist()
    top = [r for r in rows if r < halo]
    bottom = [r for r in rows if r >= got.shape[-2] - halo]
    inner = [r for r in rows if r not in top and r not in bottom]
    if inner:
        return ("rows away from the slab's edges are wrong too, so it is not only the halo: check the convolution "
                "itself (weights, bias, padding along W) and that it uses the rows it was given")
    where = []
    if top:
        where.append("the top rows, which need the rows of the rank above" if rank > 0
                     else "the top rows, where the field ends and the padding is zeros")
    if bottom:
        where.append("the bottom rows, which need the rows of the rank below" if rank < n - 1
                     else "the bottom rows, where the field ends and the padding is zeros")
    return "only the rows next to the slab's edges are wrong: " + " and ".join(where)


def halo_conv(fn, x) -> str | None:
    """On a rank: ``fn(local, conv, group)`` must return this rank's rows of ``conv`` applied to the whole field,
    from this rank's rows and its neighbours' edge rows, equal to the ShardTensor convolution's local output.

    Tried on ``x`` with a 3×3 kernel and on a field of the judge's own, split unevenly, with a 5×5 kernel."""
    from physicsnemo.domain_parallel import scatter_tensor

    mesh = x.device_mesh
    group, n, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    source = dist.get_global_rank(group, 0)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(4)  # the CPU generator only: the same weights and field on every rank
        convs = [torch.nn.Conv2d(x.shape[1], 4, k, padding=k // 2) for k in (3, 5)]
        # 4n - 1 rows: every rank owns 4 rows but the last, which owns 3 (uneven, and enough for a 5x5 halo).
        field = torch.randn(1, x.shape[1], 4 * n - 1, 8)
    convs = [conv.to(x.device) for conv in convs]
    own = scatter_tensor(field.to(x.device), source, mesh, (Shard(2),))
    with torch.no_grad(), strict_fp32():
        for what, conv, sharded in (("x with a 3x3 kernel", convs[0], x), ("another field, split unevenly, with a "
                                                                            "5x5 kernel", convs[1], own)):
            expected = conv(sharded).to_local()
            got = fn(sharded.to_local(), conv, group)
            if not isinstance(got, torch.Tensor) or isinstance(got, _shard_tensor()):
                return (f"conv_with_halos returned a {type(got).__name__}; it should return this rank's output rows as "
                        "a plain tensor")
            if got.device != expected.device:
                return f"it returned a tensor on {got.device}, not on this rank's device"
            problem = _diagnose(got, expected, conv.kernel_size[0] // 2, me, n)
            if problem:
                return f"on {what}: {problem}"
    return None
