"""Where a step's time goes on each rank: ``torch.profiler`` around a few steps, read back as intervals.

``summarize`` turns one rank's trace into what ``sl.plot.timeline`` draws and the shares a lesson reports; ``merge``
writes every rank's trace into one file that Perfetto and ``chrome://tracing`` open, a process per rank. Introduced in
``notebooks/14_see_every_rank.ipynb``. What a trace holds on gloo and on NCCL, and how the two all-reduces are told
apart: docs/performance.md#where-a-steps-time-goes.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .. import quiet

# What each collective is for in a domain-parallel step, by the words in its event's name, lower case and without
# underscores: gloo's and NCCL's host events (``gloo:all_to_all``, ``nccl:_reduce_scatter_base``) and NCCL's kernels
# (``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``, ``ncclDevKernel_SendRecv``: NCCL runs every send and receive, so
# ShardTensor's halo exchange, as one SendRecv kernel). The first kind that matches wins: a reduce-scatter is not a
# scatter.
KINDS = {
    "halo exchange": ("alltoall", "sendrecv", "send", "recv"),
    "all-reduce": ("allreduce",),
    "reduce-scatter / all-gather": ("reducescatter", "allgather"),
    "scatter / broadcast": ("broadcast", "scatter"),
}
# An all-reduce, by its caller: ShardTensor (the functional collectives, over the domain mesh), or DDP (over ddp).
SHARD_ALL_REDUCE, DDP_ALL_REDUCE = "all-reduce, ShardTensor (domain)", "all-reduce, DDP (ddp)"
FUNCTIONAL = "_c10d_functional::"  # the functional collectives' ops on the calling thread
ENQUEUE = "c10d::allreduce_"  # the op that hands an all-reduce to the process group, whoever called it
COMPUTE, IDLE = "compute", "idle"
# The order of the figure's legend.
COMMUNICATION = ("halo exchange", SHARD_ALL_REDUCE, DDP_ALL_REDUCE, "reduce-scatter / all-gather",
                 "scatter / broadcast")
BACKENDS = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")  # events of the communication threads and kernels
GPU_KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")  # the categories of a GPU's work in a Kineto trace
STEP = "step"  # the record_function name ``profile_steps`` puts around each step


def kind_of(name: str) -> str | None:
    """The communication kind of a collective's event name (``KINDS``), or None for anything else."""
    if not name.startswith(BACKENDS):
        return None
    lowered = name.lower().replace("_", "")
    return next((kind for kind, words in KINDS.items() if any(w in lowered for w in words)), None)


