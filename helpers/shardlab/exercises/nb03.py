"""Judges of ``notebooks/03_scatter_and_shardtensor.ipynb``: the rows a rank owns in an unequal decomposition, the
block a rank holds after a scatter along W, a scatter built by hand (broadcast + narrow +
``ShardTensor.from_local``), and what a rank's shard keeps allocated after a scatter.

Every answer is a function. Each judge calls it on tensors and layouts of its own (other shapes, uneven splits, the
ddp axis of the mesh as well as the domain axis), works out what is right from what it built (or from the library's
own result, computed outside the judged call), and watches the call: the library function an exercise rebuilds may
not run inside it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..ranks.launch import default_device
from .judging import Watch, case_generator, earlier_object, second_hint


def _shard_tensor():
    from physicsnemo.domain_parallel import ShardTensor

    return ShardTensor


def _field(shape, seed: int, device) -> torch.Tensor:
    """The same tensor on every rank, from the CPU generator: each rank knows the whole of it without asking."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _slabs(sizes: list[int], mesh, device, width: int = 5):
    """A ShardTensor (1, 1, sum(sizes), width) split along H with ``sizes[k]`` rows on the mesh's k-th rank."""
    k = mesh.get_local_rank()
    local = torch.zeros(1, 1, sizes[k], width, device=device)
    shapes = [(1, 1, s, width) for s in sizes]
    return _shard_tensor().from_local(local, mesh, (Shard(2),), sharding_shapes={0: shapes})


def _rising_sizes(rng, n: int) -> list[int]:
    """``n`` different slab heights, smallest first: a rank's start is then never its place times its own height, nor
    torch.chunk's split of the total."""
    return sorted(rng.sample(range(1, 3 * n + 4), n))


@second_hint(
    "The slabs are uneven, so k × height is wrong. Read every rank's height from t._spec.sharding_shapes()[0] "
    "(shape[2] of each), and k from t.device_mesh.get_local_rank(), not dist.get_rank(): start is the sum of the "
    "heights before k, stop adds this rank's own; both are row numbers of the whole field."
)
def rows_held(rows_of, slabs, mesh) -> str | None:
    """Exercise 1. Doing it means: read every rank's slab height from the spec (``_spec.sharding_shapes()``) and add
    up the heights of the ranks before this one, counted by this rank's place in the tensor's own mesh.

    ``rows_of(t)`` is called on ``slabs`` and on ShardTensors the judge builds with slab sizes drawn for each check
    (rising, falling, one tall slab first), on the 1-D mesh of all ranks and on the domain axis (where a rank's place
    differs from its global rank). ShardTensor's own ``offsets`` (the library's answer) may not run."""
    if not callable(rows_of):
        return f"rows_of is a {type(rows_of).__name__}: define a function rows_of(t) that returns (start, stop)"
    device, rng = default_device(), case_generator()
    line, domain = slabs.device_mesh, mesh["domain"]
    n, d = line.size(), domain.size()
    rising, falling = _rising_sizes(rng, n), _rising_sizes(rng, n)[::-1]
    tall_first = [rng.randint(4, 9)] + [rng.randint(1, 3) for _ in range(d - 1)]
    cases = [("slabs", slabs, None), (f"slabs of {rising} rows", _slabs(rising, line, device), rising),
             (f"slabs of {falling} rows", _slabs(falling, line, device), falling),
             (f"a tensor split {tall_first} over mesh['domain']", _slabs(tall_first, domain, device), tall_first)]
    with Watch(offsets=_shard_tensor().offsets) as watch:
        answers = [rows_of(t) for _, t, _ in cases]
    problem = watch.forbidden(offsets="which computes the answer for you: add up the slab heights the spec records")
    if problem:
        return problem
    if len({repr(a) for a in answers}) == 1:
        return (f"rows_of returned {answers[0]!r} for every tensor, whatever its slabs: read the rows from the tensor "
                "it is given")
    for (what, t, sizes), got in zip(cases, answers):
        if sizes is None:  # the notebook's slabs: their sizes as the spec records them
            sizes = [shape[2] for shape in t._spec.sharding_shapes()[0]]
        k = t.device_mesh.get_local_rank()
        right = (sum(sizes[:k]), sum(sizes[:k + 1]))
        if not isinstance(got, tuple) or len(got) != 2 or not all(isinstance(v, int) for v in got):
            return f"on {what}, rows_of returned {got!r}: return a tuple of two ints, (start, stop)"
        if got == right:
            continue
        start, stop = got
        rank = dist.get_rank()
        said = f"on {what}, rows_of returned {got} on the rank at place {k}, expected {right}"
        if rank != k and got == (sum(sizes[:rank]), sum(sizes[:rank + 1])):
            return (f"{said}: the rows were counted by this rank's global rank ({rank}); its place in this tensor's "
                    "mesh is t.device_mesh.get_local_rank()")
        if stop - start != sizes[k]:
            return f"{said}: ({start}, {stop}) spans {stop - start} rows, but this rank's slab has another height"
        if start == 0:
            return f"{said}: start is 0 on a rank whose slab does not begin the field; count the rows before it"
        return f"{said}: the ranks before it own other numbers of rows"
    return None


