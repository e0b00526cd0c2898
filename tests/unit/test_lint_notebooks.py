"""`make lint` lints %%px cells too: ruff alone skips a cell that starts with a cell magic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "lint_notebooks.py"

pytestmark = pytest.mark.unit


def notebook_with(tmp_path: Path, *cells: str) -> Path:
    path = tmp_path / "planted.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "execution_count": None, "id": f"{i:08x}",
                                           "metadata": {}, "outputs": [], "source": source.splitlines(keepends=True)}
                                          for i, source in enumerate(cells)],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def lint(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--output-format=concise", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_px_cell_is_linted_where_ruff_alone_skips_it(tmp_path):
    planted = notebook_with(tmp_path, "import os\n", "%%px\nimport sys\nprint(undefined_here)\n")
    alone = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format=concise", str(planted)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "undefined_here" not in alone.stdout  # the gap the script closes
    done = lint(planted)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{planted}:cell 2:3:7: F821 Undefined name `undefined_here`" in done.stdout, done.stdout
    assert f"{planted}:cell 2:2:8: F401" in done.stdout, done.stdout  # cell lines counted as in the notebook


def test_an_import_repeated_on_the_ranks_is_not_a_redefinition(tmp_path):
    """The kernel and the ranks are two namespaces."""
    done = lint(notebook_with(tmp_path, "import torch\n\nprint(torch)\n", "%%px\nimport torch\n\nprint(torch)\n"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_series_notebooks_are_lint_clean():
    done = lint(ROOT / "notebooks", ROOT / "tests" / "fixtures")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
