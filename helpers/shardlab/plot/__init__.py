"""Figures of meshes, shards, halos and memory, drawn from plain lists and arrays pulled back from the ranks:
``layout`` (the mesh, shards and halo rows), ``memory`` (bytes per rank and category, predicted against measured;
notebooks 05 and 12's memory figures), ``training`` (the capstone's dashboard, point clouds), ``ranks`` (every rank's
steps side by side: timeline, time by rank, scaling, memory across a step), on what ``_base`` shares (colours, units,
figures kept out of pyplot).

Introduced in ``notebooks/02_device_mesh.ipynb``.
"""

from ._base import rank_colour
from .layout import halo_rows, rank_grid, shard_map, tile_map
from .memory import loading_bars, memory_bars, predicted_vs_measured, ratio_curve, wrapper_memory
from .ranks import memory_over_step, scaling, time_by_rank, timeline
from .training import points_by_rank, points_of_ranks, training_curves, training_dashboard

__all__ = ["rank_colour", "rank_grid", "shard_map", "halo_rows", "tile_map", "memory_bars", "predicted_vs_measured",
           "ratio_curve", "wrapper_memory", "loading_bars", "training_dashboard", "training_curves",
           "points_by_rank", "points_of_ranks", "timeline", "time_by_rank", "scaling", "memory_over_step"]
