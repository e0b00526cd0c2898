"""Data layer: the small 2-D Darcy dataset in data/darcy2d.npz, loaded as Conv2d-ready tensors; fields on disk
that a rank reads a slab of; the sampler that gives every rank of a domain group the same samples.

The first ``HELD_OUT`` samples of the file are held out: the capstone measures its error on them, and no
training run sees them (``split="train"`` starts after them). The generator draws samples one after another
from one seed, so a larger file holds the same held-out samples and more training ones.

Field stores are zarr (v3) groups, one array per field of shape (samples, 1, H, W) in chunks of whole rows. zarr is
what PhysicsNeMo's datapipes read; it reads a range of rows by reading only the chunks that overlap it; and it reads
through ordinary file reads, so the bytes a rank reads can be counted from outside (``rchar`` in /proc/self/io on
Linux). A memory-mapped ``.npy`` reads through page faults, which nothing cheap counts. Chunks are stored
uncompressed: bytes on disk are bytes in memory, so what a rank reads compares directly with 1/N of the field.

Introduced in ``notebooks/03_scatter_and_shardtensor.ipynb``; field stores and slabs in ``12_data_at_scale``.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import math
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore, WrapperStore

from .mesh import shard_bounds

DARCY_FILE = "darcy2d.npz"
FIELDS = ("permeability", "pressure")
HELD_OUT = 32  # the first samples of the file
SPLITS = ("all", "train", "held-out")
STORE_FIELDS = ("permeability", "target")  # the synthetic store's fields
SMALL_STORE = {"samples": 4, "height": 1024, "width": 1024}  # the default: 32 MiB, written in about a second
BIG_STORE = {"samples": 4, "height": 4096, "width": 4096}  # the demonstration: 512 MiB
STORE_COMMAND = "python -m shardlab.data store"


class StoreError(ValueError):
    """A field store, slab or sharding that cannot be written or read as asked; the message says what to change."""


def data_dir() -> Path:
    """$SHARDLAB_DATA when set (e.g. a copy on a node-local disk), else the dataset shipped in the package.

    In the repository ``shardlab/datasets/darcy2d.npz`` links to ``data/darcy2d.npz``; an installed
    (non-editable) package carries a copy, so the data is found however shardlab was installed.
    """
    override = os.environ.get("SHARDLAB_DATA")
    return Path(override) if override else Path(str(resources.files("shardlab") / "datasets"))


def load_darcy(path: str | os.PathLike | None = None, samples: int | None = None, split: str = "all") -> dict:
    """Permeability and pressure as float32 tensors of shape (N, 1, H, W), plus the metadata as Python values.

    ``split``: "all" the samples of the file, "held-out" the first ``HELD_OUT``, "train" the rest.
    ``samples`` keeps only the first N samples of the split.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {SPLITS}.")
    path = Path(path) if path is not None else data_dir() / DARCY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"Darcy dataset not found at {path}. Regenerate it (numpy only, a few seconds) from the repository root "
            f"with:  python data/generate_darcy.py --out {path}"
        )
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    n = len(arrays["pressure"])
    if split != "all" and n <= HELD_OUT:
        raise ValueError(f"{path} has {n} samples: a split needs more than the {HELD_OUT} held out. Regenerate it "
                         "with the default --samples.")
    first, stop = {"all": (0, n), "held-out": (0, HELD_OUT), "train": (HELD_OUT, n)}[split]
    available = stop - first
    if samples is not None and not 1 <= samples <= available:
        raise ValueError(f"samples must be between 1 and {available} for the {split!r} split of {path}, got {samples}")
    stop = first + (samples if samples is not None else available)
    out = {}
    for name, value in arrays.items():
        if name in FIELDS:
            out[name] = torch.from_numpy(value[first:stop].astype(np.float32)).unsqueeze(1)
        else:
            out[name] = value.tolist()  # 0-d arrays become Python scalars
    return out


# --- field stores on disk -------------------------------------------------------------------------------------------

