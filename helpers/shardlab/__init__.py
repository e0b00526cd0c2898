"""shardlab: the helpers of the PhysicsNeMo distributed notebook series, imported as ``sl``.

Layers, lowest first. A module imports only from layers below its own; ``tests/test_layers.py``
checks every import, including those inside functions, against this list.

0. ``devices``: the one rule for which device a job of ranks runs on; cores and GPUs the ranks have
1. ``workarounds`` (upstream bugs), ``report`` (tables), ``procs`` (which processes shardlab started),
   ``launcher_programs`` (where mpiexec and srun are, their flags, job command lines), ``px`` (``%%px`` cells:
   deadline, per-rank error summary)
2. ``launch``: launcher variables, ``run_job`` (a job of ranks), ``init_distributed`` on every rank;
   ``engines``: one engine launcher per way of starting the engines behind ``%%px``
3. ``mesh`` (the (ddp, domain) mesh, shard bounds, halo plans), ``data``, ``models``, ``levers`` (a training
   step's memory levers); ``warm`` (ranks kept for the next notebook, and the reset that makes them fresh)
4. ``train``: wrappers, the Trainer, checkpoints; ``bringup``: a cluster's ranks brought up, fresh or taken over
5. ``measure`` (bytes and collectives, measured live; also a command-line tool), ``plot`` (figures)
6. ``cluster`` (the ipyparallel cluster behind ``%%px``), ``check`` (exercise checks), ``plan`` (the memory
   planner; also a command-line tool)
7. ``exercises``: the answer key, one module of judges per notebook
8. command-line tools: ``smoke``, ``bench``, ``handout``, ``agenda`` (a workshop's agenda from INSTRUCTORS.md's times)
9. ``gpucheck``: runs the tools above on a GPU node
10. ``morning``: the machine check for the morning of a workshop (environment, two notebooks, GPU quick rows)

Submodules load on first use: a rank that only needs ``shardlab.launch`` does not import
matplotlib, and a notebook kernel does not import PhysicsNeMo until it asks for something that
needs it.
"""

import importlib

LAYERS = (
    ("devices", "gpu_record"),
    ("workarounds", "report", "procs", "launcher_programs", "px"),
    ("launch", "engines"),
    ("mesh", "data", "models", "levers", "warm"),
    ("train", "bringup"),
    ("measure", "plot"),
    ("cluster", "check", "plan"),
    ("exercises",),
    ("smoke", "bench", "handout", "agenda"),
    ("gpucheck",),
    ("morning",),
)
_MODULES = {name for layer in LAYERS for name in layer}
_SHORTCUTS = {
    "ClusterError": "px", "MPICluster": "cluster", "start_cluster": "cluster",
    "DistributedState": "launch", "LaunchError": "launch", "LaunchInfo": "launch", "detect_launch": "launch",
    "init_distributed": "launch",
    "MeshError": "mesh", "build_mesh": "mesh", "resolve_mesh_shape": "mesh",
    "Table": "report", "summarize_rank_errors": "px",
    "leftover_processes": "procs", "place_ranks": "devices", "gpu_status": "gpu_record",
}


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _SHORTCUTS:
        return getattr(importlib.import_module(f".{_SHORTCUTS[name]}", __name__), name)
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_MODULES, *_SHORTCUTS])


__all__ = sorted([*_MODULES, *_SHORTCUTS])
