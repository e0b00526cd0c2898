"""shardlab: the helpers of the PhysicsNeMo distributed notebook series, imported as ``sl``.

Three groups, by who uses them:

- at the top, what the lessons call: ``mesh``, ``data``, ``points``, ``models``, ``levers``, ``train``, ``measure``,
  ``plot``, ``plan``, ``check`` and ``exercises`` (the answer key), with ``workarounds`` (upstream bugs),
  ``report`` (tables) and ``gpu_record`` (what a committed ``make gpu-check`` run measured: ``sl.gpu_status()``);
- ``ranks``: the machinery behind ``%%px`` and jobs of ranks (see ``shardlab/ranks/__init__.py``);
- ``tools``: the command-line tools, ``python -m shardlab.tools.<name>`` (see ``shardlab/tools/__init__.py``).

Layers, lowest first. A module imports only from layers below its own; ``tests/unit/test_layers.py`` checks every
import, including those inside functions, against this list.

- (below them all) ``ranks.slurm``: Slurm's node lists as host names (which ``workarounds`` reads), and jobs found by
  name and cancelled; ``ranks.forkstub``: what the launcher starts for a rank when a fork server runs (standard
  library only)
0. ``ranks.devices``: the one rule for which device a job of ranks runs on; cores and GPUs the ranks have;
   ``ranks.folders`` (the owner-only folders shardlab trusts: the registry of clusters, profile folders);
   ``gpu_record``: the committed GPU record, read; ``workarounds`` (upstream bugs, each in one place); ``quiet``
   (upstream messages the series knows are harmless, silenced where they start: installed at import, below);
   ``progress`` (each check's result, for the instructor's class view, where one is set up); ``answers`` (the
   exercises' reference answers, found by name); ``ranks.forkchild`` (what a forked child does to become a rank's
   engine)
1. ``report``, ``flight`` (the collectives each rank entered: torch's Flight Recorder), ``ranks.owned`` (which
   processes shardlab started, and stopping them), ``ranks.commands`` (the command lines that start ranks: mpiexec,
   srun, torchrun, their flags), ``ranks.px`` (``%%px`` cells: deadline, error summary)
1a. ``ranks.subprocesses`` (a command run as a process group with a deadline, or detached), ``ranks.records`` (each
   cluster's record: its owner, processes, Slurm jobs, and clean-up), ``ranks.settings`` (a cluster's settings,
   resolved once from the request and the environment)
1b. ``ranks.forkserver`` (engines and job ranks forked from one parent that imported PyTorch and PhysicsNeMo once)
2. ``ranks.launch`` (what a launcher tells a rank, ``init_distributed``, ``run_job``), ``ranks.engine_launchers``
   (one engine launcher per way of starting the engines behind ``%%px``); ``mesh`` (the named mesh, and how
   ``scatter_tensor`` splits rows, which ``data`` reads slabs by); ``ranks.beacon`` (each rank's state, written
   for the rank panel); ``ranks.warden`` (a cluster ends with the process that owns it)
3. ``data`` (the Darcy samples and their scaling, the sampler, field stores written and read, and the batch sources
   a ``Trainer`` loads from: ``shardlab/data/__init__.py``), ``models``, ``levers``; ``ranks.warm`` (the pool on
   the host: ranks parked for the next notebook, claimed, stopped); ``ranks.rankstate`` (on a rank: ``init_rank``,
   what every engine runs first, and the reset and parking of a warm rank); ``ranks.panel`` (every rank's
   state, live, in the notebook)
4. ``train``, ``points`` (point clouds for PhysicsNeMo's point models); ``ranks.bringup`` (a cluster's ranks brought
   up, fresh or taken over)
5. ``measure`` (also ``python -m shardlab.measure``), ``plot``, ``checkpoints`` (a training run's state written
   in parts and loaded into another layout)
6. ``ranks.cluster`` (the ipyparallel cluster behind ``%%px``), ``check``, ``plan`` (also ``python -m shardlab.plan``),
   ``audit`` (a model's communication module by module, and what ShardTensor could not shard)
7. ``exercises``: one module of judges per notebook; ``parity`` (any model on the ranks against one process)
8. ``tools.smoke``, ``tools.bench``, ``tools.handout``, ``tools.class_view`` (who is stuck); ``model_cases``
   (docs/models.md's models)
9. ``tools.time_model``: each lesson's minutes, from its notebook and its measured run time;
   ``tools.instructor_notes``: the generated parts of the instructors' notes (``instructors/``);
   ``tools.gpu_lessons``: gpu-check's rows for lessons 12-14; ``port`` (also ``python -m shardlab.port``: a model
   audited, checked for parity, planned, and written as a run of its own)
10. ``tools.agenda`` (the workshop's agendas, from the time model); ``tools.gpucheck``: runs the tools above on a
    GPU node; ``tools.models`` (``make models``: docs/models.md)
11. ``tools.morning``: the machine check for the morning of a workshop

Submodules load on first use: a rank that only needs ``shardlab.ranks.launch`` does not import matplotlib, and a
notebook kernel does not import PhysicsNeMo until it asks for something that needs it.
"""

import importlib

LAYERS = (
    ("ranks.slurm", "ranks.forkstub"),
    ("ranks.devices", "ranks.folders", "gpu_record", "workarounds", "quiet", "progress", "answers", "ranks.forkchild"),
    ("report", "flight", "ranks.owned", "ranks.commands", "ranks.px"),
    ("ranks.subprocesses", "ranks.records", "ranks.settings"),
    ("ranks.forkserver",),
    ("ranks.launch", "ranks.engine_launchers", "mesh", "ranks.beacon", "ranks.warden"),
    ("data", "models", "levers", "ranks.warm", "ranks.rankstate", "ranks.panel"),
    ("train", "points", "ranks.bringup"),
    ("measure", "plot", "checkpoints"),
    ("ranks.cluster", "check", "plan", "audit"),
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
    "leftover_processes": "ranks.owned", "place_ranks": "ranks.devices", "gpu_status": "gpu_record",
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
