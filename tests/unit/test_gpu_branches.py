"""Every place where the series behaves differently on CUDA or NCCL is in docs/gpu-check.md's branch table, and every
row of it names a test that simulates the branch or a gpu-check row that proves it on a node (issue 44, item 2).

The package is read for the tests that say which device or backend code runs on (``torch.cuda.is_available()``,
``device.type == "cuda"``, ``backend == "nccl"``, NCCL's own recorder, GPU kernels in a trace ...); each function
holding one is a place the table must list. A new branch fails here until its row is written."""

import ast
import re
from pathlib import Path

import pytest

from shardlab.tools import gpucheck

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "helpers" / "shardlab"
PAGE = ROOT / "docs" / "gpu-check.md"
HEADING = "## Every CUDA and NCCL branch"
BRANCH = re.compile(
    r'cuda\.is_available\(\)'  # torch's own answer
    r'|[!=]=\s*"(cuda|nccl)"|"(cuda|nccl)"\s*[!=]='  # a device, device type or backend compared
    r'|\.type\s*[!=]=\s*"cpu"|\bdevice\s*[!=]=\s*"cpu"|startswith\("(cuda|cpu)"\)'
    r'|"nccl" if|is_nccl_available|_dump_nccl_trace_json'  # a backend chosen; NCCL's own recorder
    r'|in GPU_KERNELS')  # a trace's GPU kernels read apart from the host's events


def branches(source: str) -> set[str]:
    """The functions (``Class.method`` or ``function``; ``<module>`` for top-level code) of a module's source that
    hold a branch on the device or the backend, comments and docstrings left out."""
    tree = ast.parse(source)
    owner, docs = {}, set()

    def walk(node, name):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
                owner.update(dict.fromkeys(range(child.lineno, child.end_lineno + 1), inner))
                walk(child, inner)
            else:
                if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant) and isinstance(
                        child.value.value, str):
                    docs.update(range(child.lineno, child.end_lineno + 1))
                walk(child, name)

    walk(tree, "")
    return {owner.get(number, "<module>") for number, line in enumerate(source.splitlines(), 1)
            if number not in docs and BRANCH.search(line.split("#")[0])}


def found_in_package() -> set[str]:
    places = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("shardlab", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        places |= {f"{module}:{function}" for function in branches(path.read_text())}
    return places


def table() -> dict[str, dict]:
    """The branch table: place -> what differs, the tests (path::name) and the gpu-check rows it names."""
    text = PAGE.read_text()
    if HEADING not in text:
        return {}
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`shardlab"):
            continue
        places = re.findall(r"`(shardlab[\w.]*:[\w.<>]+)`", cells[0])
        for place in places:
            rows[place] = {"differs": cells[1], "tests": re.findall(r"`(tests/[\w/.]+::\w+)`", cells[2]),
                           "rows": re.findall(r"`([\w -]+)`", cells[3])}
    return rows


def test_the_scanner_finds_a_branch_in_code_and_not_in_comments_or_docstrings():
    planted = ('def f(device):\n    """On "cuda" when torch.cuda.is_available()."""\n    # if device.type == "cuda"\n'
               '    return 1\n\nclass A:\n    def g(self, x):\n        if x.device.type == "cuda":\n'
               '            return 2\n\nBACKEND = "nccl" if torch.cuda.is_available() else "gloo"\n')
    assert branches(planted) == {"A.g", "<module>"}


def test_every_cuda_or_nccl_branch_of_the_package_is_in_the_table():
    assert HEADING in PAGE.read_text(), f"docs/gpu-check.md has no section {HEADING!r}"
    missing = found_in_package() - set(table())
    assert not missing, (f"docs/gpu-check.md's branch table ({HEADING}) lacks {sorted(missing)}: add a row saying what "
                         "differs, the test that simulates it and the gpu-check row that proves it")


@pytest.mark.parametrize("place", sorted(table()))
def test_each_row_names_a_test_that_exists_or_a_gpucheck_row(place):
    row = table()[place]
    rows = {r["name"] for r in gpucheck.plan(8)}
    assert row["tests"] or row["rows"], f"{place}: neither simulated by a test nor proved by a gpu-check row"
    for test in row["tests"]:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file() and re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test
    for name in row["rows"]:
        assert name in rows, f"{place}: gpu-check has no row {name!r}"
    module, _, function = place.partition(":")
    assert (PACKAGE / Path(*module.split(".")[1:])).with_suffix(".py").exists() or (
        PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists(), place
