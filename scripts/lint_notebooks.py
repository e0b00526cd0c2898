"""Lint every code cell of the notebooks, ``%%px`` cells included:
``python scripts/lint_notebooks.py [PATH ...] [ruff options, e.g. --output-format concise]``.

ruff skips a cell that starts with a cell magic, and about half of this series' code runs on the ranks in ``%%px``
cells. So each notebook is copied into a temp folder with its ``%%px`` line turned into a comment (the cell keeps its
line numbers), ruff checks the copies with the repository's settings, and its report names the original notebooks.
Exit status: ruff's.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL_MAGIC = "%%px"


def unmagicked(notebook: dict) -> dict:
    """The notebook with each ``%%px`` first line commented out, so that ruff reads the cell as Python."""
    for cell in notebook["cells"]:
        source = cell["source"] if isinstance(cell["source"], list) else cell["source"].splitlines(keepends=True)
        if cell["cell_type"] == "code" and source and source[0].startswith(CELL_MAGIC):
            cell["source"] = ["# " + source[0], *source[1:]]
    return notebook


def main(args: list[str]) -> int:
    options = [a for a in args if a.startswith("-")]
    paths = [a for a in args if a not in options]
    if "--fix" in options:
        print("--fix would fix temporary copies: fix the cells the report names", file=sys.stderr)
        return 2
    notebooks = sorted({p for path in paths or ["notebooks", "tests/fixtures"]
                        for p in ([Path(path)] if path.endswith(".ipynb") else Path(path).rglob("*.ipynb"))})
    if not notebooks:
        print(f"no notebooks under {paths}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lint-notebooks-") as folder:
        copies = {}
        for notebook in notebooks:
            where = notebook.resolve()
            copy = Path(folder, where.relative_to(ROOT) if where.is_relative_to(ROOT) else where.name)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(json.dumps(unmagicked(json.loads(notebook.read_text()))))
            copies[str(copy.relative_to(folder))] = str(notebook)  # ruff names files relative to its cwd
        # The copies sit outside the repository: the settings are named explicitly. The kernel and the ranks are
        # two namespaces, so a %%px cell importing what a kernel cell imported redefines nothing (F811).
        done = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "ruff.toml"),
                               "--no-cache", "--ignore", "F811", *options, *copies],
                              capture_output=True, text=True, cwd=folder)
    names = re.compile("|".join(re.escape(copy) for copy in sorted(copies, key=len, reverse=True)) + r"(?=:)")
    report = names.sub(lambda match: copies[match.group(0)], done.stdout + done.stderr)
    print(report, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
