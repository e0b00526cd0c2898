"""What a plan says: the categories, one rank's bytes (``RankBytes``), a layout's plan (``Plan``) and the headroom
kept for what the meta device cannot see (``LEFT_OUT``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..levers import NO_LEVERS, Levers
from ..report import Table
from .inputs import GiB, fmt_bytes

# How a plan's rows were found: the conv planner replays a step on the meta device (``trace``); a parity case, whose
# ShardTensor operations need a process group, is measured at two small sizes on ranks and extrapolated (``cases``).
METHODS = {"meta replay": "one training step replayed on the meta device, on each rank's slice",
           "measured ×2, extrapolated": "one training step measured on ranks at two small sizes, per element"}
CATEGORIES = ("params", "grads", "optimizer", "activations", "transient", "buffers", "temporaries")
ACCOUNTED = ("params", "grads", "optimizer", "activations", "transient", "buffers")  # what CPU ranks measure exactly
# What "buffers" holds, per wrapper. FSDP2 keeps two units' all-gathers at once: it prefetches the next unit's in
# backward by default, and in forward keeps the previous unit's flat output until the next copy-out.
BUFFERS = {"none": "buffers", "ddp": "DDP buckets", "fsdp2": "FSDP2 gathered, 2 units"}

# How cuDNN chooses convolution engines where the planner's peak is checked against the allocator's and where it
# measures a workspace (set, and restored after, by ``plan.workspace.pinned_cudnn``, around every ``measure_rank`` and
# every ``CUDAWorkspace`` run). benchmark=False: the engine cuDNN's heuristics rank first for the shapes, and no find
# step (which allocates the largest candidate workspace that fits the largest free cached block: a spike that depends
# on what the cache holds). deterministic=True: no engine cuDNN marks non-deterministic (Conv_v8.cpp's
# filterEngineConfigs), so results, like bytes, repeat from run to run. enabled=True: cuDNN, not torch's own CUDA
# convolutions, whose im2col columns are a workspace of the field's size. Not CUDNN_CONV_WSCAP_DBG: torch 2.14 never
# reads it (not in its sources nor in libtorch_cuda.so; its documentation lists it as cuDNN's own), which of cuDNN 9's
# paths it caps cannot be read from its libraries, and it is an environment variable of the library, not a setting one
# case can set and restore.
CUDNN_PINNED = {"enabled": True, "benchmark": False, "deterministic": True}
TORCH_SOURCE = "https://github.com/pytorch/pytorch/blob/5c4886908584029761b579af026dcfb627c84070"  # 2.14.1

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
    {"what": "cuDNN convolution workspaces", "bytes": 0,
     "typical": "the workspace of the engine cuDNN's heuristics pick for each convolution's shapes, allocated for "
                "the call: inside max_memory_allocated when a convolution runs at the step's peak. In the plan, "
                "measured on the GPU, when it is made where a GPU is visible (plan.workspace.CUDAWorkspace); in the "
                "10 % above otherwise (the meta device runs no engine). With cudnn.benchmark=True the first call of "
                "each shape also allocates the largest candidate's workspace that fits the largest free cached block, "
                "to time them; where the planner's peak is measured (validate.measure_rank) cuDNN is pinned to "
                + ", ".join(f"{k}={v}" for k, v in CUDNN_PINNED.items()) + " and restored after",
     "source": f"{TORCH_SOURCE}/aten/src/ATen/native/cudnn/Conv_v8.cpp (run_conv_plan; with benchmark: "
               "generate_and_filter_plans)"},
    {"what": "cuBLAS workspaces", "bytes": 0,
     "typical": "one per cuBLAS handle and stream, from the caching allocator at its first matmul, then kept: "
                "CUBLAS_WORKSPACE_CONFIG, by default :4096:2:16:8 (8.1 MiB), 32 MiB on Hopper; none in the planner's "
                "peak cases, whose conv stacks call no cuBLAS (convolutions run in cuDNN, Adam in foreach kernels)",
     "source": f"{TORCH_SOURCE}/aten/src/ATen/cuda/CublasHandlePool.cpp (getChosenWorkspaceSize, "
               "setWorkspaceForHandle); https://github.com/pytorch/pytorch/pull/120925"},
)


def headroom(need: int, world_size: int) -> int:
    """Bytes kept free beside ``need`` for what the planner cannot see (``LEFT_OUT``) on a job of ``world_size``."""
    extra = 0
    for item in LEFT_OUT:
        if item.get("multi_rank_only") and world_size == 1:
            continue
        extra += item.get("bytes", 0) + item.get("fraction", 0.0) * need
    return int(extra)


@dataclass
class RankBytes:
    """One rank's bytes by category: predicted by the planner, or measured on the rank (``measure_rank``)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    halos: int  # the part of the activations that are rows beyond the rank's own
    transient: int  # scatter loading: the whole field this rank receives; slab loading: 0
    buffers: int
    temporaries: int = 0  # predicted: the rest of the step's peak
    peak: int | None = None  # predicted: the step's peak; measured: the allocator's (CPU: profiler events; GPU: CUDA)
    rows: int | None = None  # rows of the sharded dim this rank holds
    method: str | None = None  # predicted: how (``METHODS``); measured: None

    @property
    def accounted(self) -> int:
        return sum(getattr(self, c) for c in ACCOUNTED)

    @property
    def total(self) -> int:
        return self.accounted + self.temporaries

    def as_dict(self) -> dict:
        return asdict(self) | {"accounted": self.accounted, "total": self.total}

    @classmethod
    def from_dict(cls, row: dict) -> RankBytes:
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})


