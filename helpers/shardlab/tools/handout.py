"""Learner handout: the notebooks with every solution cell blanked.

``python -m shardlab.tools.handout [SRC] [OUT]`` (``make handout``) copies ``notebooks/`` to
``build/handout/``. A cell tagged ``solution`` keeps its ``%%px`` line and its functions' signatures and
docstrings (``...`` for a body), and each other name it assigns becomes ``name = ...``: the exercise check reports
either as "not answered yet". The blanked cells' sources are kept beside the notebooks, in ``answers.FILE``, where
``sl.exercises.reveal`` shows one when a learner asks, and where 07's later cells take the reference answer of a learner
who has not passed its check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import nbformat

from ..exercises import answers
from ..exercises.answers import SOLUTION_TAG


def _bound_names(statements) -> list[str]:
    """Names a block of statements assigns or defines, in order, looking into loops, branches and
    ``with``/``try`` blocks but not into function or class bodies (their names are local)."""
    names: list[str] = []

    def targets(node):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                yield from targets(element)
        elif isinstance(node, ast.Starred):
            yield from targets(node.value)

    def visit(statement):
        found = []
        if isinstance(statement, ast.Assign):
            found = [n for t in statement.targets for n in targets(t)]
        elif isinstance(statement, (ast.AugAssign, ast.AnnAssign)):
            found = list(targets(statement.target))
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [statement.name]
        found += [n.target.id for n in ast.walk(statement) if isinstance(n, ast.NamedExpr)
                  and not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        names.extend(n for n in found if n not in names)
        if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for block in ("body", "orelse", "finalbody"):
                for child in getattr(statement, block, []):
                    visit(child)
            for handler in getattr(statement, "handlers", []):
                for child in handler.body:
                    visit(child)

    for statement in statements:
        visit(statement)
    return names


def blank_source(source: str) -> str:
    """The learner's version of a solution cell: the same names to fill in, no answer.

    Every function the cell defines keeps its signature and docstring with ``...`` for a body; every other name it
    assigns (also in loops, branches or by unpacking) becomes ``name = ...``; a ``%%`` cell magic stays. A cell that
    assigns nothing is refused: its check would have nothing to read.
    """
    lines = source.splitlines()
    magic = [lines[0]] if lines and lines[0].startswith("%%") else []
    body = lines[len(magic):]
    statements = ast.parse("\n".join(body)).body
    names = _bound_names(statements)
    if not names:
        raise ValueError(f"a solution cell must assign the names the check reads; this one assigns none:\n{source}")
    functions = {s.name: s for s in statements if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
    blanks = [f"{_signature(body, functions[n])}\n" if n in functions else f"{n} = ..." for n in names]
    return "\n".join([*magic, "# Your code here: replace each ... with your answer.", *blanks]).rstrip("\n")


def _signature(lines: list[str], function: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function of the solution as the learner gets it: its decorators, signature and docstring, ``...`` for a
    body (the check says "not answered yet" for a function that does nothing)."""
    first = min([function.lineno, *(d.lineno for d in function.decorator_list)])
    body = function.body
    documented = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
        body[0].value.value, str)
    last = body[0].end_lineno if documented else body[0].lineno - 1
    kept = lines[first - 1:last]
    if not documented and body[0].lineno == function.lineno:  # a one-line def: `def f(x): return x`
        kept = [lines[function.lineno - 1][:body[0].col_offset].rstrip()]
    return "\n".join([*kept, " " * (function.col_offset + 4) + "..."])


def wrong_answers(cell) -> list[dict]:
    """Plausible wrong answers kept with a solution cell (metadata ``shardlab.wrong_answers``): each a
    ``{"source": ..., "why": ...}`` that the exercise's check must reject. Tests run them; the handout drops them."""
    return list(cell.get("metadata", {}).get("shardlab", {}).get("wrong_answers", []))


def make_handout(src: Path, out: Path) -> list[Path]:
    """Write every notebook of ``src`` to ``out`` with solution cells blanked, and their sources to the file of
    reference answers there; return the notebooks written."""
    out.mkdir(parents=True, exist_ok=True)
    written, references = [], {}
    for path in sorted(src.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            tags = cell.get("metadata", {}).get("tags", [])
            if SOLUTION_TAG in tags:
                references.setdefault(path.name, []).append(cell.source)
                cell.source = blank_source(cell.source)
                cell.metadata["tags"] = [t for t in tags if t != SOLUTION_TAG] + ["exercise"]
                cell.metadata.pop("shardlab", None)  # the wrong answers the tests try: not for learners
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, out / path.name)
        written.append(out / path.name)
    answers.write(out, references)
    return written


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    src = Path(args[0] if args else "notebooks")
    out = Path(args[1] if len(args) > 1 else "build/handout")
    written = make_handout(src, out)
    print(f"wrote {len(written)} learner notebooks without solutions to {out}/, and their reference answers, which "
          f"sl.exercises.reveal shows, to {out / answers.FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
