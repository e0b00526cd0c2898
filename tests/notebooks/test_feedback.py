"""A wrong answer, as nbmake runs the notebook: the check's cell fails (the notebook fails there), and what it shows
is the check's message and hint alone, none of the judge's code (``NotSolved._render_traceback_``)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wrong_answer.ipynb"
pytestmark = pytest.mark.notebook


def test_a_rejected_answer_fails_the_cell_under_nbmake_and_shows_only_its_message(tmp_path):
    shutil.copy(FIXTURE, tmp_path / FIXTURE.name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # keep the repository's options out of it
    command = [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=120", "-p", "no:cacheprovider", "-p",
               "no:randomly", FIXTURE.name]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1 and "1 failed" in out, out[-3000:]
    assert "NotSolved: the number of ranks: got 3, which is not right. Count the engines." in out, out[-3000:]
    assert "judging.py" not in out and "Traceback (most recent call last)" not in out, out[-3000:]
    assert "never reached" not in out.split("NotSolved:")[1]  # the notebook stopped at the failing cell
