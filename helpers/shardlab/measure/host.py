"""What a rank's process takes from the host while loading: resident memory at its peak, and bytes read from files.

Both are read from the kernel's own counters for the process, not from a byte model, so they check the model
(``sl.plan``, the lesson's arithmetic) instead of repeating it:

- ``HostPeak``: the resident set's high-water mark (``VmHWM`` in ``/proc/self/status``), reset on entry by writing
  ``5`` to ``/proc/self/clear_refs``, minus what was resident on entry. Memory the C allocator kept from earlier
  frees is handed back first (``malloc_trim``), so a new buffer cannot hide in pages that were already resident.
- ``FileReads``: ``rchar`` of ``/proc/self/io``, the bytes the process's read calls returned.

Linux only; elsewhere ``measured`` is False and the counts are None. Introduced in
``notebooks/12_data_at_scale.ipynb``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from pathlib import Path

import torch
import torch.distributed as dist

_STATUS, _CLEAR_REFS, _IO = Path("/proc/self/status"), Path("/proc/self/clear_refs"), Path("/proc/self/io")


def _status_bytes(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE).group(1)) * 1024


def _give_back_free_memory() -> None:
    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:  # glibc; other C libraries return freed pages on their own terms
        trim(0)


def _can_reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return _status_bytes("VmHWM") >= 0
    except (OSError, AttributeError):
        return False


class HostPeak:
    """``peak``: the most resident bytes this process held at once inside ``with``, above what it held on entry."""

    def __init__(self):
        self.measured = _STATUS.exists() and _CLEAR_REFS.exists()
        self.peak: int | None = None
        self._start = 0

    def __enter__(self):
        if self.measured:
            _give_back_free_memory()
            self.measured = _can_reset_peak()
            self._start = _status_bytes("VmRSS") if self.measured else 0
        return self

    def __exit__(self, *exc):
        if self.measured:
            self.peak = max(0, _status_bytes("VmHWM") - self._start)


class FileReads:
    """``bytes``: what the process's read calls returned inside ``with`` (files; sockets read with ``read`` too)."""

    def __init__(self):
        self.measured = _IO.exists()
        self.bytes: int | None = None
        self._start = 0

    @staticmethod
    def _rchar() -> int:
        return int(re.search(r"^rchar:\s+(\d+)", _IO.read_text(), re.MULTILINE).group(1))

    def __enter__(self):
        if self.measured:
            self._start = self._rchar()
        return self

    def __exit__(self, *exc):
        if self.measured:
            self.bytes = self._rchar() - self._start


def _scatter_load(store, sample: int, mesh, fields) -> dict:
    """Notebooks 03-11's data path: the domain group's first rank reads the whole sample, ``scatter_tensor`` sends it
    to every rank of the group, each keeps its rows."""
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.tensor import Shard

    from ..data import open_store
    from ..mesh import domain_source

    source, device = domain_source(mesh), DistributedManager().device
    store = open_store(store)
    wholes = {}
    with FileReads() as reads:
        for name in fields:
            if dist.get_rank() == source:
                wholes[name] = torch.from_numpy(store.field(name)[sample : sample + 1]).to(device)
    shards = {name: scatter_tensor(wholes.pop(name, None), source, mesh["domain"], (Shard(2),)) for name in fields}
    return {"shards": shards, "file bytes": reads.bytes}


def _slab_load(store, sample: int, mesh, fields) -> dict:
    """Lesson 12's data path: every rank reads its own rows and builds its part of the ShardTensor itself."""
    from ..data import read_slab

    with FileReads() as reads:
        shards = {name: read_slab(store, sample, mesh, field=name).tensor for name in fields}
    return {"shards": shards, "file bytes": reads.bytes}


LOADERS = {"scatter_tensor": _scatter_load, "slab": _slab_load}


def measure_loading(store, mesh, sample: int = 0, fields=("permeability", "target")) -> dict:
    """This rank's cost of loading one sample's ``fields`` as ShardTensors over ``mesh["domain"]``, each way of
    ``LOADERS``, side by side: the bytes its read calls returned, its host memory's peak above the start, the device
    allocator's peak on a GPU, and what the shards hold afterwards (storage, ``held_bytes``). Every rank calls it."""
    from physicsnemo.distributed import DistributedManager

    from .memory import DevicePeak, held_bytes

    rows = {}
    for way, load in LOADERS.items():
        dist.barrier()  # one way at a time on every rank: a rank's peak is its own load's
        with HostPeak() as host, DevicePeak(DistributedManager().device) as on_device:
            loaded = load(store, sample, mesh, fields)
        rows[way] = {"file bytes": loaded["file bytes"], "host peak": host.peak,
                     "device peak": on_device.peak_above_start if on_device.measured else None,
                     "held after": held_bytes(*loaded["shards"].values())}
        del loaded
    return rows
