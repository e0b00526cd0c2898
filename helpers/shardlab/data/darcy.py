"""The Darcy samples: the small 2-D dataset shipped with the package, loaded by split and scaled for training.

The first ``HELD_OUT`` samples of the file are held out: the capstone measures its error on them, and no
training run sees them (``split="train"`` starts after them). The generator draws samples one after another
from one seed, so a larger file holds the same held-out samples and more training ones.

Introduced in ``notebooks/03_scatter_and_shardtensor.ipynb``; the scaled samples in ``05_ddp_vs_fsdp2``.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch

DARCY_FILE = "darcy2d.npz"
FIELDS = ("permeability", "pressure")
HELD_OUT = 32  # the first samples of the file
SPLITS = ("all", "train", "held-out")


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


def normalized_darcy(samples: int | None = None, split: str = "train", dtype: torch.dtype = torch.float32) -> tuple:
    """(inputs, targets) of shape (N, 1, H, W) of a split (``load_darcy``): permeability centred and scaled,
    pressure scaled to O(1), both with the training split's statistics, so a held-out sample is scaled as the
    model's training samples were and tells it nothing about itself."""
    train = load_darcy(split="train")
    data = train if split == "train" and samples is None else load_darcy(samples=samples, split=split)
    return darcy_scaling(train)(data["permeability"], data["pressure"], dtype)


def darcy_scaling(train: dict | None = None):
    """``scale(permeability, pressure, dtype)``: ``normalized_darcy``'s pointwise scaling, with the training split's
    statistics, so that a slab of a sample is scaled exactly as the whole sample is."""
    train = train if train is not None else load_darcy(split="train")
    mean, std, p_max = train["permeability"].mean(), train["permeability"].std(), train["pressure"].abs().max()
    return lambda k, p, dtype=torch.float32: (((k - mean) / std).to(dtype), (p / p_max).to(dtype))
