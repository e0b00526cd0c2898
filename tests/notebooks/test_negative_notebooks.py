"""A notebook must fail under nbmake when any rank raises, fail (not hang) when a rank skips a collective,
and fail when a cell outlives the cluster's cell_timeout_s. The fixtures run in one pytest of their own,
as CI would run a learner's notebooks. The control, a fixture that passes under nbmake, is run by
tests/multirank/test_faults.py (two of them at once)."""

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from shardlab.ranks.devices import place_ranks, visible_gpus

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# What rank 0 of the skipped collective raises, by backend (see workarounds.nccl_errors_raise): gloo's collective
# times out itself; NCCL's watchdog aborts the communicator and the next collective raises.
SKIPPED_COLLECTIVE_ERROR = {"gloo": ["Timed out waiting 10000ms"],
                            "nccl": ["NCCL communicator was aborted on rank 0",
                                     "Watchdog caught collective operation timeout"]}
FAILING = ("fails_on_one_rank.ipynb", "hangs_in_collective.ipynb", "slower_than_cell_timeout.ipynb")
pytestmark = pytest.mark.notebook


@pytest.fixture(scope="module")
def nbmake_failures(tmp_path_factory) -> dict[str, str]:
    """Each failing fixture's failure report from one ``pytest --nbmake`` run ("" if it passed)."""
    where = tmp_path_factory.mktemp("negative")
    for name in FAILING:
        shutil.copy(FIXTURES / name, where / name)
    (where / "pytest.ini").write_text("[pytest]\n")  # keep the repository's options out of it
    # The three side by side (-n 3): each mostly waits, for a timeout or on purpose.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "3", "--nbmake", "--nbmake-timeout=200", "-p",
                           "no:cacheprovider", "--junitxml=report.xml", *FAILING],
                          cwd=where, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    reports = {}
    for case in ElementTree.parse(where / "report.xml").iter("testcase"):
        failure = case.find("failure")
        name = next(n for n in FAILING if n in f"{case.get('classname')} {case.get('name')}")
        reports[name] = "" if failure is None else f"{failure.get('message', '')}\n{failure.text or ''}"
    assert set(reports) == set(FAILING), reports
    return reports


def test_error_on_one_rank_fails_the_notebook(nbmake_failures):
    out = nbmake_failures["fails_on_one_rank.ipynb"]
    assert out, "nbmake did not fail a notebook whose rank 1 raised"
    assert "rank 1: ValueError: rank 1 fails on purpose" in out, out[-3000:]


def test_rank_skipping_a_collective_fails_within_the_timeout(nbmake_failures):
    out = nbmake_failures["hangs_in_collective.ipynb"]
    backend = "nccl" if place_ranks(2, visible_gpus()).device == "cuda" else "gloo"  # what start_cluster(n=2) gets
    for expected in SKIPPED_COLLECTIVE_ERROR[backend]:
        assert expected in out, out[-3000:]
    assert "rank(s) [0] timed out in a collective waiting for rank(s) [1]" in out
    # It was the collective's 10 s timeout that ended the wait, not nbmake's cell timeout (200 s).
    assert "CellTimeoutError" not in out and "Timeout waiting for execute reply" not in out


def test_cell_slower_than_cell_timeout_fails_naming_the_busy_rank(nbmake_failures):
    out = nbmake_failures["slower_than_cell_timeout.ipynb"]
    assert "rank(s) [1] did not finish within 5 s (cell_timeout_s)" in out, out[-3000:]
    assert "CellTimeoutError" not in out
