"""What only GPUs prove, in one command: ``python -m shardlab.gpucheck [--json FILE]`` (``make gpu-check``).

CPU ranks rehearse the program; this runs, on the GPUs this machine has, what they cannot show. Which rows a
GPU count can run is ``plan(gpus)`` (``--plan N`` prints it for N GPUs without running anything):

- with 2+ GPUs: the smoke test under torchrun with NCCL, one rank per GPU, every check; every notebook on CUDA
  engines (from a checkout of the repository: the notebooks are not part of the package); a collective that one
  rank skips ending in an error within ``timeout_s``;
- with 1+ GPU: the memory tables with the CUDA allocator's peak per rank beside the byte model, the planner's
  prediction against ``max_memory_allocated``, eager vs compiled step time and the TF32 error, on as many CUDA
  ranks as the count allows (one GPU: one CUDA rank, ``devices.place_ranks``).

Each row has its own time budget, says on what it really ran (a row that ran on CPU ranks fails), and is judged;
the JSON file is rewritten after every row. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import procs
from .devices import place_ranks, visible_gpus
from .launch import clean_environment, run_job
from .plan import gpu_check as plan_gpu_check
from .px import rank_errors, summarize_rank_errors
from .report import Table
from .smoke import run_smoke

CHECKOUT = Path(__file__).resolve().parents[2]  # helpers/shardlab/gpucheck.py in a checkout of the repository
COLLECTIVE_TIMEOUT_S = 10
# Rank 1 never enters the all-reduce. gloo's all_reduce itself raises after the timeout; on NCCL the watchdog
# aborts the communicator (workarounds.nccl_errors_raise) and the next collective raises.
SKIPPED_COLLECTIVE = """\
import torch, torch.distributed as dist
import shardlab as sl
x = torch.ones(1, device=sl.launch.default_device())
if dist.get_rank() == 0:
    dist.all_reduce(x)
    x.item()
    dist.all_reduce(x)
