"""shardlab: the helpers of the PhysicsNeMo distributed notebook series.

Layers, each importing only the ones before it: launch -> cluster -> report.
Notebooks import it once as ``import shardlab as sl``.
"""

from .cluster import ClusterError, MPICluster, leftover_processes, start_cluster
from .launch import DistributedState, LaunchError, LaunchInfo, detect_launch, init_distributed
from .report import Table, summarize_rank_errors

__all__ = [
    "ClusterError", "DistributedState", "LaunchError", "LaunchInfo", "MPICluster", "Table",
    "detect_launch", "init_distributed", "leftover_processes", "start_cluster", "summarize_rank_errors",
]
