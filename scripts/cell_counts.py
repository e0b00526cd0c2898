"""How much code the lessons' cells carry: ``python scripts/cell_counts.py [NOTEBOOK ...]`` (default: every notebook).

Per notebook and in total: code cells, lines of code in them (lines that are neither blank nor only a comment), the
cells that pull results from the ranks (``.pull(`` or ``.gather``) and the assert lines. Issue 45 counts these before
and after moving plot labels, aggregation and bookkeeping out of the lessons' cells into ``sl.plot`` and ``sl.report``.
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("code cells", "lines of code", "cells pulling from ranks", "assert lines")


def counts(path: Path) -> tuple[int, int, int, int]:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]
    lines = [line.strip() for source in sources for line in source.splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    pulls = sum(".pull(" in source or ".gather" in source for source in sources)
    return len(cells), len(code), pulls, sum(line.startswith("assert ") for line in code)


def main(args: list[str]) -> int:
    paths = [Path(a) for a in args] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    rows = [(p.stem, *counts(p)) for p in paths]
    rows.append(("total", *(sum(column) for column in list(zip(*rows))[1:])))
    width = max(len(r[0]) for r in rows)
    print(f"| {'notebook':<{width}} | " + " | ".join(COLUMNS) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (len(c) + 1) + ":" for c in COLUMNS) + "|")
    for name, *values in rows:
        print(f"| {name:<{width}} | " + " | ".join(f"{v:>{len(c)}}" for v, c in zip(values, COLUMNS)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
