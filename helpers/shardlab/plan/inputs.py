"""What a plan is asked about: fields, memory sizes, GPUs, dtypes, optimizers and the series' model, parsed from
text with a message that says what to write instead."""

from __future__ import annotations

import re
import sys

import torch

from ..models import conv_stack
from ..report import fmt_bytes  # noqa: F401 - re-exported: sl.plan.fmt_bytes

GiB, MiB = 1024**3, 1024**2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
}
# How each rank gets its batch. "scatter": ``scatter_tensor`` broadcasts the whole input and target to every rank of
# the domain group, which keeps its slice. "slab": each rank reads only its own rows from storage, into a tensor of
# its own, and wraps them with ``ShardTensor.from_local(..., sharding_shapes=...)``: no full field on any rank.
LOADINGS = {"scatter": "scatter_tensor: the whole field on every rank of a domain group",
            "slab": "each rank reads its own rows (ShardTensor.from_local): no full field on any rank"}
# The memory the driver reports (nvidia-smi's memory.total), which is what a job can allocate before the CUDA context
# and NCCL take their share (those are in the verdict's headroom). Figures as nvidia-smi prints them for each card.
GPUS = {
    "RTX 4090 (24 GB)": 24564 * MiB,
    "L40S (48 GB)": 46068 * MiB,
    "A100 (40 GB)": 40960 * MiB,
    "A100 (80 GB)": 81920 * MiB,
    "H100 (80 GB)": 81559 * MiB,
    "H200 (141 GB)": 143771 * MiB,
}


def check_loading(loading: str) -> str:
    """``loading`` itself, or a ValueError that names the modes."""
    if loading not in LOADINGS:
        raise ValueError(f"loading={loading!r}: choose one of {list(LOADINGS)} (--loading on the command line).")
    return loading


def parse_field(text: str, channels: int = 1, batch: int = 1) -> tuple[int, ...]:
    """``"4096x4096"`` → ``(batch, channels, 4096, 4096)``; ``"512x512x512"`` → a 3-D field."""
    try:
        spatial = tuple(int(s) for s in re.split(r"[x×*,]", text.strip().lower()) if s)
    except ValueError:
        spatial = ()
    if len(spatial) not in (1, 2, 3) or min(spatial) < 1:
        raise ValueError(f"field {text!r}: give 1 to 3 positive sizes separated by 'x', e.g. 4096x4096 or 512x512x512.")
    return (batch, channels, *spatial)


_UNITS = {"b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": MiB, "g": GiB, "gb": 1e9,
          "gib": GiB, "t": 1024 * GiB, "tb": 1e12, "tib": 1024 * GiB}


def parse_size(text: str | float | int) -> int:
    """``"80GiB"``, ``"80GB"`` (10⁹ bytes), ``"141G"`` (GiB), ``"512B"``, or a name from ``GPUS`` → bytes; a number
    (not text) is bytes. Text needs its unit: a bare "80" is refused, not read as 80 bytes."""
    if isinstance(text, int | float):
        return int(text)
    for name, capacity in GPUS.items():
        if text.strip().lower() in (name.lower(), name.split(" (")[0].lower()):
            return capacity
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m and not m.group(2):
        raise ValueError(f"GPU memory {text!r} has no unit: write {m.group(1)}GiB ({m.group(1)}·2³⁰ bytes) or "
                         f"{m.group(1)}GB ({m.group(1)}·10⁹ bytes), or name one of {list(GPUS)}.")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"GPU memory {text!r}: write it like 80GiB, 40GB or 24G, or name one of {list(GPUS)}.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def conv_model(dims: int = 2, width: int = 16, depth: int = 3, kernel_size: int = 3, device="meta"):
    """The series' surrogate, ``sl.models.conv_stack``, for a 2-D field; the same stack of Conv3d for a 3-D one.

    Built on the meta device by default: a planner never needs the weights' values.
    """
    if depth < 1 or width < 1:
        raise ValueError(f"width={width}, depth={depth}: both must be at least 1.")
    if kernel_size < 1:
        raise ValueError(f"kernel size {kernel_size}: a kernel size is a positive odd number, e.g. 3 or 5.")
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel size {kernel_size}: odd kernels only (3, 5, 7, ...): a sharded convolution takes the "
                         "same number of halo rows from each neighbour, and 'same' padding keeps the field's size.")
    with torch.device(device):
        return conv_stack(width=width, layers=depth, kernel_size=kernel_size, dims=dims)


def is_case(model) -> bool:
    """A parity case (duck-typed: ``plan`` sits below ``parity`` in the layers and never imports it)."""
    return all(hasattr(model, a) for a in ("build", "inputs", "shard", "strategy", "whole_inputs"))


def case_ref(case) -> str:
    """The ``module:name`` the job of ranks loads the case by."""
    module = sys.modules.get(getattr(case.build, "__module__", ""), None)
    for name, value in vars(module or object()).items():
        if value is case:
            return f"{module.__name__}:{name}"
    raise ValueError(f"{case.name}: the ranks load a case by module and name; define it at the top level of an "
                     "importable module (as shardlab.model_cases does) and plan that.")


def calibration_sizes(case, ranks: int) -> tuple[int, int]:
    """The two sizes a case is measured at on ``ranks`` ranks: ``memory_scale`` and its square times the first size
    its parity runs at. Not that size itself: at a few rows per rank what does not grow with the field (the
    allocator's and the kernels' fixed buffers) decides the peak, and the line through it would start too low (the
    series' U-Net on 2 ranks: 323 bytes per element between 32² and 64², 540 from 64² on)."""
    first = case.sizes(ranks)[0] * case.memory_scale
    return first, first * case.memory_scale
