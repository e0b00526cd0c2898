"""Repository rules: clean notebooks, one source of versions, CI runs the README's test command."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("tests/fixtures/*.ipynb")])


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#")[0].strip().lstrip("- ").strip()
        if m := re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s]+)", line):
            found[m.group(1).lower()] = m.group(2)
    return found


def test_there_are_notebooks():
    assert len(list(ROOT.glob("notebooks/*.ipynb"))) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_the_series_kernel(path):
    assert nbformat.read(path, as_version=4).metadata.kernelspec.name == "shardlab"


def test_environment_yml_mirrors_requirements():
    requirements = pins((ROOT / "requirements.txt").read_text().splitlines())
    conda = (ROOT / "environment.yml").read_text()
    pip_section = conda.split("- pip:", 1)[1].splitlines()
    assert requirements and pins(pip_section) == requirements


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci/run").read_text()
    assert "make test" in readme and "make lab" in readme
    assert re.search(r"^make test$", ci, re.M)


@pytest.mark.parametrize("path", sorted(ROOT.glob("notebooks/*.ipynb")), ids=lambda p: p.name)
def test_notebook_tells_a_wrong_kernel_what_to_pick(path):
    first = next(c.source for c in nbformat.read(path, as_version=4).cells if "import shardlab" in c.source)
    assert first.startswith("try:\n    import shardlab as sl\nexcept ModuleNotFoundError:")
