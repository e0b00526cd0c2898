"""07's capstone runs for a learner stuck on its exercises. In the learners' copy (the handout, with
``SHARDLAB_CHECKS=report`` as `make lab-handout` sets it, in a kernel outside pytest), with a wrong ``train_step``
(one of the wrong answers kept with the solution) and ``save_checkpoint`` left blank, each check reports and the
notebook goes on; the cells after them carry on with the reference answers and say so; training, checkpoint, resume
on fresh ranks and the one-process baseline pass the notebook's own assertions. In the same kernel
``sl.exercises.reveal`` shows the reference ``train_step`` from the handout's folder, and the class view records the
failed try and the reveal. (Under pytest and in the instructor copy a failed check still fails the cell:
tests/notebooks/test_feedback.py, tests/unit/test_check.py.)"""

import os
import shutil
from pathlib import Path

import nbformat
import pytest

from notebook_runner import run_notebook
from shardlab.exercises import judging as check
from shardlab.exercises import progress
from shardlab.tools.handout import SOLUTION_TAG, make_handout, wrong_answers

CAPSTONE = Path(__file__).resolve().parents[2] / "notebooks" / "07_capstone.ipynb"
WRONG_STEP = "no optimizer step"  # a step that runs and returns a loss, but does not train: the baseline would fail
pytestmark = pytest.mark.notebook


def shown(cell) -> str:
    """Everything a cell showed: its printed text (stdout and stderr), results and errors."""
    parts = []
    for out in cell.get("outputs", []):
        parts += [out.get("text", ""), out.get("data", {}).get("text/plain", ""), out.get("evalue", "")]
    return "\n".join(parts)


def test_a_learner_stuck_on_07s_exercises_still_runs_the_capstone(tmp_path, no_leftovers):
    source = tmp_path / "notebooks"
    source.mkdir()
    shutil.copy(CAPSTONE, source)
    handout = tmp_path / "handout"
    make_handout(source, handout)
    instructor = {c.id: c for c in nbformat.read(CAPSTONE, as_version=4).cells}
    nb = nbformat.read(handout / CAPSTONE.name, as_version=4)
    cells = {c.id: c for c in nb.cells}
    assert SOLUTION_TAG in instructor["07-06"].metadata["tags"] and "def train_step(" in instructor["07-06"].source
    cells["07-06"].source = next(w["source"] for w in wrong_answers(instructor["07-06"]) if w["why"] == WRONG_STEP)
    nb.cells.append(nbformat.v4.new_code_cell('sl.exercises.reveal("train_step")'))
    nbformat.write(nb, handout / CAPSTONE.name)
    class_folder = tmp_path / "class"
    class_folder.mkdir()
    learner = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # a learner's kernel: no pytest
    learner |= {check.CHECKS: "report", "SHARDLAB_RANKS": "2", "CAPSTONE_STEPS": "20",
                progress.CLASS_DIR: str(class_folder), "JUPYTERHUB_USER": "stuck"}

    run = run_notebook(handout / CAPSTONE.name, rehearse=False, env=learner, timeout_s=600)  # every cell passed

    said = {c.id: shown(c) for c in run.notebook.cells if c.cell_type == "code"}
    step, saving = said["07-07"], said["07-14"]
    assert "NotSolved: your training step against sl.train.Trainer: wrong on rank(s)" in step, step
    assert "Run All goes on" in step
    assert "↪ train_step has not passed its check: the cells below carry on with the reference train_step" in step
    assert "not answered yet" in saving and "↪ save_checkpoint has not passed its check" in saving, saving
    assert "not answered yet" in said["07-31"]  # exercise 3, blank: reported, and nothing builds on it
    assert "largest difference from one process over 20 steps" in said["07-24"]  # the baseline's assertions held
    revealed = said[nb.cells[-1].id]
    assert revealed.startswith("Revealed on purpose: the reference answer for train_step, from 07_capstone.ipynb")
    assert instructor["07-06"].source in revealed
    records = [(r["exercise"], r["passed"], r.get("revealed", False)) for r in progress.read_class(class_folder)]
    assert records == [("your training step against sl.train.Trainer", False, False),  # a blank is not a try
                       ("your training step against sl.train.Trainer", False, True)], records
