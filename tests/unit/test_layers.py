"""The helpers' import graph follows the documented layers: no cycle, no upward import.

Run on its own with ``python -m pytest tests/unit/test_layers.py``. Every ``import`` in every module
counts, including those inside functions, so a cycle cannot hide in a function body.
"""

import ast
from pathlib import Path

import pytest

import shardlab

PACKAGE = Path(shardlab.__file__).parent
LAYER_OF = {name: i for i, layer in enumerate(shardlab.LAYERS) for name in layer}


def unit_of(dotted: str) -> str | None:
    """The LAYERS entry a dotted module path under shardlab belongs to (a subpackage counts as one unit)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in LAYER_OF:
            return ".".join(parts[:i])
    return None


def shardlab_imports(path: Path, package: tuple[str, ...] = ()) -> set[str]:
    """The shardlab units a file imports, wherever the import statement sits; ``package``: where the file sits
    under shardlab (``("ranks",)`` for ``ranks/cluster.py``), to resolve relative imports."""
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .mesh import x; from ..ranks import owned; from . import report
                base = list(package[: len(package) - (node.level - 1)])
                module = base + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "shardlab" or node.module.startswith("shardlab.")):
                module = node.module.split(".")[1:]
            else:
                continue
            # each name is a unit of its own (from ..measure import flight) or counts as its module's
            targets += [".".join([*module, alias.name]) for alias in node.names]
        elif isinstance(node, ast.Import):
            targets += [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("shardlab.")]
    return {unit for target in targets if (unit := unit_of(target))}


def unit_files(unit: str) -> list[tuple[Path, tuple[str, ...]]]:
    """The files of a unit, each with the package it sits in."""
    path = PACKAGE.joinpath(*unit.split("."))
    if path.is_dir():  # the package's files that no finer unit claims (measure.audit is not measure's)
        return [(p, tuple(unit.split("."))) for p in path.glob("*.py") if owner(p) == unit]
    return [(path.with_suffix(".py"), tuple(unit.split(".")[:-1]))]


def owner(path: Path) -> str | None:
    """The unit a file belongs to."""
    return unit_of(".".join(path.relative_to(PACKAGE).with_suffix("").parts))


def module_imports(unit: str) -> set[str]:
    """What a unit imports from outside itself."""
    return set().union(*(shardlab_imports(p, package) for p, package in unit_files(unit))) - {unit}


def test_every_module_is_in_a_layer():
    modules = {owner(p) or str(p.relative_to(PACKAGE))
               for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.stem != "__init__"}
    modules -= {"ranks/__init__.py", "tools/__init__.py"}  # their modules are the units
    assert modules == set(LAYER_OF), f"put {sorted(modules ^ set(LAYER_OF))} in shardlab.LAYERS"


def test_the_package_is_grouped_by_who_uses_it():
    """Lessons' modules at the top; judging in exercises/; observers in measure/; the machinery behind %%px in
    ranks/; command-line tools in tools/."""
    for unit in LAYER_OF:
        group = unit.split(".")[0] if "." in unit else "top"
        assert group in ("top", "exercises", "measure", "ranks", "tools"), unit
    for unit in (u for u in LAYER_OF if "." in u):  # each loads on first use, as sl.ranks.cluster
        group, name = unit.split(".")
        assert getattr(getattr(shardlab, group), name).__name__ == f"shardlab.{unit}"


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_only_lower_layers(module):
    upward = {other: LAYER_OF[other] for other in module_imports(module) if LAYER_OF[other] >= LAYER_OF[module]}
    assert not upward, (f"{module} (layer {LAYER_OF[module] + 1}) imports {upward} from its own or a higher layer: "
                        "move the shared piece down, or this module up")


def test_every_import_form_is_seen_even_inside_functions(tmp_path):
    source = tmp_path / "planted.py"
    source.write_text("from ..mesh import build_mesh\nfrom . import owned\nfrom .. import report\n"
                      "import shardlab.plot\n"
                      "from shardlab.ranks.cluster import RankCluster\nfrom shardlab.exercises import judging\n"
                      "from ..tools import smoke\n"
                      "def later():\n    from ..train import train\n    import shardlab.tools.bench as bench\n")
    assert shardlab_imports(source, package=("ranks",)) == {
        "mesh", "ranks.owned", "report", "plot", "ranks.cluster", "exercises.judging", "tools.smoke", "train",
        "tools.bench"}


def test_no_module_is_over_400_lines():
    """One job per unit (issue 19): a module that grows past 400 lines has grown a second job; split it."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > 400}, sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
