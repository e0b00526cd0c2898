"""Repository rules: clean notebooks, one source of versions, CI runs the README's test command, and every link,
command and path that README.md and docs/ quote exists."""

import importlib.util
import os
import re
import subprocess
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
    """A kernel without shardlab stops at this line, and the traceback shows it, comment included."""
    first = next(c.source for c in nbformat.read(path, as_version=4).cells if "import shardlab" in c.source)
    line = first.splitlines()[0]
    assert line.startswith("import shardlab as sl  # noqa: I001 - not found? Kernel > Change Kernel > "), line
    kernel = re.search(r"^KERNEL_NAME := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f'"{kernel}"' in line  # the display name make lab installs the kernel under


# -- README.md and docs/: every link, command and path they quote exists ------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
REPO_PATH = re.compile(r"(?:helpers|tests|scripts|notebooks|data|container|docs|lab-config|\.ci)/[\w./*-]*|"
                       r"Makefile|requirements\.(?:in|txt)|environment\.yml|ruff\.toml|pytest\.ini|conftest\.py|[A-Z]+\.md")
MAKE_OPTIONS_WITH_VALUE = {"-C", "-f"}


def without_code_blocks(text: str) -> str:
    return FENCE.sub("", text)


def code_pieces(text: str) -> list[str]:
    """Every command-like piece of a page: each line of its code blocks and each inline code span."""
    blocks = [line.split(" #")[0] for block in FENCE.findall(text) for line in block.splitlines()]
    return blocks + re.findall(r"`([^`\n]+)`", without_code_blocks(text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found, repeats = set(), {}
    for heading in re.findall(r"^#+ (.+)$", without_code_blocks(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        repeats[slug] = repeats.get(slug, -1) + 1
        found.add(f"{slug}-{repeats[slug]}" if repeats[slug] else slug)
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):(?!=)", (ROOT / "Makefile").read_text(), re.M))


def module_sources(module: str) -> list[Path]:
    """The source of ``python -m module``: its file, or the files of its package when it has a ``__main__``."""
    path = ROOT / "helpers" / Path(*module.split("."))
    if path.with_suffix(".py").is_file():
        return [path.with_suffix(".py")]
    return sorted(path.glob("*.py")) if (path / "__main__.py").is_file() else []


def has_option(sources: list[Path], option: str) -> bool:
    text = "".join(p.read_text() for p in sources)
    stem, _, last = option.rpartition("-")  # --check-grad: made as f"--check-{name}" from the name "grad"
    return f'"{option}"' in text or (f'"{stem}-{{' in text and f'"{last}"' in text)


@pytest.mark.parametrize("page", [*DOCS, ROOT / "INSTRUCTORS.md"], ids=lambda p: p.name)
def test_every_link_resolves_to_a_file_and_heading_that_exist(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code_blocks(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name} links to {target}: there is no {file}"
        if anchor:
            assert anchor in anchors(linked), f"{page.name} links to {target}: {linked.name} has no such heading"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_quoted_make_command_names_targets_and_variables_the_makefile_has(page):
    targets, makefile = make_targets(), (ROOT / "Makefile").read_text()
    for piece in code_pieces(page.read_text()):
        for command in re.split(r"&&|;|\|", piece):
            words = command.split()
            if "make" not in words:
                continue
            args = iter(words[words.index("make") + 1:])
            for word in args:
                if word in MAKE_OPTIONS_WITH_VALUE:
                    next(args, None)
                elif "=" in word:
                    variable = word.split("=")[0]
                    assert re.search(rf"\b{variable}\b", makefile), f"{page.name}: `{command}`: no variable {variable}"
                elif not word.startswith("-"):
                    assert word in targets, f"{page.name}: `{command.strip()}`: the Makefile has no target {word}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_quoted_python_command_runs_a_module_or_script_that_exists_with_its_options(page):
    for piece in code_pieces(page.read_text()):
        for found in re.finditer(r"(?:-m (shardlab(?:\.\w+)+)|python3? (scripts/[\w.-]+))([^|;&]*)", piece):
            module, script, rest = found.groups()
            sources = module_sources(module) if module else [ROOT / script] if (ROOT / script).is_file() else []
            assert sources, f"{page.name}: `{found.group(0).strip()}`: no such module or script"
            for option in re.findall(r"(?<!\S)(--[\w-]+)", rest):
                assert has_option(sources, option), f"{page.name}: `{found.group(0).strip()}`: no option {option}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_quoted_repository_path_exists(page):
    for piece in re.findall(r"`([^`\n]+)`", without_code_blocks(page.read_text())):
        if REPO_PATH.fullmatch(piece):
            assert list(ROOT.glob(piece.rstrip("/"))), f"{page.name} names {piece}, which is not in the repository"


def test_the_operations_page_lists_every_make_target():
    listed = set(re.findall(r"`(?:sudo )?make (?:-s )?([a-z][\w-]*)", (ROOT / "docs/operations.md").read_text()))
    phony = re.search(r"^\.PHONY:(.*?)\n\n", (ROOT / "Makefile").read_text(), re.M | re.S).group(1)
    missing = set(phony.replace("\\", " ").split()) - listed
    assert not missing, f"docs/operations.md does not list make {sorted(missing)}"


def test_the_readme_stays_short_and_sends_the_reference_to_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    unlisted = {f"docs/{p.name}" for p in DOCS[1:]} - set(re.findall(r"\]\((docs/[\w.-]+)\)", readme))
    assert not unlisted, f"README.md's table of pages leaves out {sorted(unlisted)}"


# -- docs/timings.md: written by `make timings` from the runs' JUnit XML, never by hand --------------------------


def timings_script():
    spec = importlib.util.spec_from_file_location("timings", ROOT / "scripts" / "timings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timings_page_is_what_make_timings_writes():
    assert timings_script().main(["--check", str(ROOT / "docs" / "timings.md")]) == 0


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
skipped="1" tests="4" time="{wall}" timestamp="2026-12-10T14:03:11.5">
<testcase classname="tests.notebooks.test_notebooks"
name="test_notebook_runs_and_its_checks_reject_wrong_answers[07_capstone]" time="86.25"/><testcase
classname="tests.unit.test_repo" name="test_lock_pins_every_package_with_hashes" time="0.5"><failure message="no"/>
</testcase><testcase classname="tests.system.test_slurm" name="test_srun_smoke" time="0.01">
<skipped message="no slurm"/></testcase><testcase classname="tests.gpu.test_gpu_path" name="test_a_tie" time="0.02"/>
</testsuite></testsuites>"""  # the last file ties the one before it: their order must survive the page's record


def test_make_timings_rewrites_the_page_from_the_last_runs_and_keeps_older_ones(tmp_path, monkeypatch):
    timings = timings_script()
    full, fast, page = tmp_path / "make-test.xml", tmp_path / "make-test-fast.xml", tmp_path / "timings.md"
    monkeypatch.setattr(timings, "JUNIT", {"make test": full, "make test-fast": fast})
    monkeypatch.setattr(timings, "VENV", tmp_path / "no-venv")
    full.write_text(JUNIT.format(wall=1234.4))
    assert timings.main([str(page)]) == 0
    text = page.read_text()
    assert "2026-12-10 14:03" in text and "4 tests in 20.6 min of wall time (2 passed, 1 skipped, 1 failed)" in text
    assert "| `07_capstone` | 86.2 |" in text and "| `tests/notebooks/test_notebooks.py` | 1 | 86.2 |" in text
    assert "No run recorded yet: run `make test-fast`" in text
    assert timings.main(["--check", str(page)]) == 0
    page.write_text(text.replace("86.2 |", "60.0 |"))
    assert timings.main(["--check", str(page)]) == 1, "a hand edit went unnoticed"

    full.unlink()
    fast.write_text(JUNIT.format(wall=82.0))
    assert timings.main([str(page)]) == 0
    text = page.read_text()
    assert "in 20.6 min of wall time" in text and "4 tests in 82 s of wall time" in text


def test_make_env_says_what_the_timings_page_measured_before_it_installs(tmp_path):
    size = re.search(r"^- `\.venv` on disk: (.+)$", (ROOT / "docs" / "timings.md").read_text(), re.M)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    out = subprocess.run(["make", "-n", "--no-print-directory", "env", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60).stdout
    said = re.search(r"make: installing the series into \S+?(: [^(]*)?\(docs/timings\.md\)", out)
    assert said, out
    assert (size is None) == (said.group(1) is None) and (size is None or f": {size.group(1)} on disk" in said.group(1))