@dataclass
class Plan:
    """Predicted bytes per rank for one layout; ``rows[r]`` is rank r (``rank = ddp index × domain + domain index``,
    the order of ``initialize_mesh((ddp, domain), ...)``)."""

    rows: list[RankBytes]
    field_shape: tuple
    dtype: str
    ddp: int
    domain: int
    wrapper: str
    optimizer: str
    model: str = "model"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    levers: Levers = NO_LEVERS
    loading: str = "scatter"  # how each rank got its batch: ``inputs.LOADINGS``
    method: str = "meta replay"  # how its rows were planned: ``METHODS``

    @property
    def world_size(self) -> int:
        return self.ddp * self.domain

    def largest(self) -> RankBytes:
        """The rank that needs the most: the one that decides whether the layout fits."""
        return max(self.rows, key=lambda r: (r.total, -r.rank))

    def headroom(self, need: int | None = None) -> int:
        """Bytes kept free for what the planner cannot see (``LEFT_OUT``), for this layout."""
        return headroom(self.largest().total if need is None else need, self.world_size)

    def groups(self) -> list[tuple[str, RankBytes]]:
        """Ranks with the same bytes merged: (label such as "ranks 0-7", one of their rows), in rank order."""
        keys = (*CATEGORIES, "halos")
        out: list[tuple[list[int], RankBytes]] = []
        for row in self.rows:
            if out and all(getattr(out[-1][1], k) == getattr(row, k) for k in keys):
                out[-1][0].append(row.rank)
            else:
                out.append(([row.rank], row))
        return [(f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}", row) for r, row in out]

    def bars(self) -> dict[str, dict[str, int]]:
        """Stacked categories per group of equal ranks, for ``sl.plot.memory_bars`` (own rows and halos apart)."""
        return {label: {"params": r.params, "grads": r.grads, "optimizer": r.optimizer,
                        "activations": r.activations - r.halos, "halos": r.halos, "transient": r.transient,
                        BUFFERS[self.wrapper]: r.buffers, "temporaries": r.temporaries}
                for label, r in self.groups()}

    def table(self) -> Table:
        """Per group of equal ranks, in readable units."""
        columns = [*CATEGORIES[:4], "halos", *CATEGORIES[4:], "total"]
        names = [BUFFERS[self.wrapper] if c == "buffers" else c for c in columns]
        return Table([{"ranks": label.removeprefix("ranks ").removeprefix("rank ")}
                      | {name: fmt_bytes(getattr(row, c)) for name, c in zip(names, columns)}
                      | {"method": row.method or self.method}
                      for label, row in self.groups()], ["ranks", *names, "method"])

    def as_json(self, capacity: int | None = None) -> dict:
        out = {"model": self.model, "field": list(self.field_shape), "dtype": self.dtype,
               "mesh": {"ddp": self.ddp, "domain": self.domain}, "wrapper": self.wrapper, "optimizer": self.optimizer,
               "levers": self.levers.label, "loading": self.loading, "method": self.method,
               "rows": [r.as_dict() for r in self.rows], "left_out": [dict(item) for item in LEFT_OUT],
               "notes": list(self.notes)}
        if capacity is not None:
            out["gpu_bytes"] = capacity
        return out
