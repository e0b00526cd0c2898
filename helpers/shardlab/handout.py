"""Learner handout: the notebooks with every solution cell blanked.

``python -m shardlab.handout [SRC] [OUT]`` (``make handout``) copies ``notebooks/`` to
``build/handout/``. A cell tagged ``solution`` keeps its ``%%px`` line, and each name it
assigns becomes ``name = ...``, which the exercise check reports as "not answered yet".
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SOLUTION_TAG = "solution"


def blank_source(source: str) -> str:
    """The learner's version of a solution cell: the same names to fill in, no answer."""
    lines = source.splitlines()
    magic = [lines[0]] if lines and lines[0].startswith("%%") else []
    body = "\n".join(lines[len(magic):])
    names: list[str] = []
    for node in ast.parse(body).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Name) and target.id not in names:
                names.append(target.id)
    if not names:
        raise ValueError(f"a solution cell must assign the names the check reads; this one assigns none:\n{source}")
    return "\n".join([*magic, "# Your code here: replace each ... with your answer.", *(f"{n} = ..." for n in names)])


def make_handout(src: Path, out: Path) -> list[Path]:
    """Write every notebook of ``src`` to ``out`` with solution cells blanked; return the files written."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(src.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            tags = cell.get("metadata", {}).get("tags", [])
            if SOLUTION_TAG in tags:
                cell.source = blank_source(cell.source)
                cell.metadata["tags"] = [t for t in tags if t != SOLUTION_TAG] + ["exercise"]
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, out / path.name)
        written.append(out / path.name)
    return written


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    src = Path(args[0] if args else "notebooks")
    out = Path(args[1] if len(args) > 1 else "build/handout")
    written = make_handout(src, out)
    print(f"wrote {len(written)} learner notebooks without solutions to {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
