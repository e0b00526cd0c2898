"""Memory planner: every rank's bytes for a model, a field and a ``(ddp, domain)`` layout, before renting the GPUs.

Pass ``Planner(model, field_shape)`` (or ``Planner(case, size)`` for a parity case) and call ``.plan(ddp=, domain=,
wrapper=, levers=)``; ``verdict`` says whether it fits. Notebook ``09_memory_planner`` teaches it; ``python -m
shardlab.plan --help`` is the command line. Modules: ``inputs`` (fields, sizes, GPUs, the model), ``trace`` (the replay
on the meta device), ``workspace`` (convolution workspaces measured), ``cases`` and ``calibrate`` (a parity case
planned from measured ranks), ``records`` (``RankBytes``, ``Plan``, the headroom), ``planner`` (the planner and its
verdict), ``search`` (the domain sizes that fit), ``validate`` (a step measured on ranks, against its plan), ``cli``.

How each category, the peak and the levers are predicted: docs/planner.md#how-it-predicts-per-rank.
"""

from .cases import CasePlanner
from .cli import main
from .inputs import DTYPES, GPUS, LOADINGS, OPTIMIZERS, GiB, MiB, conv_model, fmt_bytes, parse_field, parse_size
from .planner import Planner, Verdict, plan, verdict
from .records import ACCOUNTED, BUFFERS, CATEGORIES, LEFT_OUT, METHODS, Plan, RankBytes, headroom
from .trace import conv_halo
from .validate import (
    compare,
    comparison_table,
    gpu_check,
    measure_cases,
    measure_on_ranks,
    measure_rank,
    peak_cases,
    peak_table,
    predict_case,
    series_cases,
)

__all__ = ["ACCOUNTED", "BUFFERS", "CATEGORIES", "DTYPES", "GPUS", "LEFT_OUT", "LOADINGS", "METHODS", "OPTIMIZERS",
           "GiB", "MiB", "CasePlanner", "Plan", "Planner", "RankBytes", "Verdict", "compare", "comparison_table",
           "gpu_check", "measure_cases", "measure_on_ranks", "measure_rank", "peak_cases", "peak_table",
           "predict_case", "series_cases", "conv_halo", "conv_model", "fmt_bytes", "headroom", "main", "parse_field",
           "parse_size", "plan", "verdict"]
