"""Judges of ``notebooks/03_scatter_and_shardtensor.ipynb``: the rows a rank owns in an unequal decomposition, the
block a rank holds after a scatter along W, and a scatter built by hand (broadcast + narrow +
``ShardTensor.from_local``).

Every answer is a function. Each judge calls it on tensors and layouts of its own (other shapes, uneven splits, the
ddp axis of the mesh as well as the domain axis), works out what is right from what it built (or from the library's
own result, computed outside the judged call), and watches the call: the library function an exercise rebuilds may
not run inside it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..check import Watch, earlier_object
from ..ranks.launch import default_device


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


def rows_held(rows_of, slabs, mesh) -> str | None:
    """Exercise 1. Doing it means: read every rank's slab height from the spec (``_spec.sharding_shapes()``) and add
    up the heights of the ranks before this one, counted by this rank's place in the tensor's own mesh.

    ``rows_of(t)`` is called on ``slabs`` and on ShardTensors the judge builds with other slab sizes, on the 1-D mesh
    of all ranks and on the domain axis (where a rank's place differs from its global rank). ShardTensor's own
    ``offsets`` (the library's answer) may not run."""
    if not callable(rows_of):
        return f"rows_of is a {type(rows_of).__name__}: define a function rows_of(t) that returns (start, stop)"
    device = default_device()
    line, domain = slabs.device_mesh, mesh["domain"]
    n, d = line.size(), domain.size()
    cases = [("slabs", slabs, None),
             ("slabs of sizes 2, 3, 4, ... (bigger further down)", _slabs([2 + k for k in range(n)], line, device),
              [2 + k for k in range(n)]),
             ("slabs of sizes ..., 4, 3, 2 (smaller further down)", _slabs([1 + n - k for k in range(n)], line, device),
              [1 + n - k for k in range(n)]),
             ("a tensor split 5 | 2 | ... over mesh['domain']", _slabs([5] + [2] * (d - 1), domain, device),
              [5] + [2] * (d - 1))]
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
        if rank != k and got == (sum(sizes[:rank]), sum(sizes[:rank + 1])):
            return (f"on {what}, the rows were counted by this rank's global rank ({rank}); its place in this "
                    f"tensor's mesh is {k} (t.device_mesh.get_local_rank())")
        if stop - start != sizes[k]:
            return f"on {what}, ({start}, {stop}) spans {stop - start} rows, but this rank's slab has another height"
        if start == 0:
            return f"on {what}, start is 0 on a rank whose slab does not begin the field: count the rows before it"
        return (f"on {what}, this rank's slab does not start at row {start}: the ranks before it own other numbers "
                "of rows")
    return None


def w_shard_shape(predict, mesh) -> str | None:
    """Exercise 2. Doing it means: predict, without scattering anything, the block of a (N, C, H, W) tensor that
    rank ``k`` of ``n`` holds after ``scatter_tensor(..., (Shard(3),))``: torch.chunk's split of W, ceil(W / n)
    columns per rank until they run out.

    ``predict(shape, n, k)`` is called for shapes the notebook never used (not square, W not divisible by n) and
    compared with what ``scatter_tensor`` really gives this rank over ``mesh["domain"]`` (scattered by the judge,
    outside the call), and with ``torch.chunk``'s split for other group sizes. Scattering or chunking inside the call
    fails: it is the library doing the prediction."""
    from physicsnemo.domain_parallel import scatter_tensor

    if not callable(predict):
        return f"w_shard_shape is a {type(predict).__name__}: define a function w_shard_shape(shape, n, k)"
    domain, device = mesh["domain"], default_device()
    n, k = domain.size(), domain.get_local_rank()
    source = dist.get_global_rank(domain.get_group(), 0)
    live = []
    for shape in ((1, 2, 20, 37), (1, 1, 64, 30)):
        sample = _field(shape, 3, device)
        live.append((shape, n, k, tuple(scatter_tensor(sample, source, domain, (Shard(3),)).to_local().shape)))
    more = [((1, 3, 8, w), m, j) for w, m in ((10, 3), (7, 4), (5, 3)) for j in range(m)]
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
    truth = [right for *_, right in live]
    truth += [tuple(torch.empty(shape, device="meta").chunk(m, dim=3)[j].shape) for shape, m, j in more]
    for (shape, m, j), got, right in zip([(s, n_, k_) for s, n_, k_, _ in live] + more, got_live + got_more, truth):
        where = f"for a {shape} tensor on rank {j} of {m}"
        got = tuple(got) if isinstance(got, (list, torch.Size)) else got
        if not isinstance(got, tuple) or not all(isinstance(v, int) for v in got):
            return f"{where} it returned {got!r}: return the local shape as a tuple of ints"
        if got == right:
            continue
        if got == tuple(shape):
            return f"{where} it returned the global shape; the rank holds only its own columns"
        if got[:3] == tuple(shape[:3]) and got[3] == -(-shape[3] // m):
            return f"{where} it returned ceil(W / n) columns, but that rank holds what the ranks before it left"
        if len(got) == 4 and got[2] != shape[2]:
            return f"{where} it split H (dimension 2); Shard(3) splits W, the last dimension"
        return f"{where} it returned {got}, which is not the block that rank holds"
    return None


def scatters_by_hand(scatter_by_hand, mesh) -> str | None:
    """Exercise 3. Doing it means: the source broadcasts the tensor's shape and dtype, then the tensor, over the group
    it is given; each rank narrows it to torch.chunk's rows for its place in that group and wraps them with
    ``ShardTensor.from_local`` (no data moves in that step).

    ``scatter_by_hand(tensor, src, mesh)`` (the tensor on the source only, ``None`` elsewhere) is called with tensors
    of the judge's own with an odd number of rows, over ``mesh["domain"]`` and over ``mesh["ddp"]`` (another group,
    another source). Observed: a broadcast over that group carrying the tensor's bytes, a call of
    ``ShardTensor.from_local``, and the result (type, mesh, placement, global shape, shard sizes, local values),
    against the judge's own tensor. ``scatter_tensor`` may not run in the call."""
    from physicsnemo.domain_parallel import scatter_tensor

    if not callable(scatter_by_hand):
        kind = type(scatter_by_hand).__name__
        return f"scatter_by_hand is a {kind}: define a function scatter_by_hand(tensor, src, mesh)"
    ShardTensor, device = _shard_tensor(), default_device()
    runs = []
    for axis, shape, seed in (("domain", (1, 2, 37, 12), 31), ("ddp", (1, 1, 21, 9), 32)):
        group_mesh = mesh[axis]
        source = dist.get_global_rank(group_mesh.get_group(), 0)
        full = _field(shape, seed, device)
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
