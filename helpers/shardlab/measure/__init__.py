"""Measure: what the ranks did, observed live: bytes held and moved, time, collectives, what ShardTensor cannot shard.

- ``memory``: bytes a tensor, a model or a step holds; peaks; strict fp32 (lessons 01-13);
- ``collectives``: each collective a block of code runs (``sl.exercises.Watch`` and ``audit`` take theirs from it);
- ``audit``: a model's communication module by module, and the ops ShardTensor could not shard;
- ``flight``: the collectives each rank entered (torch's Flight Recorder);
- ``timeline`` (lesson 14), ``host`` (lesson 12's loading), ``tables`` (``python -m shardlab.measure``);
- ``allocations``: the CPU allocator's allocations and frees, each free paired with its allocation.

``sl.measure.held_bytes`` and the other names of ``memory`` are reachable here directly.
"""

import importlib

_PARTS = ("memory", "collectives", "audit", "flight", "timeline", "host", "tables", "allocations")
_HOST = ("FileReads", "HostPeak", "measure_loading")


def __getattr__(name):
    # Each part loads on first use: a rank that only records flight entries does not import the planner.
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)
    if name in _HOST:
        return getattr(importlib.import_module(".host", __name__), name)
    if not name.startswith("__"):
        memory = importlib.import_module(".memory", __name__)
        if hasattr(memory, name):
            return getattr(memory, name)
    raise AttributeError(f"module 'shardlab.measure' has no attribute {name!r}")
