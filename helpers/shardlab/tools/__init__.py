"""Command-line tools, each ``python -m shardlab.tools.<name>`` (the Makefile's targets call them):

- ``smoke``: the stack works, as JSON (notebook 00 runs it);
- ``bench``: start-up and step costs measured side by side;
- ``handout``: the learners' copy of the notebooks, answers blanked (``make handout``);
- ``agenda``: a workshop's agenda from INSTRUCTORS.md's timings;
- ``gpucheck``: what only GPUs prove, in one command (``make gpu-check``);
- ``morning``: the machine check for the morning of a workshop (``make morning``).
"""

import importlib

MODULES = ("smoke", "bench", "handout", "agenda", "gpucheck", "morning")


def __getattr__(name):  # load on first use, as the top-level package does
    if name in MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *MODULES])
