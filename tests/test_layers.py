"""The helpers' import graph follows the documented layers: no cycle, no upward import.

Run on its own with ``python -m pytest tests/test_layers.py``. Every ``import`` in every module
counts, including those inside functions, so a cycle cannot hide in a function body.
"""

import ast
from pathlib import Path

import pytest

import shardlab

PACKAGE = Path(shardlab.__file__).parent
LAYER_OF = {name: i for i, layer in enumerate(shardlab.LAYERS) for name in layer}


def shardlab_imports(path: Path, depth: int = 1) -> set[str]:
    """The shardlab modules a file imports, wherever the import statement sits (``depth`` 2: a subpackage's file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == depth and node.module:  # from .mesh import x (from ..mesh in a subpackage)
                found.add(node.module.split(".")[0])
            elif node.level == depth:  # from . import mesh, procs
                found |= {alias.name for alias in node.names}
            elif node.module and node.module.startswith("shardlab."):
                found.add(node.module.split(".")[1])
            elif node.module == "shardlab":
                found |= {alias.name for alias in node.names if alias.name in LAYER_OF}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("shardlab.")}
    return found


def module_imports(module: str) -> set[str]:
    """What a module imports; for a subpackage, what any of its files imports from outside it."""
    if (PACKAGE / module).is_dir():
        return set().union(*(shardlab_imports(p, depth=2) for p in (PACKAGE / module).glob("*.py")))
    return shardlab_imports(PACKAGE / f"{module}.py")


def test_every_module_is_in_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert modules == set(LAYER_OF), f"put {sorted(modules ^ set(LAYER_OF))} in shardlab.LAYERS"


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_only_lower_layers(module):
    upward = {other: LAYER_OF[other] for other in module_imports(module) if LAYER_OF[other] >= LAYER_OF[module]}
    assert not upward, (f"{module} (layer {LAYER_OF[module] + 1}) imports {upward} from its own or a higher layer: "
                        "move the shared piece down, or this module up")


def test_every_import_form_is_seen_even_inside_functions(tmp_path):
    source = tmp_path / "planted.py"
    source.write_text("from .mesh import build_mesh\nfrom . import procs, report\nimport shardlab.plot\n"
                      "from shardlab.cluster import MPICluster\nfrom shardlab import check\n"
                      "def later():\n    from .train import train\n    import shardlab.smoke as smoke\n")
    assert shardlab_imports(source) == {"mesh", "procs", "report", "plot", "cluster", "check", "train", "smoke"}


def test_no_module_is_over_400_lines():
    """One job per unit (issue 19): a module that grows past 400 lines has grown a second job; split it."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > 400}, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
