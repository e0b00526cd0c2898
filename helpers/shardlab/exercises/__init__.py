"""Exercises: how an answer is judged (``judging``), and one module of judges per notebook (``nb01`` ...).

A check cell calls ``sl.exercises.on_ranks`` (a judge run on every rank, next to the learner's objects) or
``sl.exercises.judged`` (in the kernel); the judge works out what is right from that rank's own state and returns None
when the answer is right or a sentence saying what is wrong. ``answers`` finds the reference answers the handout
blanks (``sl.exercises.reveal``); ``progress`` records each check's result for the instructor's class view. Keeping
the judges here, not in the notebooks, is what keeps the handout's check cells from showing the answer.
"""

import importlib

# What a check cell calls, from ``judging``.
_JUDGING = ("on_ranks", "judged", "reveal", "yours_or_reference", "answer", "per_rank", "case_generator",
            "earlier_object", "second_hint", "Watch", "NotSolved")


def __getattr__(name):
    # Loaded on first use, on the rank or in the kernel: a kernel checks an answer without importing torch.
    if name.startswith("nb") or name in ("judging", "answers", "progress"):
        return importlib.import_module(f".{name}", __name__)
    if name in _JUDGING:
        return getattr(importlib.import_module(".judging", __name__), name)
    raise AttributeError(f"module 'shardlab.exercises' has no attribute {name!r}")
