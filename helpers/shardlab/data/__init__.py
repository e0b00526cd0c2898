"""Data layer: the Darcy samples and their scaling, the sampler, field stores on disk, and the batch sources a
``Trainer`` loads from. One module per concern:

- ``darcy``: the small 2-D Darcy dataset, loaded by split (``load_darcy``) and scaled (``normalized_darcy``);
- ``sampler``: which sample each ddp replica trains on at each step (``sample_index``);
- ``writer``: field stores written to disk (zarr), synthetic or the Darcy samples;
- ``reader``: a rank's slab of a stored sample, read alone (``read_slab``);
- ``sources``: the loading, ``ScatterSource`` or ``SlabSource``, handed to ``sl.train.Trainer``;
- ``cli``: the command line, ``python -m shardlab.data store``.

Introduced in ``notebooks/03_scatter_and_shardtensor.ipynb``; field stores and slabs in ``12_data_at_scale``.
"""

from .cli import main
from .darcy import DARCY_FILE, FIELDS, HELD_OUT, SPLITS, darcy_scaling, data_dir, load_darcy, normalized_darcy
from .reader import FieldStore, Slab, open_store, read_range, read_slab
from .sampler import sample_index
from .sources import ScatterSource, SlabSource
from .writer import (
    BIG_STORE,
    SMALL_STORE,
    STORE_COMMAND,
    STORE_FIELDS,
    StoreError,
    field_store,
    store_dir,
    write_darcy_store,
    write_field_store,
)

__all__ = ["BIG_STORE", "DARCY_FILE", "FIELDS", "HELD_OUT", "SMALL_STORE", "SPLITS", "STORE_COMMAND", "STORE_FIELDS",
           "FieldStore", "ScatterSource", "Slab", "SlabSource", "StoreError", "darcy_scaling", "data_dir",
           "field_store", "load_darcy", "normalized_darcy", "open_store", "read_range", "read_slab", "sample_index",
           "store_dir", "write_darcy_store", "write_field_store", "main"]
