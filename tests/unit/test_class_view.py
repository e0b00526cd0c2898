"""The instructor's class view: each check's result, written only where the instructor set up a class folder, one
file per learner; ``python -m shardlab.tools.class_view`` shows who is on which exercise and who is stuck."""

import json
import os
import subprocess
import sys

import pytest

from shardlab.exercises import progress
from shardlab.tools import class_view


def as_learner(monkeypatch, who: str, notebook: str = "notebooks/12_data_at_scale.ipynb"):
    monkeypatch.setenv("JUPYTERHUB_USER", who)
    monkeypatch.setenv("JPY_SESSION_NAME", notebook)


def test_nothing_is_written_without_a_class_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(progress.CLASS_DIR, raising=False)
    assert progress.record("slab reader", True) is None
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path / "not-made"))  # named but not made: still nothing
    assert progress.record("slab reader", True) is None and not (tmp_path / "not-made").exists()


def test_two_learners_progress_and_who_is_stuck(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    as_learner(monkeypatch, "ana")
    for passed in (False, True):
        progress.record("slab reader", passed)
    progress.record("samples of a domain group", True)
    as_learner(monkeypatch, "bo")
    progress.record("slab reader", True)
    for _ in range(3):
        progress.record("samples of a domain group", False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ana.jsonl", "bo.jsonl"]
    lines = (tmp_path / "bo.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) | {"time": 0} == {"learner": "bo", "notebook": "12_data_at_scale.ipynb",
                                                    "exercise": "slab reader", "passed": True, "time": 0}
    rows = {r["learner"]: r for r in class_view.class_rows(progress.read_class(tmp_path))}
    assert rows["ana"]["passed"] == 2 and rows["ana"]["stuck on"] == "-"
    assert rows["bo"]["passed"] == 1
    assert rows["bo"]["stuck on"] == "12_data_at_scale.ipynb: samples of a domain group (3×)"
    assert rows["bo"]["last check"].endswith("samples of a domain group ✗")
    assert class_view.main([str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "ana" in shown and "bo" in shown and "(3×)" in shown


def test_a_pass_clears_stuck_and_a_broken_line_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    as_learner(monkeypatch, "cy")
    for passed in (False, False, False, True):
        progress.record("mean of a sharded field", passed)
    with open(tmp_path / "cy.jsonl", "a") as f:
        f.write("{half a line\n")
    (row,) = class_view.class_rows(progress.read_class(tmp_path))
    assert row["stuck on"] == "-" and row["passed"] == 1


def test_the_command_says_what_to_give_for_a_missing_folder(tmp_path):
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-m", "shardlab.tools.class_view", str(tmp_path / "nope")],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2 and "SHARDLAB_CLASS_DIR" in run.stderr
    assert class_view.main([str(tmp_path)]) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_the_learner_cannot_write_never_fails_the_check(monkeypatch, tmp_path):
    tmp_path.chmod(0o500)
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    try:
        assert progress.record("anything", True) is None
    finally:
        tmp_path.chmod(0o700)
