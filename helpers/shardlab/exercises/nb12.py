"""Judges of ``notebooks/12_data_at_scale.ipynb``: a slab reader (this rank's rows from a store, as a ShardTensor, with
no communication) and the sample indices of a domain group.

Both answers are functions, judged on every rank. The slab reader is called on stores the judge writes for each
check (heights that do not divide over the ranks, other chunk sizes), on the 1-D meshes of the notebook and of the
judge's own; the store counts the bytes each call reads, so reading the whole sample and slicing it fails, and the
call is watched: no collective may run, and neither ``scatter_tensor`` nor ``sl.data.read_slab`` (the answer key). The
indices are asked for with seeds, epochs, dataset sizes (never a multiple of the ddp size, so a leftover must be
dropped) and (ddp, domain) meshes drawn for each check; every rank's lists are gathered and compared: the same within a
domain group, disjoint across replicas, a new order each epoch. Nothing is forbidden there: torch's
``DistributedSampler`` over the ddp replicas is the library's answer, and a split by hand passes as well.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..data import open_store, read_slab, write_field_store
from ..mesh import build_mesh, shard_bounds
from .judging import Watch, case_generator, earlier_object, second_hint


def _height(rng, low: int, high: int, sizes: list[int]) -> int:
    """A height in [low, high) that torch.chunk splits unevenly over the largest of ``sizes`` and that leaves every
    rank some rows at each size: where the rows run out, PhysicsNeMo 2.2.2's scatter_tensor, the judge's reference,
    fails on the ranks left without (``_shard_redistribute.py``, ``_select_slice_from_replicate``)."""
    fits = [h for h in range(low, high) if h % max(sizes) and all(-(-h // n) * (n - 1) < h for n in sizes)]
    return rng.choice(fits)


def _judge_stores(next_to, rng, sizes: list[int]) -> tuple[Path, list[tuple[Path, int, int]]]:
    """Stores of the judge's own, written by global rank 0 beside the notebook's (every rank then reads them):
    (path, height, chunk rows), heights that torch.chunk splits unevenly over the domain ``sizes``."""
    folder = Path(next_to).parent / f"judge-{rng.randrange(10**9)}"
    cases = [(folder / f"h{h}-c{c}.zarr", h, c) for h, c in ((_height(rng, 21, 40, sizes), rng.choice((2, 3, 4))),
                                                           (_height(rng, 41, 70, sizes), rng.choice((5, 8))))]
    if dist.get_rank() == 0:
        for path, height, chunk_rows in cases:
            write_field_store(path, 2, height, rng.randrange(5, 12), seed=rng.randrange(100), chunk_rows=chunk_rows)
    else:
        for _ in cases:
            rng.randrange(5, 12), rng.randrange(100)  # the same draws as rank 0: the ranks' generators stay together
    dist.barrier()
    return folder, cases


def _scattered(path, sample: int, domain):
    """The library's answer, built outside the judged call: rank 0 of ``domain`` reads the sample and scatters it,
    from this rank's device (NCCL sends no host tensor; DistributedManager made the rank's GPU the current one)."""
    from physicsnemo.domain_parallel import scatter_tensor

    source = dist.get_global_rank(domain.get_group(), 0)
    whole = torch.from_numpy(open_store(path).field("permeability")[sample : sample + 1]).to(domain.device_type)
    return scatter_tensor(whole if dist.get_rank() == source else None, source, domain, (Shard(2),))


@second_hint(
    "torch.chunk's split: size = ceil(H / n) rows per rank until they run out (not H // n with the rest on the "
    "last). Read only array[sample : sample + 1, :, start:stop, :], and give ShardTensor.from_local(local, "
    "domain, [Shard(2)], sharding_shapes={0: shapes}) every rank's shape: without them it asks the other ranks, a"
    " collective."
)
def slab_reader(read_rows, store, mesh) -> str | None:
    """Exercise 1. Doing it means: work out this rank's rows [a, b) as torch.chunk splits H over the domain ranks,
    read only those rows of the sample from the array, and build the ShardTensor with ``ShardTensor.from_local`` and
    every rank's shape in ``sharding_shapes``, so no rank asks another.

    ``read_rows(array, sample, domain)`` is called with zarr arrays of the judge's stores and the notebook's, and 1-D
    meshes: the notebook's domain axis and the judge's own with another number of domain ranks."""
    if not callable(read_rows):
        return f"read_rows is a {type(read_rows).__name__}: define a function read_rows(array, sample, domain)"
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor

    rng = case_generator()
    world, notebook_domain = dist.get_world_size(), mesh["domain"]
    sizes = [d for d in range(2, world + 1) if world % d == 0 and d != notebook_domain.size()]
    domains = [("the notebook's mesh['domain']", notebook_domain)]
    if sizes:  # a mesh of the judge's own: another number of domain ranks
        size = rng.choice(sizes)
        domains.append((f"a mesh of {size} domain ranks", build_mesh(ddp=-1, domain=size)["domain"]))
    folder, stores = _judge_stores(store, rng, [domain.size() for _, domain in domains])
    cases = [(path, rng.randrange(2), f"{what}, a {height}-row field in chunks of {chunk_rows} rows", domain)
             for path, height, chunk_rows in stores for what, domain in domains]
    cases.append((Path(store), 0, f"{domains[0][0]}, the notebook's store", notebook_domain))
    verdicts = []
    try:
        for path, sample, what, domain in cases:  # every case on every rank: the scatters below are collectives
            expected = _scattered(path, sample, domain)
            opened = open_store(path)
            array = opened.field("permeability")
            before = opened.bytes_read
            try:  # a rank whose call raises still takes part in the next case's scatter
                with Watch(scatter_tensor=scatter_tensor, read_slab=read_slab) as watch:
                    got = read_rows(array, sample, domain)
            except Exception as error:
                verdicts.append(f"on {what} (sample {sample}): read_rows raised {type(error).__name__}: {error}")
                continue
            verdict = watch.forbidden(scatter_tensor="which sends the whole sample from one rank: read this rank's "
                                      "rows instead", read_slab="the answer key: build it from the array yourself")
            if verdict is None and watch.collectives():
                names = sorted({e.name for e in watch.collectives()})
                verdict = (f"it ran {', '.join(names)}: give from_local every rank's shape (sharding_shapes), "
                           "which every rank can work out, so that no rank asks another")
            verdict = verdict or earlier_object(got, read_rows) or _judge_slab(got, expected, array, domain,
                                                                               opened.bytes_read - before, ShardTensor)
            verdicts.append(None if verdict is None else f"on {what} (sample {sample}): {verdict}")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return next((v for v in verdicts if v), None)


def _judge_slab(got, expected, array, domain, read: int, shard_tensor) -> str | None:
    """What is wrong with ``got`` against scatter_tensor's ``expected``, and with the ``read`` bytes it took."""
    if not isinstance(got, shard_tensor):
        return f"read_rows returned a {type(got).__name__}: return the ShardTensor ShardTensor.from_local builds"
    if tuple(got.placements) != (Shard(2),) or got.device_mesh != domain:
        return f"its placements are {tuple(got.placements)} on another mesh: Shard(2) on the domain mesh it is given"
    _, start, stop = shard_bounds(array.shape[2], domain.size())[domain.get_local_rank()]
    chunk_rows = array.chunks[2]
    chunks = -(-stop // chunk_rows) - start // chunk_rows
    most = chunks * chunk_rows * array.shape[3] * array.dtype.itemsize
    if read > most:
        return (f"it read {read} bytes, where this rank's rows {start}..{stop} lie in {chunks} chunk(s) of "
                f"{chunk_rows} rows, {most} bytes: index the array with this rank's rows before converting it")
    mine, right = got.to_local(), expected.to_local()
    if tuple(mine.shape) != tuple(right.shape) or not torch.equal(mine.cpu(), right.cpu()):
        return (f"this rank holds {tuple(mine.shape)} of other rows; scatter_tensor gives it rows {start}..{stop}: "
                "torch.chunk's split, ceil(H / N) rows per rank until they run out")
    if got._spec.sharding_shapes() != expected._spec.sharding_shapes():
        return "its sharding_shapes are not every rank's shape: list each rank's (1, 1, rows, W), in mesh order"
    if got.shape != expected.shape:
        return f"its global shape is {tuple(got.shape)}, not {tuple(expected.shape)}"
    return None


@second_hint(
    "The replica is mesh.get_coordinate()[0], the ddp coordinate (not dist.get_rank(), not the domain "
    'coordinate): DistributedSampler(range(dataset_len), num_replicas=mesh["ddp"].size(), rank=replica, '
    "seed=seed, drop_last=True), then sampler.set_epoch(epoch) before list(sampler), so that each epoch has its "
    "own order."
)
def domain_group_indices(indices_of, mesh) -> str | None:
    """Exercise 2. Doing it means: split a permutation of the samples, drawn from the seed and the epoch, over the
    ``ddp`` replicas only, by the rank's ``ddp`` coordinate, so the ranks of a domain group read the same samples:
    by hand, or with ``DistributedSampler(num_replicas=ddp size, rank=ddp coordinate, drop_last=True)``.

    ``indices_of(dataset_len, mesh, epoch, seed)`` is called on every rank with dataset sizes, epochs and seeds drawn
    for each check, on the notebook's mesh and a (ddp, domain) mesh of the judge's own; every rank's lists are
    gathered and compared."""
    if not callable(indices_of):
        return (f"indices_of is a {type(indices_of).__name__}: define a function "
                "indices_of(dataset_len, mesh, epoch, seed)")
    rng, world = case_generator(), dist.get_world_size()
    meshes = [("the notebook's mesh", mesh)]
    shapes = [d for d in range(1, world + 1) if world % d == 0 and d not in (1, mesh["ddp"].size())]
    if shapes:
        ddp = rng.choice(shapes)
        meshes.append((f"a mesh (ddp={ddp}, domain={world // ddp})", build_mesh(ddp=ddp, domain=-1)))
    for what, case_mesh in meshes:
        ddp = case_mesh["ddp"].size()
        lengths = [n for n in range(3 * world + 5, 6 * world + 20) if ddp == 1 or n % ddp]  # a leftover to drop
        length, seed, epoch = rng.choice(lengths), rng.randrange(1000), rng.randrange(5)
        try:  # a rank whose call raises still takes part in the gather below
            mine = [[int(i) for i in indices_of(length, case_mesh, e, seed)] for e in (epoch, epoch + 1)]
        except Exception as error:
            mine = f"indices_of raised {type(error).__name__}: {error}"
        everyone = [None] * world
        dist.all_gather_object(everyone, (case_mesh.get_coordinate()[0], mine))
        said = f"on {what}, {length} samples, seed {seed}, epoch {epoch}"
        raised = next((lists for _, lists in everyone if isinstance(lists, str)), None)
        verdict = raised or _judge_indices(everyone, ddp, length)
        if verdict:
            return f"{said}: {verdict}"
    return None


def _judge_indices(everyone, ddp: int, length: int) -> str | None:
    by_replica = {}
    for rank, (replica, lists) in enumerate(everyone):
        if by_replica.setdefault(replica, (rank, lists))[1] != lists:
            first = by_replica[replica][0]
            return (f"ranks {first} and {rank} are in one domain group (ddp coordinate {replica}) but read different "
                    "samples: split over the ddp replicas (num_replicas = mesh['ddp'].size(), rank = "
                    "mesh.get_coordinate()[0]), not the world nor the domain axis")
    each = length // ddp
    for epoch in range(2):
        seen = [i for _, lists in by_replica.values() for i in lists[epoch]]
        counts = [len(lists[epoch]) for _, lists in by_replica.values()]
        if any(count != each for count in counts):
            why = ("the leftover dropped (drop_last=True), not padded" if max(counts) > each
                   else f"drawn from all the {length} samples it is given, range(dataset_len)")
            return f"a replica got {counts} samples: {each} each ({length} // {ddp}), {why}"
        if len(set(seen)) != len(seen) or not all(0 <= i < length for i in seen):
            return "two replicas read the same sample in one epoch, or an index is outside the dataset"
    if all(lists[0] == lists[1] for _, lists in by_replica.values()):
        return ("the next epoch reads the samples in the same order: draw the permutation from the seed and the epoch "
                "(DistributedSampler.set_epoch)")
    return None
