"""shardlab: the helpers of the PhysicsNeMo distributed notebook series.

Layers, each importing only the ones before it:
launch -> cluster -> mesh / data -> measure -> report / plot, with smoke (the CLI) on top.
Notebooks import it once as ``import shardlab as sl``.
"""

from . import check, cluster, data, launch, mesh, models, plot, report, train, workarounds
from .cluster import ClusterError, MPICluster, leftover_processes, start_cluster
from .launch import DistributedState, LaunchError, LaunchInfo, detect_launch, init_distributed
from .mesh import MeshError, build_mesh, resolve_mesh_shape
from .report import Table, summarize_rank_errors

_COMMANDS = ("bench", "handout", "measure", "smoke")  # also `python -m` entry points: imported on first use, so runpy finds them fresh


def __getattr__(name):
    if name in _COMMANDS:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardlab' has no attribute {name!r}")


__all__ = [
    "ClusterError", "DistributedState", "LaunchError", "LaunchInfo", "MPICluster", "MeshError", "Table",
    "build_mesh", "check", "cluster", "data", "detect_launch", "handout", "init_distributed", "launch",
    "leftover_processes", "measure", "mesh", "models", "plot", "report", "resolve_mesh_shape", "smoke",
    "start_cluster", "summarize_rank_errors", "train", "workarounds",
]
