"""Workshop mode: every notebook 01-07 has exercises with checks; the handout strips the solutions;
blank answers fail their checks ("not answered yet") while the instructor copy passes (nbmake)."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from shardlab import check
from shardlab.handout import SOLUTION_TAG, blank_source, make_handout

ROOT = Path(__file__).resolve().parents[1]
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


def test_blank_source_keeps_the_magic_and_the_names():
    assert blank_source("%%px\nx = 1\nanswer = (x, 2)") == (
        "%%px\n# Your code here: replace each ... with your answer.\nx = ...\nanswer = ...")
    with pytest.raises(ValueError, match="assigns none"):
        blank_source("print(1)")


def test_handout_contains_no_solutions(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardlab.handout", str(ROOT / "notebooks"), str(tmp_path)],
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


@pytest.mark.parametrize("path", WORKSHOP, ids=lambda p: p.name)
def test_blank_exercises_fail_their_checks(path, tmp_path, no_leftovers):
    make_handout(path.parent, tmp_path)
    nb = nbformat.read(tmp_path / path.name, as_version=4)
    NotebookClient(nb, timeout=300, allow_errors=True, kernel_name="shardlab", resources={"metadata": {"path": str(tmp_path)}}).execute()
    check_cells = {c for _, c in exercises(nb)}
    for i, cell in enumerate(nb.cells):
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if i in check_cells:
            assert errors and errors[0].ename == "NotSolved" and "not answered yet" in errors[0].evalue, (
                f"{path.name} cell {i}: a blank answer did not fail its check: {errors or cell.outputs}")
        else:
            assert not errors, f"{path.name} cell {i} failed in the handout: {errors[0].ename}: {errors[0].evalue}"


def test_checks_say_which_rank_is_wrong(capsys):
    with pytest.raises(check.NotSolved, match=r"wrong on rank\(s\) \[1\]"):
        check.per_rank([0, 5], [0, 1], "rank")
    out = capsys.readouterr().out
    assert "✓ rank 0" in out and "✗ rank 1: rank = 5 (expected 1)" in out
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.per_rank([..., ...], [0, 1], "rank")
    check.answer(0.1 + 0.2, 0.3, "float sum")  # tolerant of rounding
    with pytest.raises(check.NotSolved, match="MASTER_ADDR"):
        check.launcher_environment({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, "torchrun", 2, 4, 2)
