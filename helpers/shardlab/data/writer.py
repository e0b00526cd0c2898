"""Field stores written: fields on disk in zarr, synthetic or the Darcy samples, each written whole or not at all.

Field stores are zarr (v3) groups, one array per field of shape (samples, 1, H, W) in chunks of whole rows. zarr is
what PhysicsNeMo's datapipes read; it reads a range of rows by reading only the chunks that overlap it; and it reads
through ordinary file reads, so the bytes a rank reads can be counted from outside (``rchar`` in /proc/self/io on
Linux). A memory-mapped ``.npy`` reads through page faults, which nothing cheap counts. Chunks are stored
uncompressed: bytes on disk are bytes in memory, so what a rank reads compares directly with 1/N of the field.

Introduced in ``notebooks/12_data_at_scale.ipynb``; ``reader`` reads them back, a slab per rank.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import zarr
from zarr.storage import LocalStore

from .darcy import DARCY_FILE, FIELDS, HELD_OUT, data_dir, load_darcy

STORE_FIELDS = ("permeability", "target")  # the synthetic store's fields
SMALL_STORE = {"samples": 4, "height": 1024, "width": 1024}  # the default: 32 MiB, written in about a second
BIG_STORE = {"samples": 4, "height": 4096, "width": 4096}  # the demonstration: 512 MiB
STORE_COMMAND = "python -m shardlab.data store"


class StoreError(ValueError):
    """A field store, slab or sharding that cannot be written or read as asked; the message says what to change."""


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
    slab of a Darcy sample from disk. Normalising is ``darcy_scaling``'s, pointwise, on the slab
    (``sources.SlabSource``)."""
    source = Path(source) if source is not None else data_dir() / DARCY_FILE
    data = load_darcy(source)
    path = Path(path) if path is not None else store_dir() / "darcy2d.zarr"
    params = {"kind": "darcy", "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
              "held_out": HELD_OUT, "chunk_rows": chunk_rows}

    def fill(group):
        for name in FIELDS:
            _new_field(group, name, *data[name].shape[:1], *data[name].shape[2:], chunk_rows)[:] = data[name].numpy()

    return _write_atomically(path, params, fill)
