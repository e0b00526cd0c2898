"""Device-agnostic code: no hard-coded CPU in notebooks and helpers, no hard-coded world size in notebooks 00-07.

The same notebooks must run on CPU ranks and on GPUs. Code that is CPU-only on purpose (a lesson about a
CPU-only bug, host memory for a checkpoint) says so with a ``# CPU-only`` comment on the line.
"""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
HELPERS = sorted((ROOT / "helpers" / "shardlab").rglob("*.py"))  # subpackages (plan, measure, plot...) too

HARD_CODED_CPU = re.compile(
    r"""init_device_mesh\(\s*["']cpu["']|device\s*=\s*["']cpu["']|\.to\(\s*["']cpu["']\s*\)"""
    r"""|torch\.device\(\s*["']cpu["']|device_type\s*=\s*["']cpu["']""")
FIXED_WORLD_SIZE = re.compile(r"start_cluster\(\s*(n\s*=\s*)?\d")
NUMPY_FROM_DEVICE = re.compile(r"\.numpy\(\)")


def problems(source: str, notebook_rules: bool) -> list[str]:
    """What a piece of code hard-codes, one line each."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        if "# CPU-only" in line:
            continue
        if HARD_CODED_CPU.search(line):
            found.append(f"line {number}: hard-coded CPU device (use the rank's device): {line.strip()}")
        if notebook_rules and FIXED_WORLD_SIZE.search(line):
            found.append(f"line {number}: fixed number of ranks (use sl.start_cluster()): {line.strip()}")
        if notebook_rules and NUMPY_FROM_DEVICE.search(line) and ".cpu().numpy()" not in line:
            found.append(f"line {number}: .numpy() on a tensor that may live on a GPU (write .cpu().numpy()): "
                         f"{line.strip()}")
    return found


def test_the_guard_catches_what_it_is_for():
    planted = 'mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "domain"))'
    assert problems(planted, notebook_rules=False)
    assert problems("x = torch.zeros(3, device='cpu')", notebook_rules=False)
    assert problems("model.to('cpu')", notebook_rules=False)
    assert problems("cluster = sl.start_cluster(n=4)", notebook_rules=True)
    assert problems("cluster = sl.start_cluster(4)", notebook_rules=True)
    assert problems("field = x[0, 0].numpy()", notebook_rules=True)
    assert not problems("field = x[0, 0].cpu().numpy()", notebook_rules=True)
    assert not problems("cluster = sl.start_cluster()", notebook_rules=True)
    assert not problems('mesh = init_device_mesh("cpu", (2,))  # CPU-only: the bug this lesson shows', False)
    assert not problems("mesh = init_device_mesh(device.type, (2, 2))", notebook_rules=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_code_uses_the_ranks_device_and_world_size(path):
    fixed_size_allowed = path.stem[:2] == "08"  # the troubleshooting notebook needs exactly 2 ranks for a lesson
    found = []
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            rules = not fixed_size_allowed
            found += [f"cell {index} {p}" for p in problems(cell.source, notebook_rules=rules)]
            if fixed_size_allowed:  # the .numpy() rule still holds there
                found += [f"cell {index} {p}" for p in problems(cell.source, True) if ".numpy()" in p]
    assert not found, f"{path.name}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", HELPERS, ids=lambda p: str(p.relative_to(ROOT / "helpers" / "shardlab")))
def test_helpers_use_the_ranks_device(path):
    found = problems(path.read_text(), notebook_rules=False)
    assert not found, f"{path.name}:\n" + "\n".join(found)
