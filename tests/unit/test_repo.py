"""Repository rules: clean notebooks, one source of versions, CI runs the README's test command."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("tests/fixtures/*.ipynb")])


def pins(lines) -> dict[str, str]:
    found = {}
    for line in lines:
        line = line.split("#")[0].strip().lstrip("- ").strip()
        if m := re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s]+)", line):
            found[m.group(1).lower()] = m.group(2)
    return found


def test_the_readme_lists_exactly_the_notebooks_there_are():
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", (ROOT / "README.md").read_text(), re.M)
    present = sorted(p.stem for p in ROOT.glob("notebooks/*.ipynb"))
    assert listed == present, f"README's series table lists {listed}, notebooks/ has {present}"


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


def normalized(found: dict[str, str]) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", name): version for name, version in found.items()}


def test_environment_yml_installs_the_lock():
    pip_section = (ROOT / "environment.yml").read_text().split("- pip:", 1)[1].splitlines()
    assert [line.strip() for line in pip_section if line.strip().startswith("-")] == ["- -r requirements.txt"]


def test_lock_has_every_direct_pin_at_the_same_version():
    direct = normalized(pins((ROOT / "requirements.in").read_text().splitlines()))
    lock = normalized(pins(line.removesuffix("\\") for line in (ROOT / "requirements.txt").read_text().splitlines()))
    assert direct and "ruff" in direct
    assert {name: lock.get(name) for name in direct} == direct, "requirements.txt is stale: run `make lock`"


def test_lock_pins_every_package_with_hashes():
    text = (ROOT / "requirements.txt").read_text()
    entries = [e for e in re.split(r"\n(?=[A-Za-z0-9])", text) if re.match(r"[A-Za-z0-9]", e)]
    assert len(entries) > 100 and "make lock" in text
    for entry in entries:
        assert re.match(r"[A-Za-z0-9_.\-]+==\S+ \\\n", entry) and "--hash=sha256:" in entry, entry.splitlines()[0]


def test_ci_runs_the_readme_test_command_on_a_machine_it_may_set_up():
    """CI runs lint, then exactly `make test`, with the opt-in that lets the run install Slurm, MPICH and Chromium
    (without it those tests would skip on a fresh CI machine)."""
    readme = (ROOT / "README.md").read_text()
    two_commands = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "make test " in two_commands and "make lab " in two_commands and "make test-system" in two_commands
    ci = (ROOT / ".ci/run").read_text()
    commands = [line for line in ci.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[-3:] == ["export SHARDLAB_SYSTEM_SETUP=1", "make lint", "make test"]


@pytest.mark.parametrize("path", sorted(ROOT.glob("notebooks/*.ipynb")), ids=lambda p: p.name)
def test_notebook_tells_a_wrong_kernel_what_to_pick(path):
    first = next(c.source for c in nbformat.read(path, as_version=4).cells if "import shardlab" in c.source)
    assert first.startswith("try:\n    import shardlab as sl\nexcept ModuleNotFoundError:")
