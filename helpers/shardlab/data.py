"""Data layer: the small 2-D Darcy dataset in data/darcy2d.npz, loaded as Conv2d-ready tensors; fields on disk
that a rank reads a slab of. (Samples per domain group need no sampler of ours: torch's ``DistributedSampler`` over the
``ddp`` replicas, ``num_replicas=mesh["ddp"].size(), rank=mesh.get_coordinate()[0]``, notebook 12.)

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
import contextlib
import errno
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
    except (OSError, ValueError, KeyError, TypeError):  # nothing there, a file, or a folder zarr does not know
        return None


def _found(path: Path) -> dict | None:
    """The parameters of the shardlab store at ``path``, None when nothing is there; StoreError for anything else.
    A store only ever appears or leaves whole (a rename), but with many writers one can be renamed in or aside
    while it is read: what fails to read and is still there is read again, a few times."""
    for _ in range(8):
        found = _stored_params(path)
        if found is not None or not os.path.lexists(path):
            return found
    raise StoreError(f"{path} exists and is not a shardlab store: write to another path, or remove it first.")


RENAME_REFUSED = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR)  # something is at the target


def _move_into_place(written: Path, path: Path, params: dict, attempts: int = 5) -> None:
    """Rename the complete store ``written`` to ``path``. One ``rename``, atomic, which refuses to replace a folder
    with content: nothing is checked first, so no other process can act between a check and the act. When it is
    refused, what is there decides: the same store (another rank wrote it at the same time) is kept; a store of other
    parameters is moved aside, removed, and the rename tried again; anything else is refused (``_found``)."""
    for _ in range(attempts):
        try:
            os.rename(written, path)
            return
        except OSError as error:
            if error.errno not in RENAME_REFUSED:
                raise
        found = _found(path)
        if found == params:
            return
        if found is not None:
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            with contextlib.suppress(FileNotFoundError):  # another writer moved it first
                os.rename(path, aside / path.name)
            shutil.rmtree(aside, ignore_errors=True)
    raise StoreError(f"{path} kept being replaced while this store was written: other processes write stores of "
                     "other parameters there. Give each its own path.")


def _write_atomically(path, params: dict, fill) -> Path:
    """Write a store into a temporary folder of its own with ``fill(group)``, then rename it into place: ``path`` is
    either absent or complete, whatever happens on the way (an error, Ctrl-C), and every rank may write the same
    store at once (``_move_into_place``). A complete store of the same ``params`` is reused, one of other ``params``
    replaced; anything else at ``path`` is refused before anything is written."""
    path = Path(path)
    if _found(path) == params:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # A folder of this writer's own, beside the store (a rename stays on one file system); the store is made inside
    # it, so that it has the permissions any folder made here has.
    own = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        fill(zarr.open_group(LocalStore(own / path.name), mode="w", attributes={"shardlab": params}))
        _move_into_place(own / path.name, path, params)
    finally:
        shutil.rmtree(own, ignore_errors=True)
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
