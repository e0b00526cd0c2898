"""Field stores read: a rank's slab of a sample, from the chunks that overlap it only, counted in bytes.

Introduced in ``notebooks/12_data_at_scale.ipynb``; ``writer`` writes the stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore, WrapperStore

from ..mesh import shard_bounds
from .writer import STORE_COMMAND, StoreError


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
              expect_shape=None, expect_dtype=None, requires_grad: bool = False, device=None) -> Slab:
    """This rank's slab of sample ``sample``, read from the store and nothing else, as a ShardTensor ``Shard(dim)``
    on ``mesh["domain"]``. Every rank knows every rank's shape (``bounds``, ``torch.chunk``'s split by default), so
    ``ShardTensor.from_local`` gets ``sharding_shapes`` and no rank talks to another. ``dim``: 2 (rows, the chunked
    axis) or 3 (columns, which reads every chunk of the sample). ``device``: this rank's
    (``DistributedManager().device``) unless given. Every check runs before anything is read."""
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
    local, read = read_range(store, sample, start, stop, field=field, dim=dim,
                            device=DistributedManager().device if device is None else device)
    shapes = [tuple(b - a if d == dim else size for d, size in enumerate(one)) for a, b in bounds]
    tensor = ShardTensor.from_local(local, domain, [Shard(dim)], sharding_shapes={0: shapes})
    if requires_grad:  # a leaf of its own, as scatter_tensor(..., requires_grad=True) builds it
        tensor = tensor.detach().requires_grad_(True)
    return Slab(tensor, (start, stop), read)
