"""gpu-check's rows for lessons 12-14: what each runs on the node's GPUs, and how it is judged.

- ``loading-memory`` (12): one sample loaded as ShardTensors, by slab and by ``scatter_tensor``, on CUDA ranks: the
  bytes each rank holds, beside the CUDA allocator's peak during the load;
- ``timeline`` (14): notebook 14's step, two profiled steps on every rank: NCCL's kernels on the GPU streams, each
  rank's shares summing to 1, the halo exchange and both callers' all-reduces found in them;
- ``flight-record`` (14): the last rank held back from a collective the others enter; every rank's Flight Recorder
  (NCCL's own recorder on CUDA ranks) read after the failure, and ``sl.measure.flight.waits`` naming that rank;
- ``transolver-parity`` (13): Transolver run domain-parallel on every GPU of the node against one process, float64.

Each ``run_*`` returns (result, passed) and passes only on CUDA ranks: CPU ranks run the same programs (the tests do),
and fail here, saying so. ``gpucheck`` plans them, bounds them and writes them down.
"""

from __future__ import annotations

import time

from .. import model_cases, parity
from ..measure import flight
from ..ranks.launch import run_job

# The last rank never enters the all-reduce. On NCCL the collective only queues on the waiting ranks: the .item()
# waits for it, and the next collective raises once the watchdog aborted the communicator (notebook 14, section 5).
HELD_BACK = """\
import torch, torch.distributed as dist
import shardlab as sl
x = torch.ones(1, device=sl.ranks.launch.default_device())
if dist.get_rank() != dist.get_world_size() - 1:
    dist.all_reduce(x)
    x.item()
    dist.all_reduce(x)
"""
READ_RECORDS = """\
import torch.distributed as dist
import shardlab as sl
records, backend = sl.measure.flight.entered(), dist.get_backend()  # not a collective: works on a broken group
"""


def on_cuda(device: str, label: str) -> bool:
    """Whether a job ran on CUDA ranks: the device its ranks reported and the placement it was started with."""
    return str(device).startswith("cuda") and "CUDA" in label


def run_loading_memory(ranks: int, sizes: list[int], timeout_s: float) -> tuple[str, bool]:
    job = run_job("torchrun", ranks, "shardlab.measure", ["loading-memory", "--sizes", *map(str, sizes)],
                  timeout_s=timeout_s)
    report, label = job.result["loading-memory"], job.placement.label
    return judge_loading_memory(report, label)


def judge_loading_memory(report: dict, label: str) -> tuple[str, bool]:
    """Slab loading holds exactly 1/N of the two fields per rank; on a GPU every row has the allocator's peak."""
    rows = report["rows"]
    cells = [f"N={r['N']} {r['loading']}: held {r['held/(fields/N)']:.2f} x fields/N, CUDA peak "
             + (f"{r['cuda_peak_above_start_max_rank']} B" if "cuda_peak_above_start_max_rank" in r else "not measured")
             for r in rows]
    ok = (on_cuda(report["device"], label) and bool(rows) and all("cuda_peak_above_start_max_rank" in r for r in rows)
          and all(r["held/(fields/N)"] == 1.0 for r in rows if r["loading"] == "slab"))
    return f"on {label}: " + "; ".join(cells), ok


def run_timeline(ranks: int, timeout_s: float) -> tuple[str, bool]:
    job = run_job("torchrun", ranks, "shardlab.measure", ["timeline"], timeout_s=timeout_s)
    return judge_timeline(job.result["timeline"], job.placement.label)


def judge_timeline(report: dict, label: str) -> tuple[str, bool]:
    """Every rank's two steps: shares summing to 1, a halo exchange, ShardTensor's all-reduces, DDP's where ddp > 1,
    and the collectives' transfers read from ``ncclDevKernel_*`` kernels (on a GPU rank)."""
    rows, ddp = report["rows"], report["world_size"] // 2
    good = [abs(r["shares_sum"] - 1) < 1e-6 and r["halo exchange"] > 0 and r["ShardTensor all-reduces"] > 0
            and (ddp == 1 or r["DDP all-reduces"] > 0) and r["NCCL kernels"] > 0 for r in rows]
    cells = [f"rank {r['rank']}: steps {', '.join(f'{1e3 * s:.1f}' for s in r['steps_s'])} ms, "
             f"{100 * r['communication']:.0f} % comm., {r['ShardTensor all-reduces']} + {r['DDP all-reduces']} "
             f"all-reduces, {r['NCCL kernels']} NCCL kernels" for r in rows]
    return f"on {label}: " + "; ".join(cells), on_cuda(report["device"], label) and bool(rows) and all(good)


def run_flight_record(ranks: int, collective_timeout_s: float, timeout_s: float) -> tuple[str, bool]:
    """``ranks`` engines; the last is held back from an all-reduce the others enter. After the cell fails, each
    rank's record is read (no collective) and compared."""
    from ..ranks.cluster import RankCluster

    t0 = time.monotonic()
    with RankCluster(n=ranks, timeout_s=collective_timeout_s, start_timeout_s=timeout_s) as cluster:
        left = lambda: max(timeout_s - (time.monotonic() - t0), 1)  # noqa: E731
        try:
            cluster.run(HELD_BACK, timeout_s=left(), what="fail the collective the last rank skips")
        except Exception:  # the waiting ranks' CompositeError (or our time-out): what the records explain
            pass
        cluster.run(READ_RECORDS, timeout_s=left(), what="read every rank's Flight Recorder")
        records = dict(enumerate(cluster.view.pull("records", block=True)))
        backends = sorted(set(cluster.view.pull("backend", block=True)))
        return judge_flight_record(records, backends, cluster.device, cluster.placement.label)


def judge_flight_record(records: dict, backends: list[str], device: str, label: str) -> tuple[str, bool]:
    last = max(records)
    found = flight.waits(records)
    said = " ".join(w.sentence() for w in found) or "the records part nowhere"
    ok = (device == "cuda" and backends == ["nccl"] and all(records.values()) and len(found) == 1
          and found[0].missing == (last,) and found[0].waiting == tuple(range(last)))
    return f"on {label}, backend {backends}: {said}"[:400], ok


def run_transolver_parity(ranks: int, timeout_s: float) -> tuple[str, bool]:
    [row] = parity.run([model_cases.ref(model_cases.transolver)], ranks=ranks, timeout_s=timeout_s)
    return judge_transolver_parity(row)


def judge_transolver_parity(row: dict) -> tuple[str, bool]:
    """Output and every gradient within ``parity.TOLERANCE`` of one process, on an even and an uneven split."""
    runs = row.get("parity", [])
    cells = [f"{r['split']} split at {r['size']}: " + (r["error"][:120] if "error" in r else
                                                        f"output {r['output']:.1e}, gradient {r['gradient']:.1e}")
             for r in runs]
    good = [("error" not in r and r["output"] <= parity.TOLERANCE and r["gradient"] <= parity.TOLERANCE) for r in runs]
    ok = (row["device"] == "cuda" and not row["problems"] and all(good)
          and sorted(r["split"] for r in runs) == ["even", "uneven"])
    return (f"{row['ranks']} {row['device'].upper()} ranks, domain {row['domain']}: " + "; ".join(cells)
            + "".join(f"; {p}" for p in row["problems"]))[:400], ok