"""
TF32_HARDWARE_ERROR = 1e-4  # TF32 keeps 10 mantissa bits: a conv stack's relative error is ~1e-3, fp32's ~1e-7
STRICT_FP32_ERROR = 1e-5


def memory_sizes(gpus: int) -> list[int]:
    """Domain (or ddp) sizes the memory tables measure on ``gpus`` GPUs: 1, 2, 4 and 8 where they divide it."""
    return [n for n in (1, 2, 4, 8) if n <= gpus and gpus % n == 0]


def plan(gpus: int) -> list[dict]:
    """The rows ``make gpu-check`` runs on ``gpus`` GPUs: check, on (what it runs on), GPUs it needs, budget_s, and
    whether it runs here. The ranks and device come from ``devices.place_ranks``, as for every job."""
    sizes = memory_sizes(gpus) or [1]
    ddp_sizes = [n for n in sizes if n > 1] or [1]  # state bytes at ddp=1 are DDP's by definition

    def on(ranks: int, needs: int) -> str:
        return place_ranks(ranks, gpus).label if gpus >= needs else f"needs {needs}+ GPU{'s' if needs > 1 else ''}"

    rows = [
        ("smoke", "smoke under torchrun, NCCL, one rank per GPU, every check", max(gpus, 2), 2, 240),
        ("notebooks", "every notebook on CUDA engines, one per GPU (from the checkout)", max(gpus, 2), 2, 1200),
        ("skipped-collective", f"a collective rank 1 skips ends in an error within {COLLECTIVE_TIMEOUT_S} s, "
                               "naming rank 1", 2, 2, 240),
        ("activation-memory", f"activation memory per rank: CUDA peak beside saved bytes, N in {sizes}", max(sizes),
         1, 300),
        ("state-memory", f"state bytes per rank: CUDA peaks beside the byte model, ddp in {ddp_sizes}", max(sizes),
         1, 300),
        ("planner", "memory planner: predicted step peak within 10 % of max_memory_allocated per rank, the CPU "
                    "ranks' peak configurations 16x larger (2-D, 3-D, DDP, FSDP2, checkpointing, bf16, domain "
                    f"{sorted({1, 2, 4} & {n for n in sizes if max(gpus, 1) % n == 0}) or [1]})",
         max(gpus, 1), 1, 400),
        ("compile-speed", "eager vs compiled step time, synchronised: compiled faster", 1, 1, 300),
        ("tf32-error", f"TF32 error of a conv stack vs fp64, and below {STRICT_FP32_ERROR:g} inside strict_fp32", 1,
         1, 120),
    ]
    return [{"name": name, "check": check, "on": on(ranks, needs), "ranks": ranks, "needs": needs,
             "budget_s": budget, "runs": gpus >= needs} for name, check, ranks, needs, budget in rows]


def checkout_notebooks() -> Path:
    """The notebooks folder of the checkout this package runs from; a clear error for an installed copy."""
    folder = CHECKOUT / "notebooks"
    if not folder.is_dir():
        raise FileNotFoundError(f"no notebooks/ folder next to {Path(__file__).parent}: the notebooks are not part of "
                                "the installed package. Run `make gpu-check` from a checkout of the repository.")
    return folder


def _measure(table: str, ranks: int, sizes: list[int], timeout_s: float) -> tuple[dict, str]:
    """A measure table from a job of ``ranks`` and what the job really ran on."""
    args = [table, "--sizes", *map(str, sizes)]
    job = run_job("torchrun", ranks, "shardlab.measure", args, timeout_s=timeout_s)
    return job.result[table], job.placement.label


def _on_cuda(report: dict, label: str) -> bool:
    return str(report["device"]).startswith("cuda") and "CUDA" in label


def run_row(row: dict, gpus: int) -> tuple[str, bool]:
    """Run one planned row within its budget: (result, passed)."""
    name, budget, sizes = row["name"], row["budget_s"], memory_sizes(gpus) or [1]
    if name == "smoke":
        report = run_smoke("torchrun", n=row["ranks"], domain=2 if gpus % 2 == 0 else 1, timeout_s=budget)
        backends = sorted({r["backend"] for r in report["ranks"]})
        devices = sorted({r["device"].split(":")[0] for r in report["ranks"]})
        return (f"{report['world_size']} ranks, backend {backends}, devices {devices}, mesh {report['mesh']}",
                report["ok"] and backends == ["nccl"] and devices == ["cuda"])
    if name == "notebooks":
        notebooks = sorted(map(str, checkout_notebooks().glob("*.ipynb")))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", "--nbmake-timeout=600",
               "-o", "addopts=", *notebooks]
        env = clean_environment(SHARDLAB_RANKS=str(row["ranks"]))
        proc = procs.run_process_group(cmd, env, budget, "pytest --nbmake notebooks/")
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        return f"{len(notebooks)} notebooks from {checkout_notebooks()}: {summary}", proc.returncode == 0
    if name == "skipped-collective":
        return skipped_collective(budget)
    if name in ("activation-memory", "state-memory"):
        table_sizes = sizes if name == "activation-memory" else ([n for n in sizes if n > 1] or [1])  # as plan()
        report, label = _measure(name, max(sizes), table_sizes, budget)
        peak = "cuda_peak_above_start_max_rank" if name == "activation-memory" else "cuda_peak_ddp_max_rank"
        cells = [", ".join(f"{k} {v}" for k, v in r.items() if k.startswith(("N", "ddp_size", "bytes", "DDP", "FSDP2_b",
                                                                               "cuda_peak"))) for r in report["rows"]]
        return f"on {label}: " + "; ".join(cells), _on_cuda(report, label) and all(peak in r for r in report["rows"])
    if name == "planner":
        return plan_gpu_check(gpus, budget)
    if name == "compile-speed":
        report, label = _measure(name, 1, [1], budget)
        r = report["rows"][0]
        return (f"on {label}: eager {r['eager_step_s'] * 1e3:.2f} ms, compiled {r['compiled_step_s'] * 1e3:.2f} ms, "
                f"compiled/eager {r['compiled/eager']:.2f}"), _on_cuda(report, label) and r["compiled/eager"] < 1.0
    if name == "tf32-error":
        report, label = _measure(name, 1, [1], budget)
        r = report["rows"][0]
        shown = r["tf32_relative_error"] > TF32_HARDWARE_ERROR or not r["tf32_hardware"]
        return (f"on {label}: relative error with TF32 {r['tf32_relative_error']:.1e}, inside strict_fp32 "
                f"{r['strict_fp32_relative_error']:.1e}" + ("" if r["tf32_hardware"] else " (no TF32 before sm_80)"),
                _on_cuda(report, label) and shown and r["strict_fp32_relative_error"] < STRICT_FP32_ERROR)
    raise ValueError(f"no such row: {name}")


def skipped_collective(timeout_s: float) -> tuple[str, bool]:
    """Two CUDA engines; rank 1 skips a collective rank 0 enters: the cell must fail within the collective timeout
    (plus the watchdog's reaction), naming rank 1 as the one that never arrived."""
    from .cluster import MPICluster

    with MPICluster(n=2, timeout_s=COLLECTIVE_TIMEOUT_S, start_timeout_s=timeout_s) as cluster:
        t0 = time.monotonic()
        try:
            cluster.run(SKIPPED_COLLECTIVE, timeout_s=timeout_s, what="fail the skipped collective")
        except Exception as error:  # the CompositeError of the ranks that raised, or our time-out
            seconds = time.monotonic() - t0
            lines = summarize_rank_errors(rank_errors(error), [0, 1]) if hasattr(error, "elist") else [str(error)]
            named = any("waiting for rank(s) [1]" in line for line in lines)
            return (f"on {cluster.placement.label}, failed after {seconds:.0f} s: " + " | ".join(lines)[:400],
                    cluster.device == "cuda" and named and seconds < 6 * COLLECTIVE_TIMEOUT_S)
        return "the cell finished: the skipped collective did not fail", False


def checks(gpus: int, json_file: Path | None = None) -> list[dict]:
    """Every row of ``plan(gpus)`` as a result row (check, on, status, seconds, result), each run within its own
    budget; ``json_file`` is rewritten after every row, so a run cut short keeps what it measured."""
    rows = []
    for planned in plan(gpus):
        row = {"check": planned["check"], "on": planned["on"]}
        t0 = time.monotonic()
        if not planned["runs"]:
            row |= {"status": f"needs {planned['needs']}+ GPUs", "result": "not run with this many GPUs"}
        else:
            try:
                result, ok = run_row(planned, gpus)
                row |= {"status": "passed" if ok else "FAILED", "result": result}
            except Exception as error:  # a check that breaks is a failed check, reported with the rest
                row |= {"status": "FAILED", "result": f"{type(error).__name__}: {str(error)[-300:]}"}
        rows.append(row | {"seconds": round(time.monotonic() - t0, 1)})
        if json_file is not None:
            write_json(json_file, gpus, rows)
    return rows


def write_json(path: Path, gpus: int, rows: list[dict]) -> None:
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gpus": names, "rows": rows}, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows, the GPUs and the date to this file (after every row)")
    parser.add_argument("--plan", type=int, metavar="GPUS", help="print the rows GPUS GPUs would run, run nothing")
    args = parser.parse_args(argv)
    if args.plan is not None:
        print(Table(plan(args.plan), ["check", "on", "budget_s"], tablefmt="plain"))
        return 0
    gpus = visible_gpus()
    json_file = Path(args.json) if args.json else None
    if gpus == 0:
        print("No GPU is visible here (torch.cuda.device_count() == 0): nothing to check. Run `make gpu-check` on a "
              "GPU node; on this machine the CPU ranks of `make test` rehearse the same program.")
        if json_file is not None:
            write_json(json_file, 0, [])
        return 0
    print(f"# shardlab gpu-check, {time.strftime('%Y-%m-%d')}, {gpus} GPU(s)")
    rows = checks(gpus, json_file)
    print(Table(rows, ["check", "on", "status", "seconds", "result"], floatfmt=".1f", tablefmt="plain"))
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