def _chunk_widths(width: int, n: int) -> list[int]:
    """torch.chunk's split of ``width`` over ``n`` ranks, 0 for the ranks it runs out before."""
    sizes = [c.shape[0] for c in torch.empty(width, device="meta").chunk(n)]
    return sizes + [0] * (n - len(sizes))


def _balanced_widths(width: int, n: int) -> list[int]:
    """torch.tensor_split's split: the leftover columns one each to the first ranks (a plausible, wrong prediction)."""
    return [width // n + (j < width % n) for j in range(n)]


def _uneven_size(rng, n: int, low: int, high: int, chunk_runs_out: bool = False) -> int:
    """A size in [low, high) that does not divide over ``n`` ranks, where torch.chunk's split differs from the balanced
    one when ``n`` > 2, and where torch.chunk runs out before the last rank exactly when ``chunk_runs_out``."""
    widths = [w for w in range(max(low, n), high) if n == 1 or (
        w % n and (0 in _chunk_widths(w, n)) == chunk_runs_out
        and (n < 3 or _chunk_widths(w, n) != _balanced_widths(w, n)))]
    return rng.choice(widths) if widths else rng.randrange(max(low, n), high)


@second_hint(
    "Only W changes; N, C and H stay. With per = ceil(W / n) (-(-W // n)), rank k holds min(per, W − k × per) "
    "columns, and never fewer than 0: W = 6 over 4 ranks gives 2, 2, 2 and 0, W = 7 over 4 gives 2, 2, 2, 1."
)
def w_shard_shape(predict, mesh) -> str | None:
    """Exercise 2. Doing it means: predict, without scattering anything, the block of a (N, C, H, W) tensor that
    rank ``k`` of ``n`` holds after ``scatter_tensor(..., (Shard(3),))``: torch.chunk's split of W, ceil(W / n)
    columns per rank until they run out (none left for the last ranks when W is small: there PhysicsNeMo 2.2.2's
    scatter_tensor fails on those ranks, and its spec records ``compute_split_shapes``' other split).

    ``predict(shape, n, k)`` is called for shapes drawn for each check (not square, W not divisible by n) and compared
    with what ``scatter_tensor`` really gives this rank over ``mesh["domain"]`` (scattered by the judge, outside the
    call), and for every rank of other group sizes with torch.chunk's split: one width where the balanced split (the
    leftover columns to the first ranks) differs from it, one where torch.chunk runs out of columns before the last
    rank. Scattering or chunking inside the call fails: it is the library doing the prediction."""
    from physicsnemo.distributed.utils import compute_split_shapes
    from physicsnemo.domain_parallel import scatter_tensor

    if not callable(predict):
        return f"w_shard_shape is a {type(predict).__name__}: define a function w_shard_shape(shape, n, k)"
    domain, device, rng = mesh["domain"], default_device(), case_generator()
    n, k = domain.size(), domain.get_local_rank()
    source = dist.get_global_rank(domain.get_group(), 0)
    live = []
    for _ in range(2):
        shape = (rng.randint(1, 2), rng.randint(1, 3), rng.randint(4, 20), _uneven_size(rng, n, 21, 64))
        sample = _field(shape, rng.randrange(2**31), device)
        live.append((shape, n, k, tuple(scatter_tensor(sample, source, domain, (Shard(3),)).to_local().shape)))
    more = []
    for m, runs_out in ((rng.randint(3, 6), False), (rng.randint(4, 7), True)):
        shape = (1, rng.randint(1, 3), rng.randint(4, 12), _uneven_size(rng, m, m + 1, 6 * m, runs_out))
        more += [(shape, m, j) for j in range(m)]
    rng.shuffle(more)
    with Watch(scatter_tensor=scatter_tensor, chunk=(torch.chunk, torch.Tensor.chunk),
               tensor_split=(torch.tensor_split, torch.Tensor.tensor_split)) as watch:
        got_live = [predict(shape, n_, k_) for shape, n_, k_, _ in live]
        got_more = [predict(shape, m, j) for shape, m, j in more]
    problem = watch.forbidden(scatter_tensor="which makes the block instead of predicting it",
                              chunk="which splits a tensor for you: predict the split by arithmetic",
                              tensor_split="which splits a tensor for you: predict the split by arithmetic")
    if problem:
        return problem
    if len({repr(g) for g in got_live + got_more}) == 1:
        return (f"w_shard_shape returned {got_more[0]!r} for every shape and rank: work the block out from the "
                "arguments")
    truth = [right for *_, right in live] + [(*shape[:3], _chunk_widths(shape[3], m)[j]) for shape, m, j in more]
    for (shape, m, j), got, right in zip([(s, n_, k_) for s, n_, k_, _ in live] + more, got_live + got_more, truth):
        where = f"for a {shape} tensor on rank {j} of {m}"
        got = tuple(got) if isinstance(got, (list, torch.Size)) else got
        if not isinstance(got, tuple) or not all(isinstance(v, int) for v in got):
            return f"{where} it returned {got!r}: return the local shape as a tuple of ints"
        if got == right:
            continue
        said, width = f"{where} it returned {got}, expected {right}", shape[3]
        if got == tuple(shape):
            return f"{said}: that is the global shape; the rank holds only its own columns"
        if len(got) != 4 or got[:3] != tuple(shape[:3]):
            return f"{said}: Shard(3) splits W, the last dimension, and leaves N, C and H whole"
        if got[3] == -(-width // m):
            return f"{said}: every rank gets ceil(W / n) columns only until they run out"
        if got[3] == _balanced_widths(width, m)[j]:
            return (f"{said}: that spreads the leftover columns over the first ranks (torch.tensor_split's split); "
                    "scatter_tensor slices with torch.chunk")
        if got[3] == compute_split_shapes(width, m)[j]:
            return (f"{said}: that is compute_split_shapes' split, which the spec records, but scatter_tensor slices "
                    "the data with torch.chunk")
        return f"{said}: that is not the block that rank holds"
    return None


@second_hint(
    "Only src holds the tensor. Send (shape, dtype) first with dist.broadcast_object_list([...], src=src, "
    "group=mesh.get_group()), create torch.empty(shape, dtype=dtype, device=device) on the other ranks, and "
    "dist.broadcast into it. Then narrow dim 2 from mesh.get_local_rank() × ceil(H / n), and wrap with "
    'ShardTensor.from_local(local, mesh, (Shard(2),), sharding_shapes="chunk", global_shape=...).'
)
def scatters_by_hand(scatter_by_hand, mesh) -> str | None:
    """Exercise 3. Doing it means: the source broadcasts the tensor's shape and dtype, then the tensor, over the group
    it is given; each rank narrows it to torch.chunk's rows for its place in that group and wraps them with
    ``ShardTensor.from_local`` (no data moves in that step).

    ``scatter_by_hand(tensor, src, mesh)`` (the tensor on the source only, ``None`` elsewhere) is called with tensors
    drawn for each check, their rows not divisible by the group's size, over ``mesh["domain"]`` and over
    ``mesh["ddp"]`` (another group), each from a source drawn among the group's ranks after its first.
    Observed: a broadcast over that group carrying the tensor's bytes, a call of ``ShardTensor.from_local``, and the
    result (type, mesh, placement, global shape, shard sizes, local values), against the judge's own tensor.
    ``scatter_tensor`` may not run in the call."""
    from physicsnemo.domain_parallel import scatter_tensor

    if not callable(scatter_by_hand):
        kind = type(scatter_by_hand).__name__
        return f"scatter_by_hand is a {kind}: define a function scatter_by_hand(tensor, src, mesh)"
    ShardTensor, device, rng = _shard_tensor(), default_device(), case_generator()
    runs = []
    for axis in ("domain", "ddp"):
        group_mesh = mesh[axis]
        m = group_mesh.size()
        shape = (1, rng.randint(1, 3), _uneven_size(rng, m, 2 * m + 1, 48), rng.randint(5, 13))
        source = dist.get_global_rank(group_mesh.get_group(), rng.randrange(1, m) if m > 1 else 0)
        full = _field(shape, rng.randrange(2**31), device)
        with Watch(scatter_tensor=scatter_tensor, from_local=ShardTensor.from_local) as watch:
            mine = scatter_by_hand(full.clone() if dist.get_rank() == source else None, source, group_mesh)
        runs.append((axis, shape, group_mesh, source, full, mine, watch))  # every call on every rank, then verdicts
    for axis, shape, group_mesh, source, full, mine, watch in runs:
        ranks = dist.get_process_group_ranks(group_mesh.get_group())
        where = f"scattering a {shape} tensor over mesh[{axis!r}] (ranks {ranks}) from rank {source}"
        problem = watch.forbidden(scatter_tensor="the function this exercise rebuilds")
        if problem:
            return problem
        reused = earlier_object(mine, scatter_by_hand)
        if reused:
            return f"{where}: {reused}, not one made from the tensor it was given"
        if not isinstance(mine, ShardTensor):
            kind = type(mine).__name__
            return (f"{where}: it returned a {kind}, not a ShardTensor: build it with ShardTensor.from_local"
                    + (" (a plain DTensor does not carry per-rank shard sizes)" if kind == "DTensor" else ""))
        if len(ranks) > 1 and not watch.collectives("broadcast", ranks=ranks):
            return (f"{where}: nothing was broadcast over that group; the other ranks must receive the rows from the "
                    "source (they were given None)")
        if len(ranks) > 1 and max(e.bytes for e in watch.collectives("broadcast", ranks=ranks)) < full.nbytes:
            return f"{where}: the broadcasts over that group carried less than the whole tensor"
        if not watch.calls("from_local"):
            return f"{where}: the result was not made by ShardTensor.from_local from this rank's rows"
        if mine.device_mesh.mesh.tolist() != group_mesh.mesh.tolist():
            return f"{where}: the result lives on ranks {mine.device_mesh.mesh.tolist()}, not on the mesh it was given"
        if tuple(mine.placements) != (Shard(2),):
            return f"{where}: the result is placed {tuple(mine.placements)}; a scatter along the rows is (Shard(2),)"
        if tuple(mine.shape) != shape:
            return f"{where}: the result has global shape {tuple(mine.shape)}, not the tensor's"
        expected = full.chunk(group_mesh.size(), dim=2)[group_mesh.get_local_rank()]
        local = mine.to_local()
        if local.device != expected.device:
            return f"{where}: this rank's shard is on {local.device}, not on this rank's device"
        if tuple(local.shape) != tuple(expected.shape):
            return f"{where}: this rank's shard has shape {tuple(local.shape)}, not the rows of its place in the group"
        if not torch.equal(local, expected):
            return f"{where}: this rank's shard holds other values than its rows of the tensor the source was given"
        chunks = [tuple(c.shape) for c in full.chunk(group_mesh.size(), dim=2)]
        if [tuple(s) for s in mine._spec.sharding_shapes()[0]] != chunks:
            return f"{where}: the shard sizes recorded in the spec are not every rank's (check sharding_shapes)"
    return None


def _kept(shape, n: int, k: int) -> int:
    """Elements rank ``k`` of ``n`` keeps after ``scatter_tensor`` splits a contiguous ``shape`` along H: the whole
    field when its rows are one contiguous run (one plane: the shard is a view), else its own rows (copied out)."""
    planes, height, width = shape[0] * shape[1], shape[2], shape[3]
    return planes * height * width if planes == 1 else planes * _chunk_widths(height, n)[k] * width


@second_hint(
    "Count the planes, N × C. With one plane, rank k's rows of (1, 1, H, W) are one contiguous run of the broadcast "
    "field, so its shard is a view of it and all N × C × H × W elements stay. With more, its rows are strided, "
    "scatter_tensor copies them out and only N × C × rows × W stay, rows being torch.chunk's min(ceil(H / n), "
    "H − k × ceil(H / n))."
)
def kept_after_scatter(predict, mesh) -> str | None:
    """Exercise 4. Doing it means: predict, without scattering anything, the elements that stay allocated on rank
    ``k`` of ``n`` while its shard lives, after ``scatter_tensor`` splits a contiguous (N, C, H, W) field along H: the
    whole broadcast field when the rank's rows are one contiguous run (N × C = 1: the shard is a view of it), else
    only its own rows (``.contiguous()`` copied them out and the field was freed).

    ``predict(shape, n, k)`` is called for shapes drawn for each check (one plane; several channels; a batch of two
    with one channel, where a rule on channels alone goes wrong) and compared with what ``scatter_tensor`` really
    leaves on this rank over ``mesh["domain"]`` (the storage behind its shard, scattered by the judge outside the
    call), and for every rank of another group size with the arithmetic above. Scattering, chunking or
    ``sl.measure.held_bytes`` inside the call fails: it is the library doing the prediction."""
    from physicsnemo.domain_parallel import scatter_tensor

    from ..measure.memory import held_bytes

    if not callable(predict):
        return f"kept_elements is a {type(predict).__name__}: define a function kept_elements(shape, n, k)"
    domain, device, rng = mesh["domain"], default_device(), case_generator()
    n, k = domain.size(), domain.get_local_rank()
    source = dist.get_global_rank(domain.get_group(), 0)
    kinds = [(1, 1), (1, rng.randint(2, 3)), (2, 1)]  # one plane; channels; a batch (a channels-only rule fails)
    live = []
    for batch, channels in kinds:
        shape, seed = (batch, channels, _uneven_size(rng, n, 2 * n + 1, 40), rng.randint(3, 9)), rng.randrange(2**31)
        shard = scatter_tensor(_field(shape, seed, device) if dist.get_rank() == source else None, source, domain,
                               (Shard(2),))  # every rank draws the seed: the ranks' draws stay the same
        local = shard.to_local()
        live.append((shape, n, k, local.untyped_storage().nbytes() // local.element_size()))
        del shard, local
    m = rng.choice([s for s in range(3, 7) if s != n])
    more = [((batch, channels, _uneven_size(rng, m, 2 * m + 1, 6 * m), rng.randint(3, 9)), m, j)
            for batch, channels in kinds for j in range(m)]
    cases = [(shape, n_, k_) for shape, n_, k_, _ in live] + more
    truth = [right for *_, right in live] + [_kept(*case) for case in more]
    order = list(range(len(cases)))
    rng.shuffle(order)
    with Watch(scatter_tensor=scatter_tensor, held_bytes=held_bytes, chunk=(torch.chunk, torch.Tensor.chunk),
               tensor_split=(torch.tensor_split, torch.Tensor.tensor_split)) as watch:
        got = {i: predict(*cases[i]) for i in order}
    problem = watch.forbidden(scatter_tensor="which makes the shard instead of predicting what it keeps",
                              held_bytes="which measures the shard instead of predicting what it keeps",
                              chunk="which splits a tensor for you: predict the rows by arithmetic",
                              tensor_split="which splits a tensor for you: predict the rows by arithmetic")
    if problem:
        return problem
    if len({repr(v) for v in got.values()}) == 1:
        return f"kept_elements returned {got[0]!r} for every shape and rank: work it out from the shape, n and k"
    for i in order:
        (shape, m_, j), mine, right = cases[i], got[i], truth[i]
        where = f"for a {shape} field on rank {j} of {m_}"
        if isinstance(mine, bool) or not isinstance(mine, int):
            return f"{where} it returned {mine!r}: return a number of elements (an int)"
        if mine == right:
            continue
        said = f"{where} it returned {mine}, expected {right}"
        planes, own = shape[0] * shape[1], shape[0] * shape[1] * _chunk_widths(shape[2], m_)[j] * shape[3]
        if planes == 1 and mine == own:
            return (f"{said}: that is its own rows, but with one plane they are one contiguous run of the broadcast "
                    "field, so the shard is a view and the whole field stays")
        if planes > 1 and mine == planes * shape[2] * shape[3]:
            return (f"{said}: with {planes} planes (N × C) the rank's rows are not one contiguous run, so "
                    "scatter_tensor copies them out and the broadcast field is freed")
        return f"{said}: the elements that stay allocated while the shard lives"
    return None
