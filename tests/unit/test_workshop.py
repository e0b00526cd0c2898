"""Workshop mode: every notebook 01-07 has exercises with checks, and the handout strips the solutions.
That every check rejects the blank and the wrong answers is rehearsed in test_notebooks.py, on the way
through each notebook."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardlab.tools.handout import SOLUTION_TAG, blank_source

ROOT = Path(__file__).resolve().parents[2]
WORKSHOP = sorted(p for p in (ROOT / "notebooks").glob("0*.ipynb") if "01" <= p.name[:2] <= "07")


def exercises(nb):
    """(solution cell index, check cell index) pairs."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if SOLUTION_TAG in cell.metadata.get("tags", []) or "exercise" in cell.metadata.get("tags", []):
            pairs.append((i, i + 1))
    return pairs


def test_every_notebook_01_to_07_has_two_checked_exercises():
    assert [p.name[:2] for p in WORKSHOP] == ["01", "02", "03", "04", "05", "06", "07"]
    for path in WORKSHOP:
        nb = nbformat.read(path, as_version=4)
        pairs = exercises(nb)
        assert len(pairs) >= 2, path.name
        for _, check_index in pairs:
            assert "sl.check." in nb.cells[check_index].source, f"{path.name}: cell {check_index} checks nothing"


HEADER = "# Your code here: replace each ... with your answer."


@pytest.mark.parametrize("source, names", [
    ("%%px\nx = 1\nanswer = (x, 2)", ["x", "answer"]),
    ("for r in range(4):\n    answer = r", ["answer"]),  # assigned in a loop
    ("start, stop = 0, 4\nanswer = (start, stop)", ["start", "stop", "answer"]),  # tuple unpacking
    ("(a, [b, *rest]) = 1, [2, 3]", ["a", "b", "rest"]),
    ("if True:\n    answer = 1\nelse:\n    answer = 2", ["answer"]),
    ("with open('f') as f:\n    total = 0\n    total += 1", ["total"]),
    ("try:\n    answer = 1\nexcept ValueError:\n    fallback = 0", ["answer", "fallback"]),
    ("def step(model):\n    loss = 1\n    return loss", ["step"]),  # the function, not its locals
    ("answer: int = 3\nif (n := 2):\n    pass", ["answer", "n"]),
])
def test_blank_source_blanks_every_name_the_cell_binds(source, names):
    magic = ["%%px"] if source.startswith("%%px") else []
    assert blank_source(source) == "\n".join([*magic, HEADER, *(f"{n} = ..." for n in names)])


def test_blank_source_refuses_a_cell_that_binds_nothing():
    with pytest.raises(ValueError, match="assigns none"):
        blank_source("print(1)")


def test_handout_contains_no_solutions(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.handout", str(ROOT / "notebooks"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "learner notebooks" in proc.stdout, proc.stderr
    for path in WORKSHOP:
        original, handout = (nbformat.read(p, as_version=4) for p in (path, tmp_path / path.name))
        assert len(original.cells) == len(handout.cells)
        for (i, _), (j, _) in zip(exercises(original), exercises(handout)):
            solution, blank = original.cells[i].source, handout.cells[j].source
            assert SOLUTION_TAG not in handout.cells[j].metadata.get("tags", [])
            body = [line for line in solution.splitlines() if "=" in line and not line.startswith("%%")]
            assert body and not any(line in blank for line in body), f"{path.name} cell {i} leaks its solution"
            assert "= ..." in blank