def store_dir() -> Path:
    """Where stores go: $SHARDLAB_DATA when set, else this user's folder in the temp folder (never the checkout)."""
    if os.environ.get("SHARDLAB_DATA"):
        return Path(os.environ["SHARDLAB_DATA"])
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user with no name
        user = str(os.getuid())
    return Path(tempfile.gettempdir()) / f"shardlab-{user}"


def _stored_params(path: Path) -> dict | None:
    try:
        return dict(zarr.open_group(LocalStore(path, read_only=True), mode="r").attrs).get("shardlab")
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _write_atomically(path, params: dict, fill) -> Path:
    """Write a store at a temporary name with ``fill(group)``, then rename it into place: ``path`` is either absent or
    complete, whatever happens on the way (an error, Ctrl-C). A complete store of the same ``params`` is reused."""
    path, found = Path(path), _stored_params(Path(path))
    if found == params:
        return path
    if path.exists() and found is None:  # never replace what shardlab did not write
        raise StoreError(f"{path} exists and is not a shardlab store: write to another path, or remove it first.")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        fill(zarr.open_group(LocalStore(partial), mode="w", attributes={"shardlab": params}))
        if _stored_params(path) != params:  # unless another process (a rank) has just written the same store
            if path.exists():  # written with other parameters: replaced
                path.rename(old)
            partial.rename(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return path


def _new_field(group, name: str, samples: int, height: int, width: int, chunk_rows: int):
    if chunk_rows < 1:
        raise StoreError(f"chunk_rows={chunk_rows}: use a positive number of rows per chunk.")
    return group.create_array(name, shape=(samples, 1, height, width), chunks=(1, 1, min(chunk_rows, height), width),
                              dtype="float32", compressors=None, fill_value=0.0,
                              config={"write_empty_chunks": True})  # every chunk on disk, so every read is counted


def _permeability_rows(rng_seed: list[int], start: int, stop: int, height: int, width: int, modes: int = 8):
    """Rows [start, stop) of a smooth positive field: exp of a few random low-frequency cosines. Each cosine is
    separable (cos(a + b) = cos a cos b - sin a sin b), so a block of rows costs a few outer products."""
    rng = np.random.default_rng(rng_seed)  # the same draws for every block: a row does not depend on the chunking
    freqs, phases = rng.integers(-4, 5, size=(modes, 2)), rng.uniform(0, 2 * np.pi, size=modes)
    amplitudes = rng.normal(0, 1 / math.sqrt(modes), size=modes)
    y, x = np.arange(start, stop)[:, None] / height, np.arange(width)[None, :] / width
    log_k = np.zeros((stop - start, width))
    for (fy, fx), phase, amplitude in zip(freqs, phases, amplitudes):
        a, b = 2 * np.pi * fy * y + phase, 2 * np.pi * fx * x
        log_k += amplitude * (np.cos(a) * np.cos(b) - np.sin(a) * np.sin(b))
    return np.exp(log_k).astype(np.float32)


def write_field_store(path, samples: int, height: int, width: int, *, seed: int = 0, chunk_rows: int = 64,
                      fields=STORE_FIELDS, progress: bool = False) -> Path:
    """A synthetic store of smooth random "permeability" and a cheap pointwise "target" (1 / (1 + k): about bytes,
    not physics), float32 (samples, 1, H, W), written a chunk of rows at a time so no field is ever whole in memory."""
    unknown = sorted(set(fields) - set(STORE_FIELDS))
    if unknown or not fields:
        raise StoreError(f"fields={tuple(fields)}: choose among {STORE_FIELDS}.")
    if min(samples, height, width) < 1:
        raise StoreError(f"samples, height, width = {samples}, {height}, {width}: each must be at least 1.")
    params = {"kind": "synthetic", "samples": samples, "height": height, "width": width, "seed": seed,
              "chunk_rows": chunk_rows, "fields": list(fields)}

    def fill(group):
        arrays = {name: _new_field(group, name, samples, height, width, chunk_rows) for name in fields}
        for i in range(samples):
            for start in range(0, height, chunk_rows):
                stop = min(start + chunk_rows, height)
                k = _permeability_rows([seed, i], start, stop, height, width)
                values = {"permeability": k, "target": 1 / (1 + k)}
                for name, array in arrays.items():
                    array[i, 0, start:stop] = values[name]
            if progress:
                print(f"\rwriting {path}: sample {i + 1}/{samples} of {height}×{width}", flush=True,
                      end="\n" if i == samples - 1 else "")

    return _write_atomically(path, params, fill)


def field_store(big: bool = False, path=None, progress: bool | None = None) -> Path:
    """The synthetic store in its default place and size (``SMALL_STORE``, or ``BIG_STORE`` with ``big``), written
    the first time and reused after."""
    path = Path(path) if path is not None else store_dir() / ("field-big.zarr" if big else "field.zarr")
    progress = big if progress is None else progress
    return write_field_store(path, **(BIG_STORE if big else SMALL_STORE), progress=progress)


def write_darcy_store(path=None, source=None, chunk_rows: int = 16) -> Path:
    """The raw samples of ``load_darcy(source)`` (all of them, held-out first) as a store, so that a rank reads its
    slab of a Darcy sample from disk. Normalising is the trainer's (``sl.train``), pointwise, on the slab."""
    source = Path(source) if source is not None else data_dir() / DARCY_FILE
    data = load_darcy(source)
    path = Path(path) if path is not None else store_dir() / "darcy2d.zarr"
    params = {"kind": "darcy", "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
              "held_out": HELD_OUT, "chunk_rows": chunk_rows}

    def fill(group):
        for name in FIELDS:
            _new_field(group, name, *data[name].shape[:1], *data[name].shape[2:], chunk_rows)[:] = data[name].numpy()

    return _write_atomically(path, params, fill)


class _CountingStore(WrapperStore):
    """A zarr store that adds up the bytes of the chunks it hands out."""

    def __init__(self, store):
        super().__init__(store)
        self.bytes_read = 0

    async def get(self, key, prototype, byte_range=None):
        value = await self._store.get(key, prototype, byte_range)
        if value is not None and not key.endswith("zarr.json"):  # chunks, not metadata
            self.bytes_read += len(value)
        return value


class FieldStore:
    """A store opened for reading: its fields, its parameters, and the chunk bytes read from it so far."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "zarr.json").is_file():
            raise StoreError(f"no field store at {self.path}: write one with `{STORE_COMMAND} --out {self.path}` "
                             "(or `--darcy` for the Darcy samples), or pass the path of one.")
        self._counting = _CountingStore(LocalStore(self.path, read_only=True))
        self.group = zarr.open_group(self._counting, mode="r")
        self.params = dict(self.group.attrs).get("shardlab", {})

    bytes_read = property(lambda self: self._counting.bytes_read)

    def field(self, name: str):
        if name not in self.group.array_keys():
            raise StoreError(f"field={name!r} is not in {self.path}: use one of {sorted(self.group.array_keys())}.")
        return self.group[name]


def open_store(store) -> FieldStore:
    """A ``FieldStore`` from a path, or the one given."""
    return store if isinstance(store, FieldStore) else FieldStore(store)


class Slab(NamedTuple):
    """``read_slab``'s ShardTensor, this rank's [start, stop) along the sharded dim, and the chunk bytes read for it
    (whole chunks: a slab that starts or stops inside a chunk reads all of that chunk)."""
    tensor: object
    rows: tuple[int, int]
    bytes_read: int


def _torch_dtype(array) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype  # numpy's dtype, as torch names it


def _check_bounds(bounds, extent: int, n_ranks: int, axis: str) -> list[tuple[int, int]]:
    bounds = [tuple(b) for b in bounds]
    if len(bounds) != n_ranks:
        raise StoreError(f"{len(bounds)} bounds for {n_ranks} domain ranks: give one (start, stop) per rank.")
    if any(stop > extent or start < 0 for start, stop in bounds):
        raise StoreError(f"bounds {bounds} reach outside the field's {extent} {axis}: keep them within [0, {extent}].")
    starts, stops = [0, *(stop for _, stop in bounds)], [*(start for start, _ in bounds), extent]
    if starts != stops or any(start > stop for start, stop in bounds):
        raise StoreError(f"bounds {bounds} do not cover the {extent} {axis} once each: start at 0, start each rank "
                         f"where the previous stops, end at {extent} (or leave bounds=None).")
    return bounds


def read_range(store, sample: int, start: int, stop: int, *, field: str = "permeability", dim: int = 2,
               device=None):
    """(tensor, chunk bytes read): rows (``dim=2``) or columns (3) [start, stop) of one sample, shape (1, C, h, w), on
    ``device``, from the chunks that overlap the range only, one at a time into the result: the host holds one chunk
    beside it (zarr would fetch them all at once and assemble a second copy). Unchecked: ``read_slab`` checks first."""
    store = open_store(store)
    array = store.field(field)
    shape = [1, *array.shape[1:]]
    shape[dim] = stop - start
    out = torch.empty(shape, dtype=_torch_dtype(array), device=device)
    first, last, offset = (start, stop, start) if dim == 2 else (0, array.shape[2], 0)  # the rows to read
    columns, step = (slice(None) if dim == 2 else slice(start, stop)), array.chunks[2]
    before = store.bytes_read
    for chunk in range(first - first % step, last, step):
        a, b = max(chunk, first), min(chunk + step, last)
        out[:, :, a - offset : b - offset] = torch.from_numpy(array[sample : sample + 1, :, a:b, columns])
    return out, store.bytes_read - before


def read_slab(store, sample: int, mesh, *, field: str = "permeability", dim: int = 2, bounds=None,
              expect_shape=None, expect_dtype=None, requires_grad: bool = False) -> Slab:
    """This rank's slab of sample ``sample``, read from the store and nothing else, as a ShardTensor ``Shard(dim)``
    on ``mesh["domain"]``. Every rank knows every rank's shape (``bounds``, ``torch.chunk``'s split by default), so
    ``ShardTensor.from_local`` gets ``sharding_shapes`` and no rank talks to another. ``dim``: 2 (rows, the chunked
    axis) or 3 (columns, which reads every chunk of the sample). Every check runs before anything is read."""
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard

    store = open_store(store)
    array = store.field(field)
    one = (1, *array.shape[1:])
    dtype = _torch_dtype(array)
    if expect_shape is not None and tuple(expect_shape) != one:
        raise StoreError(f"{store.path} holds {field} samples of shape {one}, not {tuple(expect_shape)}: write a store "
                         f"of that size ({STORE_COMMAND} --out PATH), or expect {one}.")
    if expect_dtype is not None and expect_dtype != dtype:
        raise StoreError(f"{store.path} holds {field} as {dtype}, not {expect_dtype}: convert the store, or expect "
                         f"{dtype} and cast after reading.")
    if not 0 <= sample < array.shape[0]:
        raise StoreError(f"sample {sample} is outside {store.path}, which holds {array.shape[0]} samples: use an index "
                         f"in [0, {array.shape[0]}).")
    if dim not in (2, 3):
        raise StoreError(f"dim={dim}: shard along 2 (rows, the chunked axis) or 3 (columns).")
    domain = mesh["domain"] if len(mesh.mesh_dim_names or ()) > 1 else mesh  # the (ddp, domain) mesh, or its axis
    n, extent, axis = domain.size(), array.shape[dim], ("rows", "columns")[dim - 2]
    if bounds is None:
        if n > extent:
            raise StoreError(f"{n} domain ranks for {extent} {axis}: some ranks would hold nothing. Use at most "
                             f"{extent} domain ranks, or a larger field.")
        bounds = [(start, stop) for _, start, stop in shard_bounds(extent, n)]
    bounds = _check_bounds(bounds, extent, n, axis)
    start, stop = bounds[domain.get_local_rank()]
    local, read = read_range(store, sample, start, stop, field=field, dim=dim, device=DistributedManager().device)
    shapes = [tuple(b - a if d == dim else size for d, size in enumerate(one)) for a, b in bounds]
    tensor = ShardTensor.from_local(local, domain, [Shard(dim)], sharding_shapes={0: shapes})
    if requires_grad:  # a leaf of its own, as scatter_tensor(..., requires_grad=True) builds it
        tensor = tensor.detach().requires_grad_(True)
    return Slab(tensor, (start, stop), read)


# --- samples per domain group ---------------------------------------------------------------------------------------

class DomainGroupSampler(torch.utils.data.Sampler):
    """Sample indices split over the ``ddp`` replicas only: every rank of a domain group yields the same indices (the
    halves of one ShardTensor belong to one sample), replicas yield disjoint ones. Shuffled per epoch from ``seed``,
    the same permutation on every rank; position p of the permutation goes to replica p % ddp_size, so the global
    batch of step s is positions [s·G, (s+1)·G), G = ddp_size × batch_size.

    It replaces ``DistributedSampler`` over the whole world, which splits over every rank: the ranks of a domain group
    then read different samples, and the ShardTensor they build together glues rows of one sample onto rows of
    another. Nothing fails; the model trains on fields that exist nowhere, against targets that match none of them.
    ``drop_last``: only whole global batches; else the permutation wraps round to fill the last one.
    """

    def __init__(self, dataset_len: int, ddp_size: int, replica: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, batch_size: int = 1):
        if dataset_len < 1 or ddp_size < 1 or batch_size < 1:
            raise ValueError(f"dataset_len={dataset_len}, ddp_size={ddp_size}, batch_size={batch_size}: each must be "
                             "at least 1.")
        if not 0 <= replica < ddp_size:
            raise ValueError(f"replica={replica}: use the rank's ddp coordinate, in [0, {ddp_size}).")
        self.global_batch = ddp_size * batch_size
        if drop_last and dataset_len < self.global_batch:
            raise ValueError(f"{dataset_len} samples make no whole global batch of {ddp_size} × {batch_size}: use "
                             "drop_last=False, a smaller batch_size, or fewer ddp replicas.")
        self.dataset_len, self.ddp_size, self.replica, self.batch_size = dataset_len, ddp_size, replica, batch_size
        self.seed, self.shuffle, self.drop_last, self.epoch = seed, shuffle, drop_last, 0
        batches = dataset_len // self.global_batch if drop_last else -(-dataset_len // self.global_batch)
        self.total = batches * self.global_batch

    @classmethod
    def from_mesh(cls, mesh, dataset_len: int, **options) -> DomainGroupSampler:
        """This rank's sampler on a (ddp, domain) mesh."""
        return cls(dataset_len, mesh["ddp"].size(), mesh.get_coordinate()[0], **options)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = (torch.randperm(self.dataset_len, generator=torch.Generator().manual_seed(self.seed + self.epoch))
                 if self.shuffle else torch.arange(self.dataset_len))
        order = order.repeat(-(-self.total // self.dataset_len))[: self.total]  # wraps round, or drops the tail
        return iter(order[self.replica :: self.ddp_size].tolist())

    def __len__(self) -> int:
        return self.total // self.ddp_size


def main(argv=None) -> None:
    """``python -m shardlab.data store [--big | --darcy] [--out PATH]``: write a store (or find it written)."""
    parser = argparse.ArgumentParser(prog="python -m shardlab.data")
    store = parser.add_subparsers(dest="command", required=True).add_parser("store", help="write a field store")
    which = store.add_mutually_exclusive_group()
    which.add_argument("--big", action="store_true", help=f"{BIG_STORE['height']}² fields instead of CI's small ones")
    which.add_argument("--darcy", action="store_true", help="the Darcy training samples instead of synthetic fields")
    store.add_argument("--out", help=f"where to write it (default: under {store_dir()})")
    args = parser.parse_args(argv)
    path = write_darcy_store(args.out) if args.darcy else field_store(args.big, args.out)
    print(f"{path}: {sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
