"""shardlab: the helpers of the PhysicsNeMo distributed notebook series, imported as ``sl``.

Five groups, by who uses them (``ls helpers/shardlab`` shows them):

- the lessons' API, at the top: ``mesh``, ``data/``, ``models``, ``levers``, ``train``, ``points``, ``checkpoints``,
  ``plan/``, ``parity``, ``port/``, ``plot/``, ``report``, ``model_cases``; ``workarounds`` (upstream bugs, each in
  one place) and ``quiet`` (upstream messages known to be harmless, silenced at import, below);
- ``exercises/``: how an answer is judged (``sl.exercises.on_ranks``) and one module of judges per notebook;
- ``measure/``: the observers: bytes held and moved, time, collectives, the audit, flight records;
- ``ranks/``: the machinery behind ``%%px`` and jobs of ranks;
- ``tools/``: the command-line tools, ``python -m shardlab.tools.<name>``.

``LAYERS`` below lists every module, lowest first: a module imports only from layers below its own
(``tests/unit/test_layers.py`` checks every import, those inside functions too). Each module's first docstring line
says what it holds. Submodules load on first use: a rank that only needs ``shardlab.ranks.launch`` does not import
matplotlib, and a notebook kernel does not import PhysicsNeMo until it asks for something that needs it.
"""

import importlib

LAYERS = (
    ("ranks.slurm", "ranks.forkstub"),
    ("ranks.devices", "ranks.folders", "tools.gpu_record", "measure.allocations", "workarounds", "quiet",
     "exercises.progress", "exercises.answers", "ranks.forkchild"),
    ("report", "measure.flight", "ranks.owned", "ranks.commands", "ranks.px"),
    ("ranks.subprocesses", "ranks.records", "ranks.settings"),
    ("ranks.forkserver",),
    ("ranks.launch", "ranks.engine_launchers", "mesh", "ranks.beacon", "ranks.warden"),
    ("data", "models", "levers", "ranks.warm", "ranks.rankstate", "ranks.panel"),
    ("train", "points", "ranks.bringup"),
    ("measure", "plot", "checkpoints"),
    ("ranks.cluster", "exercises.judging", "plan", "measure.audit"),
    ("exercises", "parity"),
    ("tools.smoke", "tools.bench", "tools.handout", "tools.class_view", "model_cases"),
    ("tools.time_model", "tools.instructor_notes", "tools.gpu_lessons", "port"),
    ("tools.agenda", "tools.gpucheck", "tools.models"),
    ("tools.morning",),
)
_MODULES = {name.split(".")[0] for layer in LAYERS for name in layer}
_SHORTCUTS = {
    "ClusterError": "ranks.px", "RankCluster": "ranks.cluster", "start_cluster": "ranks.cluster",
    "DistributedState": "ranks.launch", "LaunchError": "ranks.launch", "LaunchInfo": "ranks.launch",
    "detect_launch": "ranks.launch", "init_distributed": "ranks.launch",
    "MeshError": "mesh", "build_mesh": "mesh", "resolve_mesh_shape": "mesh",
    "Table": "report", "summarize_rank_errors": "ranks.px",
    "leftover_processes": "ranks.owned", "place_ranks": "ranks.devices", "gpu_status": "tools.gpu_record",
}


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _SHORTCUTS:
        return getattr(importlib.import_module(f".{_SHORTCUTS[name]}", __name__), name)
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def load_on_first_use(package: str):
    """``__getattr__`` and ``__dir__`` for a subpackage (``ranks``, ``tools``): its modules, as ``LAYERS`` names them,
    load on first use."""
    prefix = package.rpartition(".")[2] + "."
    modules = [name.removeprefix(prefix) for layer in LAYERS for name in layer if name.startswith(prefix)]

    def __getattr__(name):
        if name in modules:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted([*vars(importlib.import_module(package)), *modules])

    return __getattr__, __dir__


# Every process that imports shardlab (a notebook's kernel, each rank, the tools) holds back the upstream messages that
# the series knows are harmless (shardlab/quiet.py says which, and why).
importlib.import_module(".quiet", __name__).install()
