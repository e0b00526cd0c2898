"""Judges of ``notebooks/04_domain_parallel_ops.ipynb``: a mean resolved across the ranks but kept distributed, a
guard that tells whether two ShardTensors split their rows the same way, and a halo exchange built by hand matched
against the ShardTensor convolution.

Every answer is a function, called on fields and splits of the judge's own (uneven, other kernels), with what is
right worked out from what the judge built or from the library's own result, computed outside the judged call.
Each call is watched: which collectives ran, over which ranks, with how many bytes, and whether the library code an
exercise rebuilds ran. The judges call collectives: every rank runs them together, as ``sl.exercises.on_ranks`` does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from ..measure.memory import strict_fp32
from .judging import Watch, case_generator, earlier_object, second_hint

SMALL = 64  # bytes: a resolved mean moves a number or two, never rows of the field


def _shard_tensor():
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor


def _uneven_field(mesh, device, rng, min_rows: int = 1, channels: int = 1):
    """(the whole field, the same on every rank; the field scattered along H over ``mesh``), drawn from ``rng``: rows
    that do not divide over the ranks, at least ``min_rows`` on each, and a width of 5 to 10."""
    from physicsnemo.domain_parallel import scatter_tensor

    n = mesh.size()
    per_rank = rng.randint(max(2, min_rows + 1), max(2, min_rows + 1) + 3)
    height = per_rank * n - rng.randint(1, min(per_rank - min_rows, n - 1)) if n > 1 else per_rank
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    whole = torch.randn(1, channels, height, rng.randint(5, 10), generator=generator).to(device)
    return whole, scatter_tensor(whole, dist.get_global_rank(mesh.get_group(), 0), mesh, (Shard(2),))


@second_hint(
    "Take the mean on the ShardTensor, then resolve that one number: "
    "t.mean().redistribute(placements=[Replicate()]). Redistributing t itself first moves every row (the check "
    "counts the bytes), and averaging each rank's own mean is wrong as soon as the slabs are uneven."
)
def replicated_mean(mean_of, x) -> str | None:
    """Exercise 1. Doing it means: let each rank reduce its own rows (a ``Partial`` sum), then resolve the partial
    value over the mesh (one all-reduce of a number), and keep the result a ShardTensor that every rank holds whole.

    ``mean_of(t)`` is called on ``x`` and on two fields of different shapes drawn for each check, split unevenly (so
    a mean of the ranks' means is wrong). Observed: the collectives (an all-reduce over the mesh, nothing carrying
    rows of the field) and the result's type, placement, mesh and value, against the mean of the judge's own whole
    field."""
    ShardTensor = _shard_tensor()
    if not callable(mean_of):
        return f"mean_of is a {type(mean_of).__name__}: define a function mean_of(t) that returns a ShardTensor"
    mesh, n = x.device_mesh, x.device_mesh.size()
    ranks = dist.get_process_group_ranks(mesh.get_group())
    rng = case_generator()
    # Two fields of different shapes: an answer fitted to any one shape the judge could draw still meets the other.
    drawn = [_uneven_field(mesh, x.device, rng, channels=c) for c in (1, rng.randint(2, 3))]
    x_whole = x.full_tensor()  # every rank gathers it here, outside the judged call and before any verdict
    cases = [("x", x, x_whole)] + [(f"a {tuple(whole.shape)} field split unevenly", own, whole) for whole, own in drawn]
    runs = []
    for what, t, full in cases:  # every call on every rank, then verdicts: no rank leaves a collective early
        with Watch() as watch:
            runs.append((what, t, full, mean_of(t), watch))
    for what, t, full, answer, watch in runs:
        truth = full.double().mean().item()
        bulky = [e for e in watch.collectives() if e.bytes > SMALL]
        if bulky:
            return (f"on {what}, one {bulky[0].name} call moved {bulky[0].bytes} bytes (the field: {full.nbytes}): "
                    "reduce each rank's rows first and resolve the Partial; only a number needs to travel")
        if not isinstance(answer, ShardTensor):
            kind = type(answer).__name__
            return (f"on {what}, mean_of returned a {kind}, not a ShardTensor: compute it from the sharded t and keep "
                    "the result distributed (a plain value does not say where it lives or whether the ranks agree)")
        if any(p.is_partial() for p in answer.placements):
            return (f"on {what}, the result is placed {tuple(answer.placements)}: each rank still holds only its own "
                    "share of the sum, not the mean")
        if tuple(answer.placements) != (Replicate(),):
            return f"on {what}, the result is placed {tuple(answer.placements)}: a mean all ranks hold is replicated"
        if answer.device_mesh.mesh.tolist() != mesh.mesh.tolist():
            return f"on {what}, the result lives on other ranks than t: compute it from t"
        if earlier_object(answer, mean_of):
            return f"on {what}, {earlier_object(answer, mean_of)}, not the mean of t"
        value = answer.to_local()
        if value.numel() != 1:
            return f"on {what}, the result holds {value.numel()} values on this rank; a mean of the whole field is one"
        got = value.item()
        if math.isclose(got, truth, rel_tol=1e-5, abs_tol=1e-6):
            if n > 1 and not watch.collectives("all_reduce", ranks=ranks):
                return f"on {what}, the value is right but nothing was all-reduced over t's mesh: where is it from"
            continue
        means = [c.double().mean().item() for c in full.chunk(n, dim=2)]
        if math.isclose(got, sum(means) / n, rel_tol=1e-5, abs_tol=1e-6):
            return (f"on {what}, the result is the mean of the ranks' means: with uneven shards the ranks hold "
                    "different numbers of values, so that is not the field's mean")
        if t is not x and math.isclose(got, x_whole.double().mean().item(), rel_tol=1e-5, abs_tol=1e-6):
            return f"on {what}, the result is x's mean, not the mean of the tensor it was given"
        return f"on {what}, the result holds {got:.6g} on this rank, expected the mean of all of t's rows, {truth:.6g}"
    return None


def _from_sizes(rows: list[int], mesh, device, width: int = 3):
    """A ShardTensor of ``sum(rows)`` × ``width`` zeros split along dim 0 with ``rows[r]`` rows on mesh rank r."""
    me = mesh.get_local_rank()
    local = torch.zeros(rows[me], width, device=device)
    return _shard_tensor().from_local(local, mesh, (Shard(0),), sharding_shapes={0: [(r, width) for r in rows]})


def _layout_pairs(rng, n: int) -> list[tuple[str, tuple, tuple, bool, bool]]:
    """(what, a, b, same layout?, do the placements alone differ?), a and b described for ``_build``, drawn: the same
    split twice; two ranks' shards swapped (the same global shape, other rows on those ranks); one rank's shard changed
    (so the other ranks' shards match); a replicated tensor; another split twice; and two pairs whose shard sizes agree
    on every rank while their placements differ: blocks split by rows beside blocks of the same shape split by columns,
    and a partial tensor beside a replicated one."""
    sizes = [rng.randint(1, 4) for _ in range(n)]
    while len(set(sizes)) == 1:
        sizes[rng.randrange(n)] = rng.randint(1, 4)
    i, j = rng.choice([(i, j) for i in range(n) for j in range(i + 1, n) if sizes[i] != sizes[j]])
    swapped = list(sizes)
    swapped[i], swapped[j] = sizes[j], sizes[i]
    changed = list(sizes)
    changed[i] = rng.choice([r for r in range(1, 6) if r != sizes[i]])
    other = [rng.randint(1, 4) for _ in range(n)]
    block = (rng.randint(1, 4), rng.randint(2, 5))  # every rank's shard, in both tensors of the pair
    by_rows = ("rows", [block[0]] * n, block[1])
    pairs = [(f"two tensors split {sizes} rows", ("rows", sizes), ("rows", sizes), True, False),
             (f"tensors split {sizes} and {swapped} rows", ("rows", sizes), ("rows", swapped), False, False),
             (f"tensors split {sizes} and {changed} rows", ("rows", sizes), ("rows", changed), False, False),
             (f"a tensor split {sizes} rows and a replicated one of the same global shape", ("rows", sizes),
              ("replicated", sizes), False, False),
             (f"two tensors split {other} rows", ("rows", other), ("rows", other), True, False),
             (f"a tensor split by rows (Shard(0)) and one split by columns (Shard(1)), every rank holding a {block[0]}x"
              f"{block[1]} block of each", by_rows, ("columns", block), False, True),
             (f"a partial tensor (Partial()) and a replicated one (Replicate()) of the same shape, {sum(sizes)}x3",
              ("partial", sizes), ("replicated", sizes), False, True)]
    rng.shuffle(pairs)
    return pairs


def _build(spec: tuple, mesh, device):
    """The ShardTensor a ``_layout_pairs`` description stands for: ("rows", rows per rank[, width]) split along dim 0;
    ("columns", (height, width per rank)) split along dim 1; ("replicated" or "partial", rows per rank) the whole
    ``sum(rows)`` × 3 on every rank, placed Replicate() or Partial()."""
    kind, n = spec[0], mesh.size()
    if kind == "rows":
        return _from_sizes(spec[1], mesh, device, *spec[2:])
    if kind == "columns":
        height, width = spec[1]
        return _shard_tensor().from_local(torch.zeros(height, width, device=device), mesh, (Shard(1),),
                                          sharding_shapes={0: [(height, width)] * n})
    placement = Replicate() if kind == "replicated" else Partial()
    shape = (sum(spec[1]), 3)
    return _shard_tensor().from_local(torch.zeros(shape, device=device), mesh, (placement,),
                                      sharding_shapes="chunk", global_shape=shape)


@second_hint(
    "Compare two things, both: tuple(a.placements) == tuple(b.placements), and a._spec.sharding_shapes() == "
    "b._spec.sharding_shapes(), every rank's shard shape (this rank's to_local().shape is not enough). Equal "
    "shard sizes alone are not enough either: rows against columns, or Partial against Replicate, can have the "
    "same."
)
def layout_guard(fn, x) -> str | None:
    """Exercise 2. Doing it means: compare what both tensors' specs record about every rank, the placements and the
    shard sizes (``_spec.sharding_shapes()``), on this rank, without communicating: every rank holds them all.

    ``fn(a, b)`` is called on pairs the judge draws for each check on ``x``'s mesh (aligned and misaligned uneven
    splits, among them misaligned ones whose shards match on some ranks, a replicated tensor, and pairs whose shard
    sizes agree on every rank while their placements differ) and must say True exactly for the aligned ones. Any
    collective during the calls fails."""
    mesh = x.device_mesh
    cases = _layout_pairs(case_generator(), mesh.size())
    pairs = [(_build(a, mesh, x.device), _build(b, mesh, x.device)) for _, a, b, _, _ in cases]
    with Watch() as watch:
        answers = [fn(a, b) for a, b in pairs]
    if watch.collectives():
        used = sorted({e.name for e in watch.collectives()})
        return (f"the guard communicated ({', '.join(used)}): every rank's spec already records every rank's shard "
                "sizes, so compare them without asking the other ranks (and without the values)")
    for (what, _, _, same, placements_alone), (a, b), got in zip(cases, pairs, answers):
        if not isinstance(got, bool):
            return f"same_layout returned {got!r} ({type(got).__name__}); it should return True or False"
        if got != same:
            if len(set(answers)) == 1:
                return (f"same_layout says {'same' if got else 'different'} for every pair, {what} among them: "
                        "compare the two tensors it is given")
            if placements_alone:
                return (f"same_layout says same for {what}, expected False: their shard sizes agree on every rank, "
                        f"but their placements, {tuple(a.placements)} and {tuple(b.placements)}, say that the shards "
                        "hold different things")
            return f"same_layout says {'same' if got else 'different'} for {what}, expected {same}"
    return None


def _diagnose(got, expected, halo: int, rank: int, n: int) -> str | None:
    """What is wrong with a rank's convolution output, by where the wrong rows sit in its slab."""
    if tuple(got.shape) != tuple(expected.shape):
        return (f"it returned shape {tuple(got.shape)} on this rank, but this rank's slab gives an output of another "
                "shape (as many rows as the rank owns: k//2 halo rows on each side, k read from the conv it is given)")
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
        return ("rows away from the slab's edges are wrong too, so it is not only the halo: the output must come from "
                "the rows it was given (local) and conv's own weights and bias, with padding along W")
    where = []
    if top:
        where.append("the top rows, which need the rows of the rank above" if rank > 0
                     else "the top rows, where the field ends and the padding is zeros")
    if bottom:
        where.append("the bottom rows, which need the rows of the rank below" if rank < n - 1
                     else "the bottom rows, where the field ends and the padding is zeros")
    return "only the rows next to the slab's edges are wrong: " + " and ".join(where)


