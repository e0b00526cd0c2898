"""Memory planner: every rank's bytes for a model, a field and a ``(ddp, domain)`` layout, before renting the GPUs.

Introduced in ``notebooks/09_memory_planner.ipynb``; ``python -m shardlab.plan --help`` is the command line.

How it predicts, per rank: the model is copied to the **meta device** (shapes and dtypes, no data) and run forward
and backward on the *local* shape that rank would hold, so a 8192² or 512³ field is planned in well under a second
without allocating it. Nothing is a per-layer formula; autograd says what it keeps:

- **parameters, gradients, optimizer state**: the local shard of each parameter (all of it with DDP or no
  wrapper; with FSDP2, the ``torch.chunk`` of dim 0 over the ddp ranks that ``fully_shard`` keeps), and the
  optimizer's own state after a real ``step()`` on meta tensors of those shapes;
- **activations**: every tensor autograd saves for backward (``saved_tensors_hooks``, parameters excluded,
  as ``sl.measure.SavedActivations`` counts them on real ranks). Under domain parallelism each rank holds its
  ``torch.chunk`` of the sharded dim (uneven shards included), and every convolution first pads its input with
  the halo rows of its neighbours, or with its own zero padding at the edges of the domain, then convolves with no
  padding along that dim: what PhysicsNeMo's ShardTensor convolution does (``compute_halo_configs_from_conv_args``
  and ``compute_haloed_and_padded_input_shape`` in ``physicsnemo/domain_parallel/shard_utils/conv_patches.py``).
  **halos** is the part of those saved bytes that are rows beyond the rank's own;
- **transient**: ``scatter_tensor`` broadcasts the whole tensor to every rank of the domain group before each keeps
  its slice, so the full field visits every rank. When the slice is a view (one sample, one channel, split along
  H), the full buffer even stays allocated as long as the sharded input lives;
- **buffers**: DDP's gradient buckets (a second copy of every gradient, ``gradient_as_bucket_view=False``) or
  FSDP2's all-gather output of the largest ``fully_shard`` unit (each shard padded to the size of the first);
- **temporaries**: the rest of a training step's high-water mark (gradients flowing through backward, the loss,
  the optimizer's foreach scratch), found by replaying one step (scatter, forward, loss, backward, optimizer step)
  on meta tensors while tracking live storages as the CUDA caching allocator counts them (512-byte blocks).

``total`` = the sum of the categories, at least the replayed peak: what each GPU must hold. What it cannot know
is in ``LEFT_OUT``, with typical sizes and sources; the verdict adds those as headroom.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .launch import (
    clean_environment,
    detect_launch,
    init_distributed,
    run_job,
    shutdown_distributed,
    torchrun_command,
)
from .mesh import build_mesh
from .models import conv_stack
from .report import Table

# PhysicsNeMo, the train and measure layers (DDP, FSDP2) are imported inside the functions that measure on ranks:
# planning runs in the notebook kernel and on a laptop, where their imports (seconds) buy nothing.

GiB, MiB = 1024**3, 1024**2
WRAPPERS = ("none", "ddp", "fsdp2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
}
# Memory as sold (the datasheet's GB, read as GiB); the driver reports a little less, and the CUDA context takes
# its share: both are in the headroom below.
GPUS = {
    "RTX 4090 (24 GB)": 24 * GiB,
    "L40S (48 GB)": 48 * GiB,
    "A100 (40 GB)": 40 * GiB,
    "A100 (80 GB)": 80 * GiB,
    "H100 (80 GB)": 80 * GiB,
    "H200 (141 GB)": 141 * GiB,
}
CATEGORIES = ("params", "grads", "optimizer", "activations", "transient", "buffers", "temporaries")
ACCOUNTED = ("params", "grads", "optimizer", "activations", "transient", "buffers")  # what CPU ranks measure exactly
ALLOCATOR_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp)

# What the planner cannot see on the meta device, with what it typically adds on a GPU and where that comes from.
# ``bytes`` / ``fraction`` is the headroom the verdict keeps for it.
LEFT_OUT = (
    {"what": "CUDA context (driver state, loaded kernels, cuDNN/cuBLAS handles)", "bytes": GiB // 2,
     "typical": "0.3-0.8 GiB per process, outside torch.cuda.memory_allocated",
     "source": "https://github.com/pytorch/pytorch/issues/34323 (nvidia-smi showed 781 MB for a process holding "
               "almost no tensors); lazy module loading (CUDA_MODULE_LOADING=LAZY) keeps it nearer the low end"},
    {"what": "NCCL communicator buffers (one communicator per process group: the world, ddp, domain)",
     "bytes": GiB // 2, "multi_rank_only": True,
     "typical": "NCCL_BUFFSIZE = 4 MiB per channel and peer by default: tens to hundreds of MiB per communicator",
     "source": "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize; invisible to "
               "PyTorch's allocator: https://docs.pytorch.org/docs/stable/torch_cuda_memory.html"},
    {"what": "allocator fragmentation and caching (memory_reserved - memory_allocated)", "fraction": 0.10,
     "typical": "about 10 % of the allocated peak: torch's own FSDPMemTracker is tested to +-10 % of the "
                "allocator's peak; large blocks round up to 2 MiB and blocks in different segments never merge",
     "source": "https://github.com/pytorch/pytorch/blob/main/test/distributed/_tools/test_fsdp2_mem_tracker.py; "
               "https://github.com/pytorch/devlogs/blob/main/content/eager/2026-06-01-cuda-caching-allocator.md"},
    {"what": "cuDNN convolution and cuBLAS workspaces", "bytes": 0,
     "typical": "cuBLAS(Lt): 32 MiB per handle on Hopper, 4 MiB before; cuDNN: algorithm-dependent scratch inside "
                "the allocator's peak (covered by the 10 % above; `make gpu-check` measures it)",
     "source": "https://github.com/pytorch/pytorch/pull/120925"},
)


# --------------------------------------------------------------------------------------------------------------
# Input parsing: fields, sizes, models


def parse_field(text: str, channels: int = 1, batch: int = 1) -> tuple[int, ...]:
    """``"4096x4096"`` → ``(batch, channels, 4096, 4096)``; ``"512x512x512"`` → a 3-D field."""
    try:
        spatial = tuple(int(s) for s in re.split(r"[x×*,]", text.strip().lower()) if s)
    except ValueError:
        spatial = ()
    if len(spatial) not in (1, 2, 3) or min(spatial) < 1:
        raise ValueError(f"field {text!r}: give 1 to 3 positive sizes separated by 'x', e.g. 4096x4096 or 512x512x512.")
    return (batch, channels, *spatial)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": MiB, "g": GiB, "gb": 1e9,
          "gib": GiB, "t": 1024 * GiB, "tb": 1e12, "tib": 1024 * GiB}


def parse_size(text: str | float | int) -> int:
    """``"80GiB"``, ``"80GB"`` (10⁹ bytes), ``"141G"`` (GiB), a number of bytes, or a name from ``GPUS`` → bytes."""
    if isinstance(text, int | float):
        return int(text)
    for name, capacity in GPUS.items():
        if text.strip().lower() in (name.lower(), name.split(" (")[0].lower()):
            return capacity
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"GPU memory {text!r}: write it like 80GiB, 40GB or 24G, or name one of {list(GPUS)}.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Bytes in the unit that reads best: ``1.50 GiB``, ``12.3 MiB``, ``640 B``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def conv_model(dims: int = 2, width: int = 16, depth: int = 3, kernel_size: int = 3, device="meta"):
    """The series' surrogate, ``sl.models.conv_stack``, for a 2-D field; the same stack of Conv3d for a 3-D one.

    Built on the meta device by default: a planner never needs the weights' values.
    """
    if depth < 1 or width < 1:
        raise ValueError(f"width={width}, depth={depth}: both must be at least 1.")
    with torch.device(device):
        return conv_stack(width=width, layers=depth, kernel_size=kernel_size, dims=dims)


# --------------------------------------------------------------------------------------------------------------
# Tracing on the meta device


def _sid(t: torch.Tensor) -> int:
    """An identity for a tensor's storage that also works on the meta device (where every data_ptr is 0)."""
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _blocks(n: int) -> int:
    """Bytes the CUDA caching allocator counts for an allocation of n bytes."""
    return -(-n // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


class _LiveBytes(TorchDispatchMode):
    """Live storages created inside ``with``, counted in allocator blocks; ``peak`` is the high-water mark.

    Works on meta tensors: a storage's Python object can be watched with ``weakref.finalize``.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._sizes:
                    self._sizes[key] = _blocks(storage.nbytes())
                    self.live += self._sizes[key]
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _per_dim(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, list | tuple) else (value,) * n


def conv_halo(kernel_size: int, dilation: int = 1) -> int:
    """Rows a sharded convolution needs from each neighbour: half its receptive field (odd kernels), as PhysicsNeMo's
    ``compute_halo_from_kernel_stride_and_dilation``; even kernels are only shardable with stride = kernel: none."""
    return 0 if kernel_size % 2 == 0 else (dilation * (kernel_size - 1) + 1) // 2


class _ShardedConvolutions(TorchFunctionMode):
    """Inside ``with``: every convolution behaves as PhysicsNeMo's ShardTensor convolution on one rank.

    Along the sharded dim the input gets the neighbours' halo rows (or, at the first and last rank of the domain,
    the convolution's own zero padding), and the convolution then runs with no padding along that dim.
    """

    def __init__(self, dim: int, first: bool, last: bool, padded: dict):
        super().__init__()
        self.dim, self.first, self.last, self.padded = dim, first, last, padded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _CONVS:
            return func(*args, **(kwargs or {}))
        spatial = _CONVS[func]
        call = dict(zip(_CONV_ARGS, args)) | (kwargs or {})
        x, weight = call["input"], call["weight"]
        axis = self.dim - (x.dim() - spatial)  # which kernel dim runs along the sharded tensor dim
        if not 0 <= axis < spatial:
            return func(**call)
        k = weight.shape[2 + axis]
        dilation = _per_dim(call.get("dilation", 1), spatial)
        padding = call.get("padding", 0)
        if isinstance(padding, str):  # "same" / "valid", as PhysicsNeMo's padding_from_str_and_params resolves them
            padding = tuple(((weight.shape[2 + i] - 1) * dilation[i]) // 2 if padding == "same" else 0
                            for i in range(spatial))
        padding = list(_per_dim(padding, spatial))
        halo = conv_halo(k, dilation[axis])
        if halo == 0:
            return func(**call)
        above = padding[axis] if self.first else halo
        below = padding[axis] if self.last else halo
        pads = [0] * (2 * x.dim())
        pads[2 * (x.dim() - 1 - self.dim)], pads[2 * (x.dim() - 1 - self.dim) + 1] = above, below
        xp = F.pad(x, pads)
        self.padded[_sid(xp)] = (above + below) / xp.shape[self.dim]  # the share of its rows that are not this rank's
        padding[axis] = 0
        return func(**(call | {"input": xp, "padding": tuple(padding)}))


class _SavedOnMeta:
    """Bytes autograd saves for backward, deduplicated and with parameters excluded as ``SavedActivations`` does,
    for meta tensors (whose data pointers are all 0: the storage identifies them)."""

    def __init__(self, exclude: set[int], padded: dict):
        self.exclude, self.padded = exclude, padded
        self.seen: set[tuple] = set()
        self.bytes = 0
        self.halos = 0.0

    def pack(self, t):
        key = (_sid(t), t.storage_offset(), tuple(t.shape))
        if key[0] not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += _nbytes(t)
            self.halos += _nbytes(t) * self.padded.get(key[0], 0.0)
        return t


def _local_slices(extent: int, n: int) -> list[int]:
    """Rows each of n domain ranks holds: ``torch.chunk`` of the sharded dim, which ``scatter_tensor`` (through
    DTensor's ``Shard``) uses. Uneven: the first ranks get ceil(extent / n), the last one the rest."""
    sizes = [c.shape[0] for c in torch.chunk(torch.empty(extent, device="meta"), n)]
    return sizes + [0] * (n - len(sizes))


def _fsdp_shards(shape: torch.Size, ddp: int) -> tuple[list[torch.Size], int]:
    """``fully_shard``'s split of a parameter over the ddp ranks: the local shapes (``torch.chunk`` of dim 0, possibly
    empty), and the padded shard's element count (every shard is padded to the size of the first)."""
    if len(shape) == 0:
        return [shape] * ddp, 1
    chunks = [c.shape for c in torch.chunk(torch.empty(shape, device="meta"), ddp, dim=0)]
    chunks += [torch.Size([0, *shape[1:]])] * (ddp - len(chunks))
    return chunks, chunks[0].numel()


def _fsdp_units(model) -> list[list[torch.nn.Parameter]]:
    """The parameter groups ``sl.train.wrap`` gives ``fully_shard``: each child with trainable parameters, then the
    root with whatever is left."""
    units, taken = [], set()
    for child in model.children():
        params = [p for p in child.parameters() if p.requires_grad]
        if params:
            units.append(params)
            taken |= {id(p) for p in params}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return units + ([rest] if rest else [])


@dataclass
class _Trace:
    activations: int
    halos: int
    peak: int  # the replayed forward and backward's high-water mark of live bytes, inputs included
    after: int  # live bytes left when backward is done (the sharded input and target): under the optimizer step


def _trace_rank(model, field_shape: tuple, out_channels: int, dtype, dim: int, domain: int, position: int,
                rows: int) -> _Trace:
    """One rank's forward (saved tensors recorded) inside a replayed scatter, forward, loss and backward (live
    bytes tracked), in the order of ``sl.train.Trainer.step``."""
    first, last = position == 0, position == domain - 1
    padded: dict[int, float] = {}
    params = list(model.parameters())
    saved = _SavedOnMeta({_sid(p) for p in params}, padded)
    for p in params:  # the previous step's gradients: persistent state, not part of the step's own peak
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    target_shape = (field_shape[0], out_channels, *field_shape[2:])
    with _LiveBytes() as live:
        fields = []
        for shape in (field_shape, target_shape):  # scatter_tensor: the whole tensor on every rank, then the slice
            full = torch.empty(shape, dtype=dtype, device="meta")
            fields.append(torch.chunk(full, domain, dim=dim)[position].contiguous() if domain > 1 else full)
            del full
        x, y = fields
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            if domain > 1:
                with _ShardedConvolutions(dim, first, last, padded):
                    out = model(x)
            else:
                out = model(x)
        if out.shape[dim] != rows:
            raise ValueError(f"the model changes the size of dim {dim} ({rows} rows in, {out.shape[dim]} out): the "
                             "planner handles field-to-field models that keep the sharded dim.")
        loss = ((out - y) ** 2).mean()
        del out
        loss.backward()
        del loss
        after = live.live
    for p in params:
        p.grad = None
    return _Trace(saved.bytes, round(saved.halos), live.peak, after)


@dataclass
class _State:
    """One ddp index's parameters, gradients, optimizer state and wrapper buffers."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    device_bytes: int  # the same, as the GPU allocator holds them (FSDP2's padded shards, 512-byte blocks)
    scratch: int  # the optimizer step's own temporaries


def _optimizer_state(optimizer_name: str, local: list[torch.Tensor]) -> tuple[int, int, int]:
    """(state bytes as ``state_bytes`` counts them, of which on the parameters' device, the step's scratch)."""
    optimizer = OPTIMIZERS[optimizer_name](local)
    for p in local:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the state, as the first training step does
    with _LiveBytes() as live:
        optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    on_device = sum(_blocks(_nbytes(v)) for v in state if v.device.type == "meta")  # Adam's step count stays on CPU
    return sum(_nbytes(v) for v in state), on_device, live.peak


@dataclass
class Plan:
    """Predicted bytes per rank for one layout; ``rows[r]`` is rank r (``rank = ddp index × domain + domain index``,
    the order of ``initialize_mesh((ddp, domain), ...)``)."""

    rows: list[dict]
    field_shape: tuple
    dtype: str
    ddp: int
    domain: int
    wrapper: str
    optimizer: str
    model: str = "model"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.ddp * self.domain

    def largest(self) -> dict:
        """The rank that needs the most: the one that decides whether the layout fits."""
        return max(self.rows, key=lambda r: (r["total"], -r["rank"]))

    def headroom(self, need: int | None = None) -> int:
        """Bytes kept free for what the planner cannot see (``LEFT_OUT``), for this layout."""
        need = self.largest()["total"] if need is None else need
        extra = 0
        for item in LEFT_OUT:
            if item.get("multi_rank_only") and self.world_size == 1:
                continue
            extra += item.get("bytes", 0) + item.get("fraction", 0.0) * need
        return int(extra)

    def groups(self) -> list[tuple[str, dict]]:
        """Ranks with the same bytes merged: (label such as "ranks 0-7", one of their rows), in rank order."""
        keys = (*CATEGORIES, "halos", "total")
        out: list[tuple[list[int], dict]] = []
        for row in self.rows:
            if out and all(out[-1][1][k] == row[k] for k in keys):
                out[-1][0].append(row["rank"])
            else:
                out.append(([row["rank"]], row))
        return [(f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}", row) for r, row in out]

    def bars(self) -> dict[str, dict[str, int]]:
        """Stacked categories per group of equal ranks, for ``sl.plot.memory_bars`` (own rows and halos apart)."""
        return {label: {"params": r["params"], "grads": r["grads"], "optimizer": r["optimizer"],
                        "activations": r["activations"] - r["halos"], "halos": r["halos"],
                        "transient": r["transient"], "buffers": r["buffers"], "temporaries": r["temporaries"]}
                for label, r in self.groups()}

    def table(self) -> Table:
        """Per group of equal ranks, in readable units."""
        columns = [*CATEGORIES[:4], "halos", *CATEGORIES[4:], "total"]
        return Table([{"ranks": label.removeprefix("ranks ").removeprefix("rank ")}
                      | {c: fmt_bytes(row[c]) for c in columns} for label, row in self.groups()], ["ranks", *columns])

    def as_json(self, capacity: int | None = None) -> dict:
        out = {"model": self.model, "field": list(self.field_shape), "dtype": self.dtype,
               "mesh": {"ddp": self.ddp, "domain": self.domain}, "wrapper": self.wrapper, "optimizer": self.optimizer,
               "rows": [{k: r[k] for k in ("rank", "params", "grads", "optimizer", "activations", "halos",
                                           "transient", "buffers", "temporaries", "peak", "total")} for r in self.rows],
               "left_out": [dict(item) for item in LEFT_OUT], "notes": list(self.notes)}
        if capacity is not None:
            out["gpu_bytes"] = capacity
        return out


class Planner:
    """Plans for one model, field, dtype and optimizer, over any layouts; traces are cached per distinct rank shape."""

    def __init__(self, model, field_shape, dtype=torch.float32, optimizer: str = "adam", shard_dim: int = 2,
                 name: str | None = None):
        if isinstance(dtype, str):
            dtype = DTYPES[dtype]
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: choose one of {list(OPTIMIZERS)}.")
        self.field_shape = tuple(int(s) for s in field_shape)
        if not 2 <= shard_dim < len(self.field_shape):
            raise ValueError(f"shard_dim={shard_dim}: shard a spatial dim of the field {self.field_shape} (2 or more).")
        self.dtype, self.optimizer, self.dim = dtype, optimizer, shard_dim
        self.name = name or type(model).__name__
        if any(p.device.type != "meta" for p in model.parameters()):
            model = copy.deepcopy(model).to("meta")
        self.model = model.to(dtype)
        self.params = [p for p in self.model.parameters()]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.units = _fsdp_units(self.model)
        self.halo = max([conv_halo(m.kernel_size[min(self.dim - 2, len(m.kernel_size) - 1)], 1)
                         for m in self.model.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)] or [0])
        with torch.no_grad():
            probe = self.model(torch.empty(self.field_shape, dtype=dtype, device="meta"))
        if tuple(probe.shape[2:]) != self.field_shape[2:]:
            raise ValueError(f"the model maps {self.field_shape} to {tuple(probe.shape)}: the planner handles "
                             "field-to-field models that keep the spatial size.")
        self.out_channels = probe.shape[1]
        self._traces: dict[tuple, _Trace] = {}
        self._states: dict[tuple, _State] = {}

    def _trace(self, domain: int, position: int, rows: int) -> _Trace:
        key = (domain > 1, position == 0, position == domain - 1, rows)  # all a rank's slice depends on
        if key not in self._traces:
            self._traces[key] = _trace_rank(self.model, self.field_shape, self.out_channels, self.dtype, self.dim,
                                            domain, position, rows)
        return self._traces[key]

    def _state(self, wrapper: str, ddp: int, index: int) -> _State:
        key = (wrapper, ddp if wrapper == "fsdp2" else 1, index if wrapper == "fsdp2" else 0)
        if key in self._states:
            return self._states[key]
        elsize = torch.empty((), dtype=self.dtype).element_size()
        if wrapper == "fsdp2":
            shards = {id(p): _fsdp_shards(p.shape, ddp) for p in self.params}
            local = {id(p): shards[id(p)][0][index] for p in self.params}
            params = sum(local[id(p)].numel() for p in self.params) * elsize
            grads = sum(local[id(p)].numel() for p in self.trainable) * elsize
            device = sum(_blocks(shards[id(p)][1] * elsize) for p in [*self.params, *self.trainable])
            buffers = max((sum(shards[id(p)][1] * ddp for p in unit) * elsize for unit in self.units), default=0)
            tensors = [torch.empty(local[id(p)], dtype=p.dtype, device="meta") for p in self.trainable]
        else:
            params = sum(_nbytes(p) for p in self.params)
            grads = sum(_nbytes(p) for p in self.trainable)
            device = sum(_blocks(_nbytes(p)) for p in [*self.params, *self.trainable])
            buffers = grads if wrapper == "ddp" else 0
            tensors = [torch.empty_like(p) for p in self.trainable]
        opt_bytes, opt_device, scratch = _optimizer_state(self.optimizer, tensors)
        self._states[key] = _State(params, grads, opt_bytes, buffers, device + opt_device + _blocks(buffers), scratch)
        return self._states[key]

    def plan(self, ddp: int = 1, domain: int = 1, wrapper: str = "ddp") -> Plan:
        """Every rank's bytes on a ``(ddp, domain)`` mesh with the given wrapper on the ddp axis."""
        t0 = time.perf_counter()
        if wrapper not in WRAPPERS:
            raise ValueError(f"wrapper={wrapper!r}: choose one of {WRAPPERS} (FSDP1 and distribute_module are not "
                             "options).")
        if ddp < 1 or domain < 1:
            raise ValueError(f"ddp={ddp}, domain={domain}: both axis sizes must be at least 1.")
        extent = self.field_shape[self.dim]
        slices = _local_slices(extent, domain)
        if domain > 1 and not self.valid_domain(domain):
            worst = slices.index(min(slices))
            valid = self.valid_domains()
            near = sorted(valid, key=lambda n: abs(n - domain))[:2]
            raise ValueError(f"domain={domain} over {extent} rows: torch.chunk cuts {slices[0]}-row slices and rank "
                             f"{worst} of the domain would hold {slices[worst]} row(s), fewer than the "
                             f"{max(1, self.halo)} halo row(s) a convolution needs from each neighbour. Domain sizes "
                             f"near it that work: {sorted(near)}; at most {valid[-1]}.")
        elsize = torch.empty((), dtype=self.dtype).element_size()
        full = max(math.prod(self.field_shape), math.prod((self.field_shape[0], self.out_channels,
                                                           *self.field_shape[2:]))) * elsize
        transient = full if domain > 1 else 0  # the larger of input and target, broadcast whole by scatter_tensor
        rows = []
        for rank in range(ddp * domain):
            index, position = divmod(rank, domain)
            state, trace = self._state(wrapper, ddp, index), self._trace(domain, position, slices[position])
            row = {"rank": rank, "ddp_index": index, "domain_index": position, "rows": slices[position],
                   "params": state.params, "grads": state.grads, "optimizer": state.optimizer,
                   "activations": trace.activations, "halos": trace.halos, "transient": transient,
                   "buffers": state.buffers}
            row["accounted"] = sum(row[c] for c in ACCOUNTED)
            row["peak"] = state.device_bytes + max(trace.peak, trace.after + state.scratch)
            row["temporaries"] = max(0, row["peak"] - row["accounted"])
            row["total"] = row["accounted"] + row["temporaries"]
            rows.append(row)
        notes = []
        if domain > 1 and slices[0] != slices[-1]:
            notes.append(f"uneven shards: {extent} rows over {domain} ranks hold {sorted(set(slices), reverse=True)} "
                         "rows (torch.chunk)")
        return Plan(rows, self.field_shape, str(self.dtype).removeprefix("torch."), ddp, domain, wrapper,
                    self.optimizer, self.name, time.perf_counter() - t0, notes)

    def valid_domain(self, n: int) -> bool:
        """Whether n domain ranks each get at least the halo rows (and one row) of ``torch.chunk``'s split."""
        extent, need = self.field_shape[self.dim], max(1, self.halo)
        if n == 1:
            return True
        size = -(-extent // n)  # torch.chunk: slices of ceil(extent / n) rows, the last one what is left
        return n <= extent and -(-extent // size) == n and extent - size * (n - 1) >= need

    def valid_domains(self) -> list[int]:
        """Every domain size this field can be split into (see ``valid_domain``), smallest first."""
        return [n for n in range(1, self.field_shape[self.dim] + 1) if self.valid_domain(n)]

    def max_domain(self) -> int:
        """The most domain ranks the sharded dim allows."""
        return self.valid_domains()[-1]

    def fits(self, capacity: int, ddp: int = 1, domain: int = 1, wrapper: str = "ddp") -> bool:
        p = self.plan(ddp, domain, wrapper)
        need = p.largest()["total"]
        return need + p.headroom(need) <= capacity

    def smallest_domain(self, capacity: int, ddp: int = 1, wrapper: str = "ddp") -> int | None:
        """The fewest domain ranks with which every rank fits in ``capacity`` (headroom kept), or None."""
        sizes = self.valid_domains()
        if not self.fits(capacity, ddp, sizes[-1], wrapper):
            return None
        lo, hi = 0, len(sizes) - 1  # the largest rank's rows, hence its bytes, never grow with the domain size
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fits(capacity, ddp, sizes[mid], wrapper):
                hi = mid
            else:
                lo = mid + 1
        return sizes[lo]


def plan(model, field_shape, *, ddp: int = 1, domain: int = 1, wrapper: str = "ddp", optimizer: str = "adam",
         dtype=torch.float32, shard_dim: int = 2) -> Plan:
    """Predicted bytes per rank: ``model`` (any field-to-field module; copied to the meta device) trained on a
    field of ``field_shape`` (batch 1 per domain group), sharded along ``shard_dim`` over ``domain`` ranks, with
    ``wrapper`` ("none", "ddp", "fsdp2") on ``ddp`` replicas and ``optimizer``."""
    return Planner(model, field_shape, dtype, optimizer, shard_dim).plan(ddp, domain, wrapper)


def verdict(planner: Planner, result: Plan, capacity: int) -> dict:
    """Does the layout fit on GPUs of ``capacity`` bytes, with the headroom of ``LEFT_OUT`` kept?

    ``text`` is "fits with X GiB left" or "does not fit: smallest domain size that fits is N".
    """
    need = result.largest()["total"]
    headroom = result.headroom(need)
    left = capacity - need - headroom
    out = {"fits": left >= 0, "capacity": capacity, "largest_rank": result.largest()["rank"], "need": need,
           "headroom": headroom, "left": left, "smallest_domain": None}
    if left >= 0:
        out["text"] = f"fits with {left / GiB:.1f} GiB left"
        return out
    smallest = planner.smallest_domain(capacity, result.ddp, result.wrapper)
    out["smallest_domain"] = smallest
    if smallest is not None:
        out["text"] = f"does not fit: smallest domain size that fits is {smallest}"
        return out
    top = planner.plan(result.ddp, planner.max_domain(), result.wrapper).largest()
    fixed = top["params"] + top["grads"] + top["optimizer"] + top["buffers"]
    out["text"] = (f"does not fit at any domain size: with {planner.max_domain()} domain ranks a rank still needs "
                   f"{fmt_bytes(top['total'])}, of which {fmt_bytes(top['transient'])} is the full field that "
                   f"scatter_tensor broadcasts and {fmt_bytes(fixed)} parameters, gradients and optimizer state "
                   "(FSDP2 on more ddp ranks divides those)")
    return out


# --------------------------------------------------------------------------------------------------------------
# Measured on real ranks: the same categories, counted live (CPU: exact bytes; GPU: also the allocator's peak)


class _CollectiveSizes(TorchDispatchMode):
    """Per phase, the bytes of the tensors handed to broadcasts, bucket all-reduces and FSDP2 all-gathers."""

    def __init__(self):
        super().__init__()
        self.phase = "setup"
        self.largest_broadcast = self.allreduce_total = self.largest_allgather = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d" and tensors:
            if name == "broadcast_" and self.phase == "scatter":
                self.largest_broadcast = max(self.largest_broadcast, max(_nbytes(t) for t in tensors))
            elif name == "allreduce_" and self.phase == "backward":
                self.allreduce_total += sum(_nbytes(t) for t in tensors)
            elif name == "_allgather_base_":
                self.largest_allgather = max(self.largest_allgather, _nbytes(tensors[0]))  # the output buffer
        return out


def measure_rank(model, mesh, wrapper: str, samples=None, shard_dim: int = 2) -> dict:
    """On every rank together: one training step of ``sl.train.Trainer`` (after a warm-up step, so that gradients
    and optimizer state exist), its parts counted as the planner predicts them. Returns this rank's bytes.

    The measured step is ``Trainer.step``'s own lines with instruments around them: the scatter (largest tensor a
    broadcast handles), the forward (``SavedActivations``, also excluding the parameters FSDP2 gathers for the
    layer), the backward (DDP's bucket all-reduces, FSDP2's all-gathers), then ``state_bytes``. On a GPU,
    ``cuda_peak`` is ``max_memory_allocated`` over the measured step (``DevicePeak``).
    """
    import torch.distributed as dist

    from .measure import DevicePeak, SavedActivations, state_bytes
    from .train import Trainer, average_gradients_by_hand

    trainer = Trainer(model, mesh, wrapper, samples=samples)
    trainer.step()
    live_params: set[int] = set()
    hooks = [m.register_forward_pre_hook(lambda m, a: live_params.update(
        p.data_ptr() for p in m.parameters(recurse=False))) for m in trainer.model.modules()]
    gathered = [0]  # FSDP2: the largest unit's unsharded parameters (padded), as held during its forward

    def unit_hook(unit, names):
        def hook(module, args):
            params = dict(module.named_parameters())
            gathered[0] = max(gathered[0], sum(params[n].untyped_storage().nbytes() for n in names))
        return unit.register_forward_pre_hook(hook)

    hooks += [unit_hook(unit, names) for unit, names in _fsdp_unit_names(trainer.model)]
    sizes = _CollectiveSizes()
    device = trainer.device
    own_rows = [0]

    class Saved(SavedActivations):
        """SavedActivations that also leaves out the (gathered) parameters each layer uses, and counts halo rows."""

        halos = 0.0

        def _pack(self, t):
            local = t.to_local() if hasattr(t, "to_local") else t
            self._exclude |= live_params
            before = self.bytes
            super()._pack(t)
            if self.bytes > before and local.dim() > shard_dim and local.shape[shard_dim] > own_rows[0] > 0:
                self.halos += (self.bytes - before) * (local.shape[shard_dim] - own_rows[0]) / local.shape[shard_dim]
            return t

    with DevicePeak(device) as peak, sizes:
        sizes.phase = "scatter"
        x, y = trainer.batch(trainer.steps_done)
        local_x = x.to_local() if hasattr(x, "to_local") else x
        own_rows[0] = local_x.shape[shard_dim] if mesh["domain"].size() > 1 else 0
        sizes.phase = "forward"
        with Saved(exclude=trainer.model.parameters()) as saved:
            out = trainer.model(x)
        loss = ((out - y) ** 2).mean()
        del out
        trainer.optimizer.zero_grad()
        sizes.phase = "backward"
        loss.backward()
        sizes.phase = "step"
        if wrapper == "none" and trainer.ddp_size > 1:
            average_gradients_by_hand(trainer.model, mesh["ddp"].get_group())
        trainer.optimizer.step()
        del loss, x, y, local_x
    for h in hooks:
        h.remove()
    state = state_bytes(trainer.model, trainer.optimizer)
    # With one ddp rank FSDP2 gathers nothing over the network, but still copies each unit into unsharded buffers.
    buffers = {"ddp": sizes.allreduce_total, "fsdp2": max(sizes.largest_allgather, gathered[0])}.get(wrapper, 0)
    row = {"rank": dist.get_rank(), "params": state["parameters"], "grads": state["gradients"],
           "optimizer": state["optimizer state"], "activations": saved.bytes, "halos": round(saved.halos),
           "transient": sizes.largest_broadcast if mesh["domain"].size() > 1 else 0, "buffers": buffers}
    row["accounted"] = sum(row[c] for c in ACCOUNTED)
    if peak.measured:
        row["cuda_peak"] = peak.peak_allocated
        row["cuda_reserved"] = peak.peak_reserved
    return row


def _fsdp_unit_names(model) -> list[tuple]:
    """Each ``fully_shard`` unit of a model with the names of the parameters it manages (not a sub-unit's)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    out = []
    for unit in units:
        inner = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                 for p in sub.parameters()}
        names = [n for n, p in unit.named_parameters() if id(p) not in inner]
        if names:
            out.append((unit, names))
    return out


def compare(predicted: Plan, measured: list[dict]) -> list[dict]:
    """Per rank, predicted against measured: the CPU byte accounting and, where measured, the GPU allocator's peak."""
    rows = []
    for m in measured:
        p = predicted.rows[m["rank"]]
        row = {"rank": m["rank"], "predicted": p["accounted"], "measured": m["accounted"],
               "error": (p["accounted"] - m["accounted"]) / m["accounted"]}
        row["categories off"] = ", ".join(f"{c} {p[c] - m[c]:+d}" for c in (*ACCOUNTED, "halos") if p[c] != m[c]) or "-"
        if "cuda_peak" in m:
            row |= {"predicted peak": p["peak"], "cuda peak": m["cuda_peak"],
                    "peak error": (p["peak"] - m["cuda_peak"]) / m["cuda_peak"]}
        rows.append(row)
    return rows


# The series' own models and fields, measured on 4 ranks by ``python -m shardlab.plan --measure``.
SERIES_MODELS = {
    "04": {"width": 16, "layers": 3},  # notebook 04: conv_stack(width=16, layers=3)
    "05": {"seed": 0},  # notebook 05: conv_stack(seed=0)
    "07": {"seed": 0},  # notebook 07: conv_stack(seed=0)
}


def series_cases(world: int = 4) -> list[dict]:
    """The cases the planner is checked against: notebooks 04, 05 and 07's model, N = 1, 2, 4 on the domain axis
    (ddp = world // N), DDP and FSDP2, on the 64×64 Darcy field; plus an uneven field without a wrapper."""
    cases = []
    for notebook, kwargs in SERIES_MODELS.items():
        for n in (1, 2, 4):
            if world % n:
                continue
            for wrapper in ("ddp", "fsdp2"):
                cases.append({"name": f"nb{notebook} N={n} {wrapper}", "model": kwargs, "domain": n,
                              "ddp": world // n, "wrapper": wrapper, "field": None})
    if world % 4 == 0:
        cases.append({"name": "uneven 66x64 N=4 none", "model": {"width": 8, "layers": 3}, "domain": 4,
                      "ddp": world // 4, "wrapper": "none", "field": [1, 1, 66, 64]})
    return cases


def _model_key(case: dict) -> str:
    return json.dumps([conv_stack_kwargs(case["model"]), case["domain"], case["wrapper"], case["field"]])


def conv_stack_kwargs(kwargs: dict) -> dict:
    """``conv_stack``'s keyword arguments with its defaults filled in (so equal models compare equal)."""
    return {"width": 16, "layers": 3, "kernel_size": 3, "seed": 0} | kwargs


def _case_samples(case: dict, steps: int = 2):
    """Inputs and targets for a case: the series' Darcy fields, or random ones of the case's shape (CPU tensors,
    moved to the rank's device by the Trainer)."""
    if case.get("field") is None:
        return None
    shape = case["field"]
    generator = torch.Generator().manual_seed(0)
    n = steps * case["ddp"]
    return (torch.randn((n, *shape[1:]), generator=generator), torch.randn((n, 1, *shape[2:]), generator=generator))


def measure_cases(cases: list[dict], timeout_s: float = 120.0) -> dict:
    """On every rank of a launched job: each case measured once (cases with equal models share a run)."""
    import torch.distributed as dist

    state = init_distributed(timeout_s)
    results, done = [], {}
    for case in cases:
        key = _model_key(case)
        if key not in done:
            mesh = build_mesh(ddp=case["ddp"], domain=case["domain"])
            model = conv_stack(**conv_stack_kwargs(case["model"])).to(state.device)
            mine = measure_rank(model, mesh, case["wrapper"], samples=_case_samples(case))
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            done[key] = everyone
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        results.append(case | {"ranks": done[key]})
    return {"world_size": state.world_size, "backend": state.backend, "device": state.device, "cases": results}


def predict_case(case: dict) -> Plan:
    """The planner's prediction for one of ``series_cases`` (or any case of that form)."""
    field_shape = case["field"] or [1, 1, 64, 64]  # the Darcy fields of data/
    kwargs = conv_stack_kwargs(case["model"])
    model = conv_model(2, width=kwargs["width"], depth=kwargs["layers"], kernel_size=kwargs["kernel_size"])
    return plan(model, field_shape, ddp=case["ddp"], domain=case["domain"], wrapper=case["wrapper"])


def comparison_table(measurement: dict) -> list[dict]:
    """Every case and rank of a ``measure_cases`` result against the planner: one row per rank."""
    rows = []
    for case in measurement["cases"]:
        predicted = predict_case(case)
        for row in compare(predicted, case["ranks"]):
            rows.append({"case": case["name"]} | row)
    return rows


def gpu_check(gpus: int, timeout_s: float = 300.0, field_size: int = 2048) -> tuple[str, bool]:
    """For ``make gpu-check``: the planner's predicted peak per rank against ``max_memory_allocated`` on real GPUs,
    within 10 %, on a ``field_size``² field (DDP and FSDP2; N = 1, and N = number of GPUs when it is 2 or more)."""
    cases = []
    for n in sorted({1, gpus}):
        for wrapper in ("ddp", "fsdp2"):
            cases.append({"name": f"{field_size}^2 N={n} {wrapper}", "model": {"width": 16, "layers": 3},
                          "domain": n, "ddp": gpus // n, "wrapper": wrapper, "field": [1, 1, field_size, field_size]})
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-") as tmp:
        out = Path(tmp) / "cases.json"
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps(cases))
        job = run_job("torchrun", gpus, "shardlab.plan", ["--measure", "--cases", str(spec), "--json", str(out)],
                      timeout_s=timeout_s)
        measurement = json.loads(out.read_text())
    rows = comparison_table(measurement)
    if not all("peak error" in r for r in rows):
        return f"no CUDA peak was measured (on {job.placement.label}, device {measurement['device']})", False
    worst = max(rows, key=lambda r: abs(r["peak error"]))
    cells = [f"{r['case']} rank 0: predicted {fmt_bytes(r['predicted peak'])}, max_memory_allocated "
             f"{fmt_bytes(r['cuda peak'])} ({r['peak error']:+.1%})" for r in rows if r["rank"] == 0]
    ok = job.placement.device == "cuda" and all(abs(r["peak error"]) <= 0.10 for r in rows)
    return f"on {job.placement.label}: " + "; ".join(cells) + f"; worst rank {worst['peak error']:+.1%}", ok


# --------------------------------------------------------------------------------------------------------------
# Command line


def _print_plan(planner: Planner, result: Plan, capacity: int | None) -> dict | None:
    print(f"# memory plan: {result.model} on a {'x'.join(map(str, result.field_shape[2:]))} field "
          f"({result.field_shape[1]} channel(s), batch {result.field_shape[0]} per domain group), {result.dtype}; "
          f"mesh (ddp={result.ddp}, domain={result.domain}), {result.wrapper}, {result.optimizer}")
    print(result.table())
    for note in result.notes:
        print(f"# {note}")
    big = result.largest()
    print(f"# largest rank: {big['rank']}, {fmt_bytes(big['total'])} (replayed step peak {fmt_bytes(big['peak'])}); "
          f"planned in {result.seconds:.2f} s on the meta device")
    print("# left out (headroom the verdict keeps):")
    for item in LEFT_OUT:
        size = (f"{item['fraction']:.0%} of the need" if "fraction" in item
                else fmt_bytes(item["bytes"]) if item.get("bytes") else "in the 10 %")
        print(f"#   {item['what']}: {size}; typically {item['typical']} [{item['source']}]")
    if capacity is None:
        return None
    v = verdict(planner, result, capacity)
    print(f"verdict on {fmt_bytes(capacity)} GPUs: {v['text']} (need {fmt_bytes(v['need'])} + headroom "
          f"{fmt_bytes(v['headroom'])})")
    return v


def main(argv=None) -> int:
    """Predict every rank's memory for a field, a model and a (ddp, domain) layout; with --measure, measure the
    series' own cases on real ranks and compare."""
    parser = argparse.ArgumentParser(prog="python -m shardlab.plan", description=main.__doc__)
    parser.add_argument("--field", default="4096x4096", help="spatial size, e.g. 4096x4096 or 512x512x512")
    parser.add_argument("--domain", type=int, default=1, help="ranks that shard one sample (domain axis)")
    parser.add_argument("--ddp", type=int, default=1, help="replicas on the ddp axis")
    parser.add_argument("--wrapper", choices=WRAPPERS, default="ddp")
    parser.add_argument("--gpu", help="memory per GPU: 80GiB, 40GB, or a name: " + ", ".join(GPUS))
    parser.add_argument("--model", choices=["conv_stack"], default="conv_stack",
                        help="conv_stack: the series' surrogate (Conv3d for a 3-D field)")
    parser.add_argument("--channels", type=int, default=16, help="hidden channels (conv_stack width)")
    parser.add_argument("--depth", type=int, default=3, help="convolution layers")
    parser.add_argument("--kernel-size", type=int, default=3)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    parser.add_argument("--json", help="write the per-rank rows and the verdict to this file")
    parser.add_argument("--measure", action="store_true",
                        help="measure the series' cases (notebooks 04, 05, 07; N = 1, 2, 4; DDP, FSDP2) on 4 ranks")
    parser.add_argument("--cases", help="with --measure: a JSON file of cases instead of the series' own")
    parser.add_argument("--ranks", type=int, default=4, help="with --measure: ranks to start")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.measure:
        return _measure_main(args, argv)

    try:
        field_shape = parse_field(args.field)
        capacity = parse_size(args.gpu) if args.gpu else None
    except ValueError as error:
        parser.error(str(error))
    try:
        model = conv_model(len(field_shape) - 2, args.channels, args.depth, args.kernel_size)
        planner = Planner(model, field_shape, DTYPES[args.dtype], args.optimizer,
                          name=f"conv_stack(width={args.channels}, depth={args.depth}, kernel={args.kernel_size})")
        result = planner.plan(args.ddp, args.domain, args.wrapper)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    v = _print_plan(planner, result, capacity)
    if args.json:
        out = result.as_json(capacity) | {"verdict": v}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _measure_main(args, argv) -> int:
    if detect_launch().launcher == "none":  # not under a launcher: start the ranks, with the same arguments
        argv = sys.argv[1:] if argv is None else list(argv)
        cmd = torchrun_command(args.ranks, "-m", "shardlab.plan", *argv)
        return subprocess.run(cmd, env=clean_environment(OMP_NUM_THREADS="1"), timeout=1800).returncode
    import torch.distributed as dist

    cases = json.loads(Path(args.cases).read_text()) if args.cases else None
    measurement = measure_cases(cases or series_cases(int(os.environ.get("WORLD_SIZE", "1"))), args.timeout)
    if dist.get_rank() == 0:
        rows = comparison_table(measurement)
        print(f"# planner vs measured, {measurement['world_size']} rank(s), backend {measurement['backend']}, "
              f"device {measurement['device']}")
        print(Table([r | {"error": f"{r['error']:+.2%}"} | ({"peak error": f"{r['peak error']:+.2%}"}
                                                            if "peak error" in r else {}) for r in rows]))
        if args.json:
            Path(args.json).write_text(json.dumps(measurement, indent=1))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
