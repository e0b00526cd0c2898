"""Workshop mode: every notebook from 01 on has exercises with checks, and the handout is every notebook, 00 to the
last, with each solution blanked and nothing else changed. That every check rejects the blank and the wrong answers is
rehearsed in test_notebooks.py, on the way through each notebook."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardlab.tools.handout import SOLUTION_TAG, blank_source

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CORE = ("01", "07")  # the workshop's core notebooks: two exercises at least in each


def exercises(nb):
    """(solution cell index, check cell index) pairs."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if SOLUTION_TAG in cell.metadata.get("tags", []) or "exercise" in cell.metadata.get("tags", []):
            pairs.append((i, i + 1))
    return pairs


def test_every_notebook_from_01_has_checked_exercises():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert numbers == [f"{i:02d}" for i in range(len(NOTEBOOKS))] and len(NOTEBOOKS) >= 12, numbers
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        pairs = exercises(nb)
        if path.name.startswith("00"):  # the setup check learners run before the day: nothing to answer
            assert not pairs, path.name
            continue
        assert len(pairs) >= (2 if CORE[0] <= path.name[:2] <= CORE[1] else 1), path.name
        for _, check_index in pairs:
            assert "sl.exercises." in nb.cells[check_index].source, f"{path.name}: cell {check_index} checks nothing"


HEADER = "# Your code here: replace each ... with your answer."


@pytest.mark.parametrize("source, names", [
    ("%%px\nx = 1\nanswer = (x, 2)", ["x", "answer"]),
    ("for r in range(4):\n    answer = r", ["answer"]),  # assigned in a loop
    ("start, stop = 0, 4\nanswer = (start, stop)", ["start", "stop", "answer"]),  # tuple unpacking
    ("(a, [b, *rest]) = 1, [2, 3]", ["a", "b", "rest"]),
    ("if True:\n    answer = 1\nelse:\n    answer = 2", ["answer"]),
    ("with open('f') as f:\n    total = 0\n    total += 1", ["total"]),
    ("try:\n    answer = 1\nexcept ValueError:\n    fallback = 0", ["answer", "fallback"]),
    ("answer: int = 3\nif (n := 2):\n    pass", ["answer", "n"]),
])
def test_blank_source_blanks_every_name_the_cell_binds(source, names):
    magic = ["%%px"] if source.startswith("%%px") else []
    assert blank_source(source) == "\n".join([*magic, HEADER, *(f"{n} = ..." for n in names)])


def test_a_function_keeps_its_signature_and_docstring_and_nothing_of_its_body():
    source = ('%%px\ndef read_rows(array, sample,\n              domain):\n    """This rank\'s rows.\n\n    More."""\n'
              '    rows = array[sample]\n    return rows\n\n\ndef helper(x): return x + 1\nanswer = read_rows(1, 2, 3)')
    assert blank_source(source) == "\n".join([
        "%%px", HEADER, "def read_rows(array, sample,", "              domain):", '    """This rank\'s rows.', "",
        '    More."""', "    ...", "", "def helper(x):", "    ...", "", "answer = ..."])


def test_a_blank_function_is_not_answered_yet_and_an_answer_is(monkeypatch):
    from shardlab.exercises import judging as check

    namespace = {}
    exec(blank_source('def f(x):\n    """Doc."""\n    return x + 1'), namespace)
    assert check._blank(namespace["f"])
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.judged(lambda f: None, namespace["f"], what="f")
    exec("def g(x):\n    return x + 1\ndef h(x):\n    x.append(1)", namespace)
    assert not check._blank(namespace["g"]) and not check._blank(namespace["h"]) and not check._blank(len)


def only_blanks(source: str) -> bool:
    """Whether a handout cell holds nothing of an answer: each statement a ``name = ...``, or a function whose body
    is its docstring and ``...``."""
    import ast

    lines = source.splitlines()
    tree = ast.parse("\n".join(lines[1:] if lines and lines[0].startswith("%%") else lines))
    ellipsis = lambda node: isinstance(node, ast.Constant) and node.value is Ellipsis  # noqa: E731
    for statement in tree.body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and ellipsis(statement.value):
            continue
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = statement.body[1:] if isinstance(statement.body[0], ast.Expr) and isinstance(
                statement.body[0].value, ast.Constant) and isinstance(statement.body[0].value.value, str) else \
                statement.body
            if len(body) == 1 and isinstance(body[0], ast.Expr) and ellipsis(body[0].value):
                continue
        return False
    return bool(tree.body)


def test_blank_source_refuses_a_cell_that_binds_nothing():
    with pytest.raises(ValueError, match="assigns none"):
        blank_source("print(1)")


def test_the_handout_is_every_notebook_with_each_solution_blanked_and_nothing_else_changed(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.handout", str(ROOT / "notebooks"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"wrote {len(NOTEBOOKS)} learner notebooks" in proc.stdout, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [p.name for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        original, handout = (nbformat.read(p, as_version=4) for p in (path, tmp_path / path.name))
        assert [c.cell_type for c in original.cells] == [c.cell_type for c in handout.cells], path.name
        solutions = {i for i, c in enumerate(original.cells) if SOLUTION_TAG in c.metadata.get("tags", [])}
        assert [i for i, _ in exercises(handout)] == sorted(solutions), path.name
        for i, (cell, given) in enumerate(zip(original.cells, handout.cells)):
            where = f"{path.name} cell {i}"
            assert "shardlab" not in given.metadata, f"{where}: the wrong answers the tests try are not for learners"
            if given.cell_type == "code":
                assert given.outputs == [] and given.execution_count is None, f"{where} keeps its outputs"
            if i not in solutions:
                assert given.source == cell.source, f"{where} changed, but it is not a solution"
                continue
            assert given.source == blank_source(cell.source), where
            assert only_blanks(given.source), f"{where} leaks its solution"
            assert given.metadata["tags"].count("exercise") == 1 and SOLUTION_TAG not in given.metadata["tags"]
