"""The reference answers of the exercises, found by a name they bind, for a learner who asks (``sl.exercises.reveal``)
and for the cells that build on an exercise (``sl.exercises.yours_or_reference``).

In the instructor copy they are the notebooks' solution cells. The learners' handout blanks those cells
(``tools.handout``), and keeps their sources in one file beside the notebooks (``FILE``, a hidden file: JupyterLab's
file browser does not list it). Either is read from the notebooks' folder, which is a notebook kernel's working folder.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

SOLUTION_TAG = "solution"  # an answer cell of the instructor copy
FILE = ".reference_answers.json"  # {notebook file name: [the source of each of its solution cells]}


def bound(source: str) -> set[str]:
    """The names a cell binds at its top level (a ``%%`` cell magic left out)."""
    lines = source.splitlines()
    try:
        tree = ast.parse("\n".join(lines[1:] if lines and lines[0].startswith("%%") else lines))
    except SyntaxError:
        return set()
    names = set()
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        else:
            names |= {n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def write(folder: Path, sources: dict[str, list[str]]) -> Path:
    """Keep the solution cells' sources, by notebook, in ``folder`` (the handout's)."""
    path = Path(folder) / FILE
    path.write_text(json.dumps(sources, indent=1, ensure_ascii=False) + "\n")
    return path


def _cells(folder: Path) -> list[tuple[str, str]]:
    if (folder / FILE).exists():
        return [(notebook, source) for notebook, sources in json.loads((folder / FILE).read_text()).items()
                for source in sources]
    return [(path.name, "".join(cell["source"])) for path in sorted(folder.glob("*.ipynb"))
            for cell in json.loads(path.read_text())["cells"]
            if SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])]


def find(name: str, folder=None) -> tuple[str, str]:
    """(notebook, source) of the reference answer that binds ``name``, from ``folder`` (the working folder if None)."""
    folder = Path(folder or os.getcwd())
    found = [(notebook, source) for notebook, source in _cells(folder) if name in bound(source)]
    if not found:
        raise LookupError(f"no reference answer binds {name!r} in {folder}: give the name your answer cell defines, "
                          f"in the notebooks' folder (`make handout` keeps the answers there, in {FILE})")
    return found[0]
