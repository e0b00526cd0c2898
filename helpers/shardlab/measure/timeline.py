"""Where a step's time goes on each rank: ``torch.profiler`` around a few steps, read back as intervals.

A rank's trace (the Chrome trace the profiler exports, one per rank) holds two kinds of events that matter here:
what the rank's main thread ran (ops, and the ``record_function`` phases a step names), and the collectives the
process group's own threads carried (``gloo:all_reduce``, ``nccl:all_reduce`` ...). A collective's event lasts from
when its group's thread took it up to when every member had taken part: transfer plus waiting for the slowest
member. ``summarize`` turns one rank's trace into what ``sl.plot.timeline`` draws and the shares a lesson reports;
``merge`` writes every rank's trace into one file that Perfetto and ``chrome://tracing`` open, a process per rank.

The traces' clocks are the ranks' wall clocks: on one machine they agree; across nodes, as well as the nodes' clocks
agree. Introduced in ``notebooks/14_see_every_rank.ipynb``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

# What each collective is for in a domain-parallel step, by the words in its event's name (gloo's and NCCL's
# events, c10d's ops); the order is the order of the figure's legend.
KINDS = {
    "halo exchange": ("all_to_all", "alltoall", "sendrecv", "send", "recv"),
    "all-reduce": ("all_reduce", "allreduce"),
    "reduce-scatter / all-gather": ("reduce_scatter", "allgather", "all_gather"),
    "scatter / broadcast": ("broadcast", "scatter"),
}
COMPUTE, IDLE = "compute", "idle"
COMMUNICATION = tuple(KINDS)
BACKENDS = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")  # events of the communication threads and kernels
STEP = "step"  # the record_function name ``profile_steps`` puts around each step


def kind_of(name: str) -> str | None:
    """The communication kind of a collective's event name, or None for anything else."""
    if not name.startswith(BACKENDS):
        return None
    lowered = name.lower()
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

    - ``steps``: each step's (start, end), from the ``record_function("step")`` spans;
    - ``spans``: per kind of use (``COMMUNICATION`` kinds, then ``COMPUTE`` and ``IDLE``), the intervals of the steps
      it took; a collective in flight wins over compute that overlaps it (DDP's all-reduce runs during the backward),
      compute is the main thread inside an op, idle is neither;
    - ``phases``: the step's other ``record_function`` spans (forward, backward, ...) as (name, start, end);
    - ``memory``: the allocator's total after each allocation or free, (time, bytes), when memory was profiled: the
      GPU's allocator on a GPU rank, the CPU's on a CPU rank.
    """
    events = [dict(e, ts=float(e["ts"]) + base_us) if "ts" in e else e for e in events]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == STEP)
    if not steps:
        raise ValueError("no step in this trace: profile the steps with sl.measure.timeline.profile_steps (it puts "
                         "record_function('step') around each)")
    main = next(e["tid"] for e in spans if e["name"] == STEP)
    window = (steps[0][0], steps[-1][1])
    inside = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == main and e.get("cat") != "user_annotation"]
    steps_only = lambda s: [x for a, b in steps for x in clip(s, a, b)]  # noqa: E731
    by_kind, taken = {}, []
    for kind in COMMUNICATION:
        mine = steps_only([(e["ts"], e["ts"] + e["dur"]) for e in spans if kind_of(e["name"]) == kind])
        by_kind[kind] = minus(mine, taken)
        taken += by_kind[kind]
    by_kind[COMPUTE] = minus(steps_only(inside), taken)
    by_kind[IDLE] = minus(steps, taken + by_kind[COMPUTE])
    named = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in spans
             if e.get("cat") == "user_annotation" and e["name"] != STEP and e["tid"] == main]
    # The step's own phases, not the annotations libraries put inside them (DistributedDataParallel.forward, ...).
    phases = sorted(p for p in named if not any(q is not p and q[1] <= p[1] and p[2] <= q[2] for q in named))
    allocations = [e for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    device = max((e["args"].get("Device Type", 0) for e in allocations), default=0)  # 0: CPU; 1: CUDA
    memory = sorted((e["ts"], int(e["args"]["Total Allocated"])) for e in allocations
                    if e["args"].get("Device Type", 0) == device and window[0] <= e["ts"] <= window[1])
    return {"rank": rank, "steps": steps, "spans": by_kind, "phases": phases, "memory": memory}


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
_KINETO_CHATTER = re.compile(r"^(USDT|ERROR):\S+ \S+ \S+ (SyncActivityProfilerHandler|DeviceProperties)\.cpp")


@contextlib.contextmanager
def _without_kineto_chatter():
    """Standard error (the file descriptor: Kineto writes from C++) as it was, less ``_KINETO_CHATTER``'s lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_CHATTER.match(line)]
            sys.stderr.write("".join(kept))


def profile_steps(step, steps: int = 2, folder=None, memory: bool = False) -> dict:
    """On every rank together: ``step(i)`` for i in range(steps) under ``torch.profiler`` (CPU activity, and CUDA's
    on a GPU rank), each inside ``record_function("step")``, after a barrier so that the ranks start together.
    Writes this rank's Chrome trace to ``folder/rank-<r>.json`` when ``folder`` is given; returns ``summarize`` of it.
    ``memory``: record every allocation and free (slower; what the memory timeline needs)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    rank = dist.get_rank()
    dist.barrier()
    with _without_kineto_chatter(), profile(activities=activities, profile_memory=memory) as prof:
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
        trace = json.loads(path.read_text())
        return summarize(trace["traceEvents"], rank, int(trace.get("baseTimeNanoseconds", 0)) / 1000)
    finally:
        if folder is None:
            os.unlink(path)


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
    out.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return out


def scaling(make_model, heights: dict[int, int], width: int = 64, steps: int = 3) -> list[dict]:
    """On every rank together: for each domain size N of ``heights`` ({N: the field's height at N}, each N dividing
    the world size), a (world/N, N) mesh, ``make_model()`` on this rank's device wrapped in DDP on ``ddp``, one
    random (1, 1, height, width) field per replica scattered over ``domain`` (a plain tensor at N = 1), one step to
    warm up, then ``steps`` profiled steps. Rows of this rank: N, rows per rank, the median step in seconds, and the
    share of the steps with a collective in flight."""
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
                     "communication": communication_share(summary)})
    return rows


def across_ranks(per_rank: list[list[dict]], strong: bool) -> list[dict]:
    """Every rank's ``scaling`` rows as one table: per N, the slowest rank's median step (a step ends when its
    slowest rank's does), the ranks' mean share with a collective in flight, and the ideal step from the first N:
    t·N₀/N in strong scaling (one field), t in weak scaling (the field grows with N)."""
    rows = [{"N": mine[0]["N"], "rows per rank": mine[0]["rows per rank"], "step_s": max(r["step_s"] for r in mine),
             "communication": sum(r["communication"] for r in mine) / len(mine)} for mine in zip(*per_rank)]
    for r in rows:
        r["ideal_s"] = rows[0]["step_s"] * (rows[0]["N"] / r["N"] if strong else 1)
    return rows
