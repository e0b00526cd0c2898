"""What learners get (INSTRUCTORS.md, "Learner pre-work"): `make learner-kit` packs the checkout with the handout in
place of the instructor copy, the kit's `make lab` opens the handout with checks that report, and its `make morning`
checks it (tests/notebooks/test_morning_ready.py runs that check in a kit). `make env` refuses a platform the lock has
no wheels for before it creates anything."""

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = "solution"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def build_kit(tmp_path: Path) -> Path:
    """`make learner-kit` into ``tmp_path``, unpacked there: the kit's folder."""
    if subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("make learner-kit packs the files git tracks: this is not a git checkout")
    archive = tmp_path / "kit.tar.gz"
    out = subprocess.run(["make", "-s", "--no-print-directory", "learner-kit", f"LEARNER_KIT={archive}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no instructor copy" in out.stdout, out.stdout
    with tarfile.open(archive) as tar:
        assert {Path(name).parts[0] for name in tar.getnames()} == {"shardlab-learner"}
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "shardlab-learner"


def solutions(folder: Path) -> dict[str, list[str]]:
    found = {}
    for path in sorted(folder.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        found[path.name] = ["".join(c["source"]) for c in cells if SOLUTION in c.get("metadata", {}).get("tags", [])]
    return found


def test_the_kit_holds_the_handout_and_none_of_the_instructors_material(tmp_path):
    kit = build_kit(tmp_path)
    for left_out in ("notebooks", "tests", "instructors", ".ci", "conftest.py"):
        assert not (kit / left_out).exists(), f"{left_out} is in the learners' kit"
    for needed in ("Makefile", "requirements.txt", "helpers/pyproject.toml", "lab-config/overrides.json",
                   "data/README.md", "helpers/shardlab/tools/morning.py", "INSTRUCTORS.md"):
        assert (kit / needed).is_file(), needed
    theirs, ours = solutions(kit / "build/handout"), solutions(ROOT / "notebooks")
    assert sorted(theirs) == sorted(ours), "every notebook, handed out"
    answered = [(name, i) for name in ours for i, (a, b) in enumerate(zip(ours[name], theirs[name])) if a == b]
    assert sum(map(len, ours.values())) > 20 and not answered, f"solution cells handed out as they are: {answered}"


def test_the_kits_make_lab_opens_the_handout_with_checks_that_report_and_make_morning_checks_it(tmp_path):
    kit = build_kit(tmp_path)
    lab = subprocess.run(["make", "-n", "--no-print-directory", "lab"], cwd=kit, capture_output=True, text=True,
                         timeout=60)
    assert lab.returncode == 0, lab.stderr
    assert "jupyter lab build/handout/ " in lab.stdout and "SHARDLAB_CHECKS=report" in lab.stdout, lab.stdout
    morning = subprocess.run(["make", "-n", "--no-print-directory", "morning"], cwd=kit, capture_output=True,
                             text=True, timeout=60)
    assert morning.stdout.strip().splitlines()[-1] == ".venv/bin/python -m shardlab.tools.morning", morning.stdout
    hub = subprocess.run(["make", "-n", "--no-print-directory", "morning", "LAB_PYTHON=/opt/hub/bin/python"], cwd=kit,
                         capture_output=True, text=True, timeout=60)
    assert hub.stdout.strip().splitlines()[-1].endswith("morning --lab-python /opt/hub/bin/python"), hub.stdout


def test_the_instructor_copy_opens_as_before():
    lab = subprocess.run(["make", "-n", "--no-print-directory", "lab"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "jupyter lab notebooks/ " in lab.stdout and "SHARDLAB_CHECKS" not in lab.stdout, lab.stdout


@pytest.mark.parametrize("system, machine", [("Darwin", "arm64"), ("Linux", "aarch64")])
def test_a_platform_the_lock_has_no_wheels_for_is_refused_before_venv_exists(tmp_path, system, machine):
    fake = tmp_path / "bin" / "uname"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\ncase "$1" in -s) echo {system};; -m) echo {machine};; esac\n')
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "--no-print-directory", "env", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=os.environ | {"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert out.returncode != 0 and not venv.exists()
    assert (f"the lock (requirements.txt) installs on Linux x86_64 only, and this is {system} {machine}"
            in out.stderr), out.stderr
