"""Data layer: the small 2-D Darcy dataset in data/darcy2d.npz, loaded as Conv2d-ready tensors.

Introduced in ``notebooks/03_scatter_and_shardtensor.ipynb``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

DARCY_FILE = "darcy2d.npz"
FIELDS = ("permeability", "pressure")


def data_dir() -> Path:
    """$SHARDLAB_DATA when set (e.g. a copy on a node-local disk), else the dataset shipped in the package.

    In the repository ``shardlab/datasets/darcy2d.npz`` links to ``data/darcy2d.npz``; an installed
    (non-editable) package carries a copy, so the data is found however shardlab was installed.
    """
    override = os.environ.get("SHARDLAB_DATA")
    return Path(override) if override else Path(str(resources.files("shardlab") / "datasets"))


def load_darcy(path: str | os.PathLike | None = None, samples: int | None = None) -> dict:
    """Permeability and pressure as float32 tensors of shape (N, 1, H, W), plus the metadata as Python values.

    ``samples`` keeps only the first N samples.
    """
    path = Path(path) if path is not None else data_dir() / DARCY_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"Darcy dataset not found at {path}. Regenerate it (numpy only, about a second) from the repository root "
            f"with:  python data/generate_darcy.py --out {path}"
        )
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    n = len(arrays["pressure"])
    if samples is not None and not 1 <= samples <= n:
        raise ValueError(f"samples must be between 1 and {n} for {path}, got {samples}")
    out = {}
    for name, value in arrays.items():
        if name in FIELDS:
            out[name] = torch.from_numpy(value[:samples].astype(np.float32)).unsqueeze(1)
        else:
            out[name] = value.tolist()  # 0-d arrays become Python scalars
    return out
