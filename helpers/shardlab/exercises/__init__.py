"""The answer key of the exercises: one module per notebook, holding the judges its check cells call.

A judge runs on a rank next to the learner's objects (``sl.check.on_ranks``) or in the kernel
(``sl.check.judged``), works out what is right from that rank's own state, and returns None when
the answer is right or a sentence saying what is wrong. Keeping the judges here, not in the
notebooks, is what keeps the handout's check cells from showing the answer.
"""

import importlib


def __getattr__(name):
    # sl.exercises.nb03 loads the judges of notebook 03 on first use, on the rank or in the kernel.
    if name.startswith("nb"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'shardlab.exercises' has no attribute {name!r}")
