"""A notebook must fail under nbmake when any rank raises, and fail (not hang) when a rank skips a
collective. Each fixture runs in its own pytest, as CI would run a learner's notebook. The control, a
fixture that passes under nbmake, is run by tests/test_faults.py (two of them at once)."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.notebook


def run_nbmake(name: str, tmp_path: Path, timeout_s: float = 240) -> tuple[int, str, float]:
    shutil.copy(FIXTURES / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keep the repository's options out of it
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=200", "-p", "no:cacheprovider", name],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout_s,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_error_on_one_rank_fails_the_notebook(tmp_path, no_leftovers):
    code, out, _ = run_nbmake("fails_on_one_rank.ipynb", tmp_path)
    assert code == 1, f"nbmake did not fail a notebook whose rank 1 raised:\n{out[-3000:]}"
    assert "rank 1: ValueError: rank 1 fails on purpose" in out


def test_rank_skipping_a_collective_fails_within_the_timeout(tmp_path, no_leftovers):
    code, out, _ = run_nbmake("hangs_in_collective.ipynb", tmp_path)
    assert code == 1, out[-3000:]
    assert "Timed out waiting 10000ms" in out
    assert "rank(s) [0] timed out in a collective waiting for rank(s) [1]" in out
    # It was the collective's 10 s timeout that ended the wait, not nbmake's cell timeout (200 s) or ours (240 s).
    assert "CellTimeoutError" not in out and "Timeout waiting for execute reply" not in out


def test_cell_slower_than_cell_timeout_fails_naming_the_busy_rank(tmp_path, no_leftovers):
    code, out, _ = run_nbmake("slower_than_cell_timeout.ipynb", tmp_path)
    assert code == 1, out[-3000:]
    assert "rank(s) [1] did not finish within 5 s (cell_timeout_s)" in out, out[-3000:]
    assert "CellTimeoutError" not in out
