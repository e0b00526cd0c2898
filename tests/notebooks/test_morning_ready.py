"""The machine check for the morning of a workshop (``make morning``) for real on this machine: it says ready in the
instructor copy and in a learner's kit (`make learner-kit`). Its verdicts with stand-in steps:
tests/unit/test_morning.py."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.notebook
def test_the_morning_check_says_ready_on_this_machine(no_leftovers):
    """The real check, as `make morning` runs it: 00 and 02 on ranks, no GPU here (about 1.5-2 minutes on 2 cores)."""
    # 2 ranks: beside another test's 8 ranks on 2 cores, the default 4 made that test's start outlast its wait.
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.morning"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2], env=os.environ | {"SHARDLAB_RANKS": "2"})
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "ready", proc.stdout[-3000:] + proc.stderr[-2000:]
    for step in ("environment", "notebook 00_setup", "notebook 02_device_mesh", "GPUs"):
        assert any(step in line for line in lines if line.startswith("[")), step


@pytest.mark.notebook
def test_the_morning_check_says_ready_in_a_learners_kit(tmp_path, no_leftovers):
    """What a learner runs before the day: `make morning` in the kit `make learner-kit` packs (its own helpers, this
    .venv linked in), the handout's 00 and 02 with their exercises blank. Outside pytest, as a learner runs it: under
    pytest a failed check always fails its cell."""
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("make learner-kit packs the files git tracks: this is not a git checkout")
    archive = tmp_path / "kit.tar.gz"
    built = subprocess.run(["make", "-s", "--no-print-directory", "learner-kit", f"LEARNER_KIT={archive}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(tmp_path)], check=True, timeout=120)
    kit = tmp_path / "shardlab-learner"
    (kit / ".venv").symlink_to(ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} | {
        "PYTHONPATH": str(kit / "helpers"), "SHARDLAB_RANKS": "2"}
    proc = subprocess.run(["make", "-s", "--no-print-directory", "morning"], cwd=kit, capture_output=True, text=True,
                          timeout=600, env=env)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "ready", proc.stdout[-3000:] + proc.stderr[-2000:]
    assert any(line.startswith("[3/4] notebook 02_device_mesh") for line in lines), proc.stdout
