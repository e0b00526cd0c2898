"""A learner who is stuck: a second, more specific hint after a failed try of an exercise, then the call that reveals
its reference answer; ``sl.exercises.reveal`` shows it, in the instructor copy and in a built handout, and the class
view records it; ``sl.exercises.yours_or_reference`` gives later cells the reference answer in the learners' copy only.
(07 carried through on the reference answers, in a kernel: tests/notebooks/test_stuck_learner_07.py.)"""

import ast
import importlib
import json
import re
from pathlib import Path

import nbformat
import pytest

from shardlab.exercises import answers, progress
from shardlab.exercises import judging as check
from shardlab.tools import class_view
from shardlab.tools.handout import make_handout

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(autouse=True)
def fresh_kernel_state(monkeypatch):
    """Each test starts as a fresh kernel does: no tries counted, nothing passed."""
    monkeypatch.setattr(check, "_tries", {})
    monkeypatch.setattr(check, "_passed", {})
    monkeypatch.setattr(check, "_whats", {})


def learners_copy(monkeypatch):
    """As in a kernel of `make lab-handout`: a failed check reports and the notebook goes on."""
    monkeypatch.setenv(check.CHECKS, "report")
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)


@check.second_hint("Count the engines, not the cores.")
def _count_judge(answer):
    return None if answer == 4 else "that is not the number of ranks"


def _message(answer) -> str:
    with pytest.raises(check.NotSolved) as failed:
        check.judged(_count_judge, answer, what="ranks", hint="One engine per rank.")
    return str(failed.value)


def test_the_second_hint_comes_after_a_failed_try_and_the_reveal_after_two():
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.judged(_count_judge, ..., what="ranks", hint="One engine per rank.")  # a blank is not a try
    first = _message(3)
    assert first == "ranks: that is not the number of ranks. One engine per rank."
    second = _message(5)
    assert second.splitlines() == ["ranks: that is not the number of ranks. One engine per rank.",
                                   "Second hint (try 2): Count the engines, not the cores."]
    third = _message(6)
    assert "Second hint (try 3)" in third and "reveal" not in third  # an int has no name to reveal by

    def count_ranks():  # a function answer: its name is the one reveal() takes
        return 2

    def judge(fn):
        return None if fn() == 4 else "wrong count"

    judge.second_hint = "Ask the cluster."
    for _ in range(3):
        with pytest.raises(check.NotSolved) as failed:
            check.judged(judge, count_ranks, what="a function", hint="Count.")
    assert str(failed.value).splitlines()[-1] == (
        "Still stuck? sl.exercises.reveal('count_ranks') shows the reference answer.")


def test_on_ranks_counts_tries_by_the_answers_name(capsys):
    class Ranks:  # runs the judge on each rank's namespace, as ipyparallel does on the engines
        view = None

        def __init__(self, answer):
            self.view, self.answer = self, answer

        def apply_sync(self, fn, judge, *references):
            return [fn(judge, self.answer)]

    @check.second_hint("Rows, not columns.")
    def judge(answer):
        return None if answer == (0, 16) else "not this rank's rows"

    for tries in (1, 2):
        with pytest.raises(check.NotSolved) as failed:
            check.on_ranks(Ranks((0, 8)), judge, "rows_of", what="rows", hint="Add the heights.")
        assert ("Second hint" in str(failed.value)) == (tries == 2)
    assert check._tries == {"rows_of": 2} and check._passed == {"rows_of": False}
    check.on_ranks(Ranks((0, 16)), judge, "rows_of", what="rows")
    assert check._passed == {"rows_of": True}


def _check_cells():
    """(notebook, solution cell, the check call's node) of every checked exercise."""
    found = []
    for path in NOTEBOOKS:
        cells = nbformat.read(path, as_version=4).cells
        for i, cell in enumerate(cells):
            if answers.SOLUTION_TAG in cell.metadata.get("tags", []):
                calls = [n for n in ast.walk(ast.parse(cells[i + 1].source)) if isinstance(n, ast.Call)
                         and ast.unparse(n.func) in ("sl.exercises.on_ranks", "sl.exercises.judged")]
                assert len(calls) == 1, f"{path.name} cell {i + 1}: one check call"
                found.append((path, cell, calls[0]))
    return found


def _judge_and_answer(call) -> tuple:
    """The judge a check call names, and the name of the answer it checks (the one reveal() takes)."""
    on_ranks = ast.unparse(call.func) == "sl.exercises.on_ranks"
    judge_name = ast.unparse(call.args[1 if on_ranks else 0])
    module, name = re.fullmatch(r"sl\.exercises\.(nb\d\d)\.(\w+)", judge_name).groups()
    judge = getattr(importlib.import_module(f"shardlab.exercises.{module}"), name)
    answer = call.args[2].value if on_ranks else call.args[1].id
    return judge, answer


def test_every_checked_exercise_has_a_second_hint_beyond_its_first():
    exercises = _check_cells()
    assert len(exercises) >= 28
    for path, _, call in exercises:
        judge, _ = _judge_and_answer(call)
        first = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "hint"))
        second = getattr(judge, "second_hint", "")
        where = f"{path.name}: {judge.__module__}.{judge.__name__}"
        assert len(second) >= 2 * len(first) // 3 and len(second) > 80, f"{where}: no real second hint"
        assert second != first and first not in second, f"{where}: the second hint repeats the first"


