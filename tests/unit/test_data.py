"""data/darcy2d.npz: present, small, real physics (the PDE residual is small), reproducible, loadable, and scaled for
training (``sl.data.normalized_darcy``); the sampler goes round the training set."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab import data as sldata

REPO = Path(__file__).resolve().parents[2]
DATA_FILE = REPO / "data" / "darcy2d.npz"
SCRIPT = REPO / "data" / "generate_darcy.py"


def load_script():
    spec = importlib.util.spec_from_file_location("generate_darcy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stored():
    with np.load(DATA_FILE, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def relative_residual(k, p, h, f):
    """||-div(k grad p) - f|| / ||f|| over interior nodes, written out neighbour by neighbour.

    Deliberately not the generator's own operator, so a stencil bug there cannot hide here.
    """
    k, p = k.astype(np.float64), p.astype(np.float64)

    def harmonic(a, b):
        return 2.0 * a * b / (a + b)

    c = (slice(1, -1), slice(1, -1))
    neighbours = [(slice(2, None), slice(1, -1)), (slice(None, -2), slice(1, -1)),
                  (slice(1, -1), slice(2, None)), (slice(1, -1), slice(None, -2))]
    lhs = sum(harmonic(k[c], k[n]) * (p[c] - p[n]) for n in neighbours) / h**2
    return np.linalg.norm(lhs - f) / (f * np.sqrt(lhs.size))


def test_file_exists_and_is_small_and_holds_a_training_set():
    assert DATA_FILE.is_file(), "run: python data/generate_darcy.py"
    assert DATA_FILE.stat().st_size <= 5 * 1024**2
    assert len(sldata.load_darcy(split="train")["pressure"]) >= 200  # the capstone's 100 steps × 2 see 200


def test_shapes_dtypes_and_values(stored):
    k, p = stored["permeability"], stored["pressure"]
    assert k.dtype == p.dtype == np.float32
    assert k.ndim == 3 and k.shape == p.shape and k.shape[1] == k.shape[2]
    assert np.isfinite(k).all() and np.isfinite(p).all()
    assert set(np.unique(k)) <= set(stored["permeability_values"].tolist())
    assert stored["grid_spacing"] == pytest.approx(1.0 / (k.shape[1] - 1))


def test_pressure_zero_on_boundary_positive_inside(stored):
    p = stored["pressure"]
    for edge in (p[:, 0, :], p[:, -1, :], p[:, :, 0], p[:, :, -1]):
        assert (edge == 0).all()
    assert (p[:, 1:-1, 1:-1] > 0).all()


def test_pde_residual_is_small(stored):
    k, p = stored["permeability"], stored["pressure"]
    h, f = float(stored["grid_spacing"]), float(stored["forcing"])
    residuals = [relative_residual(k[i], p[i], h, f) for i in range(len(p))]
    # float32 storage alone leaves ~1e-5; a wrong stencil or an unconverged solve is orders larger
    assert max(residuals) < 1e-3, residuals
    # and the check has teeth: a pressure paired with another sample's permeability fails it
    assert relative_residual(k[0], p[1], h, f) > 0.05


def test_regenerating_first_samples_matches(stored):
    fresh = load_script().generate(samples=2, size=stored["pressure"].shape[1], seed=int(stored["seed"]))
    np.testing.assert_array_equal(fresh["permeability"], stored["permeability"][:2])
    # CG in float64, stored as float32: identical on this platform, within a few float32 ulps elsewhere
    np.testing.assert_allclose(fresh["pressure"], stored["pressure"][:2], rtol=1e-5, atol=1e-9)


def test_load_darcy_shapes_and_metadata(stored):
    ds = sldata.load_darcy(samples=3)
    n, s = 3, stored["pressure"].shape[1]
    for name in ("permeability", "pressure"):
        assert ds[name].dtype == torch.float32
        assert ds[name].shape == (n, 1, s, s)
    assert torch.equal(ds["pressure"][:, 0], torch.from_numpy(stored["pressure"][:3]))
    assert isinstance(ds["grid_spacing"], float) and isinstance(ds["seed"], int)
    assert sldata.load_darcy()["pressure"].shape[0] == len(stored["pressure"])
    with pytest.raises(ValueError, match="samples must be between"):
        sldata.load_darcy(samples=len(stored["pressure"]) + 1)


def test_the_held_out_split_is_the_first_samples_and_never_in_the_training_split(stored):
    held, train = sldata.load_darcy(split="held-out"), sldata.load_darcy(split="train")
    assert len(held["pressure"]) == sldata.HELD_OUT
    assert len(train["pressure"]) == len(stored["pressure"]) - sldata.HELD_OUT
    assert torch.equal(held["pressure"][:, 0], torch.from_numpy(stored["pressure"][: sldata.HELD_OUT]))
    assert torch.equal(train["pressure"][:, 0], torch.from_numpy(stored["pressure"][sldata.HELD_OUT :]))
    # no held-out field is also a training field (a duplicate would leak it into training)
    train_fields = {field.numpy().tobytes() for field in train["permeability"][:, 0]}
    assert not any(field.numpy().tobytes() in train_fields for field in held["permeability"][:, 0])
    assert torch.equal(sldata.load_darcy(samples=3, split="train")["pressure"], train["pressure"][:3])
    with pytest.raises(ValueError, match="split='test'"):
        sldata.load_darcy(split="test")
    with pytest.raises(ValueError, match="samples must be between 1 and 32 for the 'held-out' split"):
        sldata.load_darcy(samples=33, split="held-out")


def test_a_file_too_small_to_split_says_how_to_regenerate(tmp_path):
    small = tmp_path / "small.npz"
    np.savez(small, permeability=np.ones((sldata.HELD_OUT, 4, 4), np.float32),
             pressure=np.ones((sldata.HELD_OUT, 4, 4), np.float32))
    assert len(sldata.load_darcy(small)["pressure"]) == sldata.HELD_OUT  # the whole file still loads
    with pytest.raises(ValueError, match="default --samples"):
        sldata.load_darcy(small, split="train")


def test_load_darcy_missing_file_says_how_to_regenerate(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="python data/generate_darcy.py"):
        sldata.load_darcy(tmp_path / "missing.npz")
    monkeypatch.setenv("SHARDLAB_DATA", str(tmp_path))
    assert sldata.data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        sldata.load_darcy()


def test_a_non_editable_install_finds_the_data_and_every_subpackage(tmp_path):
    """The package ships the dataset (a link to data/ in the repository, a copy in a wheel) and every subpackage
    (a folder missing from pyproject's package list would install nothing)."""
    import shutil
    import subprocess
    import sys

    wheel_dir, target, source = tmp_path / "wheel", tmp_path / "site", tmp_path / "source"
    # Built from a copy (the dataset link resolves inside it): setuptools writes build/ beside the sources it builds.
    skip = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(REPO / "helpers", source / "helpers", symlinks=True, ignore=skip)
    shutil.copytree(REPO / "data", source / "data")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheel_dir), str(source / "helpers")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(wheel_dir.glob("shardlab-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    load = ("import shardlab.data as d; print(d.__file__); print(d.load_darcy(samples=2)['pressure'].shape)")
    run = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [str(target / "shardlab" / "data" / "__init__.py"), "torch.Size([2, 1, 64, 64])"]
    subpackages = sorted(p.parent.name for p in (REPO / "helpers" / "shardlab").glob("*/__init__.py"))
    installed = sorted(p.parent.name for p in (target / "shardlab").glob("*/__init__.py"))
    assert installed == subpackages, "add the missing ones to helpers/pyproject.toml's packages"
    # the files python -m shardlab.port copies into a written run: a folder without __init__.py, listed by name
    templates = sorted(p.name for p in (REPO / "helpers" / "shardlab" / "port" / "run").glob("*.py"))
    assert sorted(p.name for p in (target / "shardlab" / "port" / "run").glob("*.py")) == templates


def test_normalized_darcy_scales_every_split_with_the_training_statistics():
    x, y = sldata.normalized_darcy()
    assert x.shape[1:] == y.shape[1:] == (1, 64, 64)
    assert abs(x.mean().item()) < 1e-4 and x.std().item() == pytest.approx(1.0, rel=1e-4)
    assert y.abs().max().item() == pytest.approx(1.0)
    first_x, first_y = sldata.normalized_darcy(samples=4)
    assert torch.equal(first_x, x[:4]) and torch.equal(first_y, y[:4])
    held_x, held_y = sldata.normalized_darcy(split="held-out")
    raw = sldata.load_darcy(split="held-out")
    scale = sldata.load_darcy(split="train")["pressure"].abs().max()
    torch.testing.assert_close(held_y * scale, raw["pressure"])  # the training maximum, not the held-out one
    assert not torch.equal(held_x, (raw["permeability"] - raw["permeability"].mean()) / raw["permeability"].std())


def test_sample_index_goes_round_the_training_set():
    assert [sldata.sample_index(step, 2, replica, 5) for step in range(3) for replica in range(2)] == [0, 1, 2, 3, 4, 0]