@second_hint(
    "h = conv.kernel_size[0] // 2, not a typed 1 (the check tries kernels up to 9). Send local[..., :h, :] to the"
    " rank above (dist.get_rank(group) − 1) and local[..., -h:, :] to the rank below; what comes from above goes "
    "on top: F.conv2d(torch.cat([above, local, below], dim=-2), conv.weight, conv.bias, padding=(0, h)), zeros "
    "where there is no neighbour."
)
def halo_conv(fn, x) -> str | None:
    """Exercise 3. Doing it means: each rank sends its top k//2 rows to the rank above and its bottom k//2 rows to the
    rank below (point-to-point, or one all-to-all), receives theirs, stands zeros in where the field ends, and
    convolves the stacked rows with padding along W only.

    ``fn(local, conv, group)`` is called on ``x`` and on a field drawn for each check, split unevenly, with kernel sizes
    drawn among 3 and 5 and among 7 and 9, and random weights. Observed: ShardTensor's own halo exchange must not run in
    the call; every message is at most the halo rows (nothing gathers the field); rows go to the neighbours; and the
    output rows equal the ShardTensor convolution's, computed by the judge outside the call."""
    from physicsnemo.domain_parallel.shard_utils import conv_patches, halo

    mesh = x.device_mesh
    group, n, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    ranks = dist.get_process_group_ranks(group)
    neighbours = [ranks[k] for k in (me - 1, me + 1) if 0 <= k < n]
    rng = case_generator()
    kernels = rng.sample([rng.choice((3, 5)), rng.choice((7, 9))], 2)  # one the 3x3 and 5x5 of the lesson never show
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(rng.randrange(2**31))  # the CPU generator only: the same on every rank
        convs = [torch.nn.Conv2d(x.shape[1], rng.randint(2, 5), k, padding=k // 2).to(x.device) for k in kernels]
    _, own = _uneven_field(mesh, x.device, rng, min_rows=kernels[1] // 2, channels=x.shape[1])
    cases = ((f"x with a {kernels[0]}x{kernels[0]} kernel", convs[0], x),
             (f"another field, split unevenly, with a {kernels[1]}x{kernels[1]} kernel", convs[1], own))
    runs = []
    with torch.no_grad(), strict_fp32():
        for what, conv, sharded in cases:  # every rank runs both cases before any verdict: no rank leaves early
            expected = conv(sharded).to_local()
            with Watch(partial_conv_nd=(conv_patches.partial_conv_nd, halo.perform_halo_collective)) as watch:
                got = fn(sharded.to_local(), conv, group)
            runs.append((what, conv, sharded.to_local(), expected, got, watch))
    for what, conv, local, expected, got, watch in runs:
        problem = watch.forbidden(partial_conv_nd="ShardTensor's convolution with its own halo exchange, which this "
                                                  "exercise builds by hand")
        if problem:
            return f"on {what}: {problem}"
        h = conv.kernel_size[0] // 2
        halo_bytes = h * local[..., :1, :].nbytes  # h rows of this rank's slab
        bulky = [e for e in watch.collectives() if e.bytes > 2 * halo_bytes + SMALL]
        if bulky:
            return (f"on {what}: one {bulky[0].name} call moved {bulky[0].bytes} bytes; a {2 * h + 1}x{2 * h + 1} "
                    f"kernel needs only {h} row(s) from each neighbour ({halo_bytes} bytes each way): exchange the "
                    "edge rows")
        if not isinstance(got, torch.Tensor) or isinstance(got, _shard_tensor()):
            return (f"on {what}: conv_with_halos returned a {type(got).__name__}; it should return this rank's output "
                    "rows as a plain tensor")
        if got.device != expected.device:
            return f"on {what}: it returned a tensor on {got.device}, not on this rank's device"
        problem = _diagnose(got, expected, h, me, n)
        if problem:
            return f"on {what}: {problem}"
        sent_to = {e.peer for e in watch.collectives("send")}
        if not watch.collectives("all_to_all", ranks=ranks) and not set(neighbours) <= sent_to:
            return (f"on {what}: the rows are right, but this rank sent nothing to its neighbour(s) {neighbours}: "
                    "where did the halo rows come from? Receive them from the neighbours")
    return None