def test_each_exercise_answer_is_found_in_its_own_notebook_and_no_other():
    for path, solution, call in _check_cells():
        _, name = _judge_and_answer(call)
        assert answers.find(name, ROOT / "notebooks") == (path.name, solution.source), name
        binding = [p.name for p, cell, _ in _check_cells() if name in answers.bound(cell.source)]
        assert binding == [path.name], f"{name} is bound in {binding}: reveal({name!r}) would be ambiguous"


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    folder = tmp_path_factory.mktemp("handout")
    make_handout(ROOT / "notebooks", folder)
    return folder


def test_reveal_in_a_built_handout_shows_the_reference_says_so_and_is_recorded(handout, monkeypatch, tmp_path,
                                                                                 capsys):
    solution = next(c.source for c in nbformat.read(ROOT / "notebooks" / "07_capstone.ipynb", as_version=4).cells
                    if "def train_step(" in c.source and answers.SOLUTION_TAG in c.metadata.get("tags", []))
    handout_07 = (handout / "07_capstone.ipynb").read_text()
    assert "optimizer.step()" in solution and "optimizer.step()" not in handout_07  # the notebook holds no answer
    assert (handout / answers.FILE).exists()
    monkeypatch.chdir(handout)  # a notebook's kernel works in the notebook's folder
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    monkeypatch.setenv("JUPYTERHUB_USER", "ana")
    monkeypatch.setenv("JPY_SESSION_NAME", str(handout / "07_capstone.ipynb"))
    check.reveal("train_step")
    shown = capsys.readouterr().out
    assert shown.startswith("Revealed on purpose: the reference answer for train_step, from 07_capstone.ipynb")
    assert shown.rstrip("\n").endswith(solution)
    (record,) = progress.read_class(tmp_path)
    assert record["revealed"] is True and record["exercise"] == "train_step" and record["passed"] is False
    (row,) = class_view.class_rows(progress.read_class(tmp_path))
    assert row["revealed"] == "07_capstone.ipynb: train_step" and row["last check"].endswith("train_step revealed")
    assert row["stuck on"] == "-" and row["passed"] == 0  # asking is not a failed try


def test_reveal_in_the_instructor_copy_reads_the_solution_cells(capsys):
    check.reveal("read_rows", ROOT / "notebooks")
    assert "def read_rows(array, sample, domain):" in capsys.readouterr().out
    with pytest.raises(LookupError, match=r"no reference answer binds 'read_row'.*the name your answer cell defines"):
        check.reveal("read_row", ROOT / "notebooks")


def test_the_class_view_records_a_reveal_under_the_exercise_its_check_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    monkeypatch.setenv("JUPYTERHUB_USER", "bo")
    for _ in range(3):
        with pytest.raises(check.NotSolved):
            check.judged(_count_judge, 3, what="ranks")
    check.reveal("indices_of", ROOT / "notebooks")  # never checked in this kernel: recorded under its name

    def read_rows(array, sample, domain):
        return array

    with pytest.raises(check.NotSolved):
        check.judged(lambda fn: "it read every row", read_rows, what="this rank's rows")
    check.reveal("read_rows", ROOT / "notebooks")  # checked: recorded under the exercise its check named
    (row,) = class_view.class_rows(progress.read_class(tmp_path))
    assert row["stuck on"] == "?: ranks (3×)" and row["revealed"] == "?: indices_of; ?: this rank's rows"
    assert class_view.main([str(tmp_path)]) == 0
    assert "| revealed" in capsys.readouterr().out


def _folder_with(tmp_path, *solutions: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s, metadata={"tags": ["solution"]})
                                         for s in solutions])
    nbformat.write(nb, tmp_path / "99_lesson.ipynb")
    return tmp_path


def _double_judge(fn):
    return None if fn(3) == 6 else "it does not double"


def test_later_cells_carry_on_with_the_reference_in_the_learners_copy_only(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(_folder_with(tmp_path, "def double(x):\n    return 2 * x", "%%px\ndef on_ranks(x):\n    x"))

    def double(x):  # the learner's, wrong
        return x + 2

    with pytest.raises(check.NotSolved):  # under pytest, or in the instructor copy, the check cell fails
        check.judged(_double_judge, double, what="double")
    assert check.yours_or_reference("double", double) is double
    learners_copy(monkeypatch)
    check.judged(_double_judge, double, what="double")  # reports, goes on
    capsys.readouterr()
    carried = check.yours_or_reference("double", double)
    assert carried is not double and carried(21) == 42
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "the cells below carry on with the reference double" in said
    check.judged(_double_judge, carried, what="double")  # the check cell run again, on the name now bound to it
    assert "not answered yet" in capsys.readouterr().err and not check._passed["double"]  # it is not the learner's
    monkeypatch.setattr(check, "_passed", {})
    assert check.yours_or_reference("double", double)(5) == 10  # never checked in this kernel: the reference too
    capsys.readouterr()

    def double(x):  # the learner's, fixed
        return 2 * x

    check.judged(_double_judge, double, what="double")
    assert check.yours_or_reference("double", double) is double  # passed: the learner's own
    with pytest.raises(ValueError, match="runs on the ranks"):
        check.yours_or_reference("on_ranks", double)  # never checked here; a %%px answer cannot stand in


def test_the_handout_keeps_every_solution_cell_for_reveal(handout):
    kept = json.loads((handout / answers.FILE).read_text())
    for path in NOTEBOOKS:
        solutions = [c.source for c in nbformat.read(path, as_version=4).cells
                     if answers.SOLUTION_TAG in c.metadata.get("tags", [])]
        assert kept.get(path.name, []) == solutions, path.name