def union(spans) -> list[tuple[float, float]]:
    """Overlapping or touching (start, end) spans merged, sorted."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def minus(spans, taken) -> list[tuple[float, float]]:
    """The parts of ``spans`` that no span of ``taken`` covers (both merged first)."""
    out, taken = [], union(taken)
    for a, b in union(spans):
        for c, d in taken:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def clip(spans, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(a, start), min(b, end)) for a, b in spans if b > start and a < end]


def length(spans) -> float:
    return sum(b - a for a, b in union(spans))


def summarize(events: list[dict], rank: int, base_us: float = 0.0) -> dict:
    """One rank's trace events (the Chrome trace's ``traceEvents``) as a plain dict, in µs of the rank's wall clock
    (``base_us``: the trace's ``baseTimeNanoseconds`` / 1000, which its times count from):

    - ``steps``: each step's (start, end), from the host's ``record_function("step")`` spans (category
      ``user_annotation``: not their ``gpu_user_annotation`` copies on the GPU streams);
    - ``spans``: per kind of use (``COMMUNICATION`` kinds, then ``COMPUTE`` and ``IDLE``), the intervals of the steps
      it took; a collective in flight wins over compute that overlaps it (DDP's all-reduce runs during the backward),
      compute is the main thread inside an op or the GPU running a kernel, idle is neither;
    - ``collectives``: each collective that began in a step, as (kind, phase, start, end);
    - ``phases``: the step's other ``record_function`` spans (forward, backward, ...) as (name, start, end);
    - ``memory``: the allocator's total after each allocation or free, (time, bytes), when memory was profiled: the
      GPU's allocator on a GPU rank, the CPU's on a CPU rank.
    """
    events = [dict(e, ts=float(e["ts"]) + base_us) if "ts" in e else e for e in events]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # The host's step ranges only: with CUDA activities on, Kineto copies each record_function range onto every GPU
    # stream it covers, with the same name, as category "gpu_user_annotation".
    ranges = [e for e in spans if e.get("cat") == "user_annotation"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == STEP)
    if not steps:
        raise ValueError("no step in this trace: profile the steps with sl.measure.timeline.profile_steps (it puts "
                         "record_function('step') around each)")
    main = next(e["tid"] for e in ranges if e["name"] == STEP)
    window = (steps[0][0], steps[-1][1])
    gpu = [e for e in spans if e.get("cat") in GPU_KERNELS]
    on_gpu = any(kind_of(e["name"]) for e in gpu)  # NCCL: the transfers are kernels; the nccl: host events launch
    transfers = [(e, kind_of(e["name"])) for e in (gpu if on_gpu else spans) if kind_of(e["name"])]
    callers = _all_reduce_callers([e for e, kind in transfers if kind == "all-reduce"], spans)
    transfers = [(e, callers.get(id(e), DDP_ALL_REDUCE) if kind == "all-reduce" else kind) for e, kind in transfers]
    inside = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == main and e.get("cat") != "user_annotation"]
    inside += [(e["ts"], e["ts"] + e["dur"]) for e in gpu if not kind_of(e["name"])]  # the GPU computing
    steps_only = lambda s: [x for a, b in steps for x in clip(s, a, b)]  # noqa: E731
    by_kind, taken = {}, []
    for kind in COMMUNICATION:
        mine = steps_only([(e["ts"], e["ts"] + e["dur"]) for e, k in transfers if k == kind])
        by_kind[kind] = minus(mine, taken)
        taken += by_kind[kind]
    by_kind[COMPUTE] = minus(steps_only(inside), taken)
    by_kind[IDLE] = minus(steps, taken + by_kind[COMPUTE])
    named = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ranges
             if e["name"] != STEP and e["tid"] == main and not kind_of(e["name"])]  # nccl:... ranges launch, not phases
    # The step's own phases, not the annotations libraries put inside them (DistributedDataParallel.forward, ...).
    phases = sorted(p for p in named if not any(q is not p and q[1] <= p[1] and p[2] <= q[2] for q in named))
    # Each collective of the steps, by kind and the phase it began in: how many each caller ran, and when.
    collectives = sorted((k, next((n for n, a, b in phases if a <= e["ts"] <= b), "between phases"), e["ts"],
                          e["ts"] + e["dur"]) for e, k in transfers if any(a <= e["ts"] < b for a, b in steps))
    allocations = [e for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    device = max((e["args"].get("Device Type", 0) for e in allocations), default=0)  # 0: CPU; 1: CUDA
    memory = sorted((e["ts"], int(e["args"]["Total Allocated"])) for e in allocations
                    if e["args"].get("Device Type", 0) == device and window[0] <= e["ts"] <= window[1])
    return {"rank": rank, "steps": steps, "spans": by_kind, "phases": phases, "memory": memory,
            "collectives": collectives}


def _dims(event: dict):
    """The first input's shape, as the profiler recorded it (``record_shapes=True``), or None."""
    dims = event.get("args", {}).get("Input Dims")
    while isinstance(dims, list) and dims and isinstance(dims[0], list) and dims[0] and isinstance(dims[0][0], list):
        dims = dims[0]  # c10d's ops take a list of tensors: the first one's shape
    return tuple(dims[0]) if isinstance(dims, list) and dims and isinstance(dims[0], list) else None


def _all_reduce_callers(transfers: list[dict], spans: list[dict]) -> dict[int, str]:
    """``SHARD_ALL_REDUCE`` or ``DDP_ALL_REDUCE`` for each all-reduce's transfer (by ``id``): the host's
    ``c10d::allreduce_`` that handed it over, inside a functional collective (ShardTensor's) or not (DDP's), on the
    same host thread. Any host thread, not only the one that ran the step: on a GPU rank the backward, and the
    all-reduces its hooks start, run on the autograd engine's thread for that device (torch 2.14.1's
    ``torch/csrc/autograd/engine.h``, ``thread_init``, line 213, and ``start_device_threads``, lines 235-237: "device
    threads (CUDA, XLA, etc.) ... NOT the CPU thread"); on CPU ranks the backward runs on the calling thread.

    A GPU kernel names the host op that launched it (its "External id", Kineto's ``linkedActivity``,
    ``kineto/ITraceActivity.h`` line 47). A gloo worker's event names nothing: it is the oldest handover not yet
    matched that began before it, of the same shape when shapes were recorded (each group's queue runs in order; a
    shape tells apart a parameter's gradient from a DDP bucket, whose queues run side by side)."""
    host = [e for e in spans if e.get("cat") not in (*GPU_KERNELS, "gpu_user_annotation")]
    functional = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in host
                  if e["name"].startswith(FUNCTIONAL) and "all_reduce" in e["name"]]

    def caller(launch: dict) -> str:
        inside = any(tid == launch["tid"] and a <= launch["ts"] <= b for tid, a, b in functional)
        return SHARD_ALL_REDUCE if inside else DDP_ALL_REDUCE

    by_id = {e["args"]["External id"]: e for e in host if "External id" in e.get("args", {})}
    handovers = sorted((e for e in host if e["name"] == ENQUEUE), key=lambda e: e["ts"])
    found, used = {}, set()
    for t in sorted(transfers, key=lambda e: e["ts"]):
        launched = by_id.get(t.get("args", {}).get("External id")) if t.get("cat") in GPU_KERNELS else None
        if launched is not None:
            found[id(t)] = caller(launched)
            continue
        before = [h for h in handovers if id(h) not in used and h["ts"] <= t["ts"]]
        same = [h for h in before if _dims(h) is not None and _dims(h) == _dims(t)]
        if chosen := (same or before or [None])[0]:
            used.add(id(chosen))
            found[id(t)] = caller(chosen)
    return found


def shares(summary: dict) -> dict[str, float]:
    """The fraction of its steps' time a rank spent on each kind of use (they add up to 1)."""
    total = sum(b - a for a, b in summary["steps"])
    return {kind: length(spans) / total for kind, spans in summary["spans"].items()}


def communication_share(summary: dict) -> float:
    """The fraction of its steps' time a rank had a collective in flight."""
    return sum(v for k, v in shares(summary).items() if k in COMMUNICATION)


def step_seconds(summary: dict) -> list[float]:
    return [(b - a) / 1e6 for a, b in summary["steps"]]


def memory_peak(summary: dict) -> dict:
    """The allocator's highest total in the profiled steps, when it happened (µs after the first step began) and
    the phase it happened in."""
    if not summary["memory"]:
        return {}
    when, peak = max(summary["memory"], key=lambda m: m[1])
    phase = next((name for name, a, b in summary["phases"] if a <= when <= b), "between phases")
    return {"bytes": peak, "at_us": when - summary["steps"][0][0], "phase": phase}


# What Kineto (the profiler's engine) writes to stderr at every start and stop, and, without a GPU, that it found
# none: every rank's cell output would be a screen of it, with nothing to act on.
def without_kineto_chatter():
    """For a ``torch.profiler.profile`` block: standard error (the file descriptor: Kineto writes from C++) as it
    was, less Kineto's known lines (``quiet.KINETO_CHATTER``)."""
    return quiet.stderr_without(quiet.KINETO_CHATTER)


def profile_steps(step, steps: int = 2, folder=None, memory: bool = False) -> dict:
    """On every rank together: ``step(i)`` for i in range(steps) under ``torch.profiler`` (CPU activity, and CUDA's
    on a GPU rank; shapes recorded, which tell the all-reduces' callers apart), each inside
    ``record_function("step")`` and, on a GPU rank, ending when the GPU has finished it (a step's span is then its
    wall time, not the time to queue its kernels), after a barrier so that the ranks start together.
    Writes this rank's Chrome trace to ``folder/rank-<r>.json`` when ``folder`` is given; returns ``summarize`` of it.
    ``memory``: record every allocation and free (slower; what the memory timeline needs)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    rank = dist.get_rank()
    dist.barrier()
    with without_kineto_chatter(), profile(activities=activities, record_shapes=True, profile_memory=memory) as prof:
        for i in range(steps):
            with record_function(STEP):
                step(i)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
    if folder is not None:
        path = Path(folder) / f"rank-{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        path = Path(tempfile.mkstemp(suffix=".json")[1])
    prof.export_chrome_trace(str(path))
    try:
        return read(path, rank)
    finally:
        if folder is None:
            os.unlink(path)


def read(path, rank: int) -> dict:
    """``summarize`` of the Chrome trace a profiler exported to ``path`` (``export_chrome_trace``), on its rank's
    wall clock."""
    trace = json.loads(Path(path).read_text())
    return summarize(trace["traceEvents"], rank, int(trace.get("baseTimeNanoseconds", 0)) / 1000)


def merge(folder, out) -> Path:
    """Every ``rank-<r>.json`` in ``folder`` as one Chrome trace, ``out``: each rank a process named "rank r", its
    threads as the profiler named them, on a common clock. Perfetto (ui.perfetto.dev: Open trace file) and
    ``chrome://tracing`` (Load) open it."""
    folder, merged = Path(folder), []
    files = sorted(folder.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not files:
        raise FileNotFoundError(f"no rank-<r>.json in {folder}: pass the folder given to profile_steps")
    for path in files:
        rank = int(path.stem.split("-")[1])
        trace = json.loads(path.read_text())
        base = int(trace.get("baseTimeNanoseconds", 0)) / 1000  # the exported ts are µs after this moment
        for e in trace["traceEvents"]:
            if "ts" in e:
                e = dict(e, ts=float(e["ts"]) + base)
            merged.append(dict(e, pid=f"rank {rank}"))
        merged.append({"ph": "M", "name": "process_name", "pid": f"rank {rank}", "args": {"name": f"rank {rank}"}})
        merged.append({"ph": "M", "name": "process_sort_index", "pid": f"rank {rank}", "args": {"sort_index": rank}})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return out


def scaling(make_model, heights: dict[int, int], width: int = 64, steps: int = 3) -> list[dict]:
    """On every rank together: for each domain size N of ``heights`` ({N: the field's height at N}, each N dividing
    the world size), a (world/N, N) mesh, ``make_model()`` on this rank's device wrapped in DDP on ``ddp``, one
    random (1, 1, height, width) field per replica scattered over ``domain`` (a plain tensor at N = 1), one step to
    warm up, then ``steps`` profiled steps. Rows of this rank: N, rows per rank, the median step in seconds, the
    share of the steps with a collective in flight, and that share by kind (``kinds``)."""
    import statistics

    import torch
    import torch.distributed as dist
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ..mesh import domain_source
    from ..ranks.launch import default_device
    from ..train import wrap

    device, world, rows = default_device(), dist.get_world_size(), []
    for n, height in sorted(heights.items()):
        if world % n:
            raise ValueError(f"domain size {n} does not divide the world size {world}: use N among the divisors")
        mesh = init_device_mesh(device.type, (world // n, n), mesh_dim_names=("ddp", "domain"))
        generator = torch.Generator().manual_seed(mesh.get_coordinate()[0])  # a field per replica
        field = torch.randn(1, 1, height, width, generator=generator).to(device)
        x = field if n == 1 else scatter_tensor(field, domain_source(mesh), mesh["domain"], (Shard(2),))
        model = wrap(make_model().to(device), mesh, "ddp")
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(_, model=model, optimizer=optimizer, x=x):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        step(0)
        summary = profile_steps(step, steps)
        rows.append({"N": n, "rows per rank": -(-height // n), "step_s": statistics.median(step_seconds(summary)),
                     "communication": communication_share(summary),
                     "kinds": {k: v for k, v in shares(summary).items() if k in COMMUNICATION}})
    return rows


def across_ranks(per_rank: list[list[dict]], strong: bool) -> list[dict]:
    """Every rank's ``scaling`` rows as one table: per N, the slowest rank's median step (a step ends when its
    slowest rank's does), the ranks' mean share with a collective in flight (and by kind), and the ideal step from the
    first N:
    t·N₀/N in strong scaling (one field), t in weak scaling (the field grows with N)."""
    rows = [{"N": mine[0]["N"], "rows per rank": mine[0]["rows per rank"], "step_s": max(r["step_s"] for r in mine),
             "communication": sum(r["communication"] for r in mine) / len(mine),
             "kinds": {k: sum(r.get("kinds", {}).get(k, 0.0) for r in mine) / len(mine) for k in COMMUNICATION}}
            for mine in zip(*per_rank)]
    for r in rows:
        r["ideal_s"] = rows[0]["step_s"] * (rows[0]["N"] / r["N"] if strong else 1)
    return rows
