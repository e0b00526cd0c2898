"""What only GPUs prove, in one command: ``python -m shardlab.tools.gpucheck [--json FILE]`` (``make gpu-check``).

CPU ranks rehearse the program; this runs, on the GPUs this machine has, what they cannot show, one row at a time,
each under its own time budget, judged, and written to the JSON file as it ends. ``plan(gpus)`` is which rows a GPU
count runs (``--plan N`` prints it). What each GPU count proves and how a run is bounded: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..plan.validate import gpu_check as plan_gpu_check
from ..ranks import owned, subprocesses
from ..ranks.devices import place_ranks, unusable_gpus, visible_gpus
from ..ranks.launch import clean_environment, run_job
from ..ranks.px import rank_errors, summarize_rank_errors
from ..report import Table
from . import gpu_lessons
from .smoke import run_smoke
from .time_model import TimeModelError, measured_run_s

CHECKOUT = Path(__file__).resolve().parents[3]  # helpers/shardlab/tools/gpucheck.py in a checkout of the repository
COLLECTIVE_TIMEOUT_S = 10
# Rank 1 never enters the all-reduce. gloo's all_reduce itself raises after the timeout; on NCCL the watchdog
# aborts the communicator (workarounds.nccl_errors_raise) and the next collective raises.
SKIPPED_COLLECTIVE = """\
import torch, torch.distributed as dist
import shardlab as sl
x = torch.ones(1, device=sl.ranks.launch.default_device())
if dist.get_rank() == 0:
    dist.all_reduce(x)
    x.item()
    dist.all_reduce(x)
"""
# TF32 keeps 10 mantissa bits: a conv stack's relative error is ~1e-3 (or less: cuDNN may pick an fp32 kernel anyway),
# fp32's ~1e-7. Above TF32_ERROR is no rounding but a wrong result.
TF32_ERROR = 1e-2
STRICT_FP32_ERROR = 1e-5
# Compiled and eager steps both run TF32 convolutions, not necessarily the same kernels: ~1e-3 apart at most.
COMPILED_VS_EAGER_ERROR = 1e-2
NO_TIME = "no time left"
# A row's own budget is passed to what it starts (a job's or a cluster's time-out), which stops it first; past the
# budget by this much more, gpu-check stops the row itself, with every process it started.
OVERRUN_S = 30
# A notebook's row: this much per start of ranks in it (a cluster, a restart, a job: fresh CUDA ranks, their imports,
# CUDA contexts and NCCL communicators), plus NOTEBOOK_MARGIN times what the notebook took on CPU ranks in the last
# `make test` (docs/timings.md: with its exercises' wrong answers rehearsed too, which `pytest --nbmake` does not do).
CLUSTER_START_S = 90
NOTEBOOK_MARGIN = 2


class Stopped(BaseException):
    """Raised in the main thread at the run's deadline (SIGALRM), or on SIGTERM or SIGINT. Not an Exception, so that
    no ``except Exception`` on the way swallows it: every ``with`` block and ``subprocesses.run_process_group`` it
    unwinds through stops what it started."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    if signum != signal.SIGALRM:  # a second SIGTERM or Ctrl-C must not cut the clean-up of the first one short
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


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

    even = max(gpus - gpus % 2, 2)  # the lessons' meshes have domain groups of 2: 3 GPUs run notebooks on 2
    loading_sizes = [n for n in sizes if n > 1] or [2]
    parity_tolerance = gpu_lessons.parity.TOLERANCE
    rows = [
        ("smoke", "smoke under torchrun, NCCL, one rank per GPU, every check", max(gpus, 2), 2, 240),
        ("skipped-collective", f"a collective rank 1 skips ends in an error within {COLLECTIVE_TIMEOUT_S} s, "
                               "naming rank 1", 2, 2, 240),
        ("activation-memory", f"activation memory per rank: CUDA peak beside saved bytes, N in {sizes}", max(sizes),
         1, 300),
        ("state-memory", f"state bytes per rank: CUDA peaks beside the byte model, ddp in {ddp_sizes}", max(sizes),
         1, 300),
        ("planner", "memory planner: predicted step peak within 10 % of max_memory_allocated per rank, the CPU "
                    "ranks' peak configurations, the activation-heavy ones 16x larger per side (2-D, 3-D, DDP, FSDP2, "
                    "checkpointing, bf16, domain "
                    f"{sorted({1, 2, 4} & {n for n in sizes if max(gpus, 1) % n == 0}) or [1]})",
         max(gpus, 1), 1, 400),
        ("scaling", f"strong and weak scaling of notebook 14's step, N in {sizes}: step time, ideal and the share "
                    "with a collective in flight (recorded, not judged: it depends on the GPUs and their links)",
         max(sizes), 2, 300),
        ("compile-speed", f"compiled step within {COMPILED_VS_EAGER_ERROR:g} of eager; eager vs compiled step time "
                          "and the compile time, synchronised", 1, 1, 300),
        ("tf32-error", f"TF32 error of a conv stack vs fp64 below {TF32_ERROR:g}, and below {STRICT_FP32_ERROR:g} "
                       "inside strict_fp32", 1, 1, 120),
        ("loading-memory", f"lesson 12: one sample loaded as ShardTensors by slab and by scatter_tensor, N in "
                           f"{loading_sizes}: slab holds 1/N of the fields per rank, beside the CUDA allocator's peak",
         max(loading_sizes), 2, 240),
        ("timeline", "lesson 14: two profiled steps of its U-Net on every rank: NCCL's kernels on the GPU streams, "
                     "shares summing to 1, the halo exchange, ShardTensor's and DDP's all-reduces", even, 2, 240),
        ("flight-record", f"lesson 14: the last of {even} ranks held back from an all-reduce; NCCL's Flight Recorder "
                          "on every rank names it as the one the others wait for", even, 2, 180),
        ("transolver-parity", f"lesson 13: Transolver on {max(gpus, 2)} ranks against one process, float64, output and "
                              f"every gradient within {parity_tolerance:g}, even and uneven split", max(gpus, 2), 2,
         300),
        *[(f"notebook {name}", f"notebooks/{name}.ipynb on CUDA engines, an even number of them (from the "
                               f"checkout){said}", even, 2, budget)
          for name, (budget, said) in notebook_rows().items()],
    ]
    return [{"name": name, "check": check, "on": on(ranks, needs), "ranks": ranks, "needs": needs,
             "budget_s": budget, "runs": gpus >= needs} for name, check, ranks, needs, budget in rows]


def notebook_rows() -> dict[str, tuple[int, str]]:
    """Each notebook of the checkout: its row's budget, from its own time on CPU ranks in docs/timings.md and the
    clusters it starts (``CLUSTER_START_S``, ``NOTEBOOK_MARGIN``), and what the row says of it. Outside a checkout,
    one row that says so when it runs."""
    folder, timings = CHECKOUT / "notebooks", CHECKOUT / "docs" / "timings.md"
    if not folder.is_dir():
        return {"(none)": (60, ": not in a checkout")}
    try:
        measured = measured_run_s(timings.read_text())
    except (OSError, TimeModelError):
        measured = {}
    longest = max(measured.values(), default=600.0)
    rows = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join(line.split("#")[0] for c in cells if c["cell_type"] == "code"
                         for line in "".join(c["source"]).splitlines())
        starts = max(sum(code.count(call) for call in ("start_cluster(", ".restart()", "run_job(")), 1)
        seconds = measured.get(path.stem)
        budget = round(starts * CLUSTER_START_S + NOTEBOOK_MARGIN * (seconds or longest))
        said = (f": {starts} start(s) of ranks, {seconds:.0f} s on CPU ranks" if seconds else
                ": no time of it in docs/timings.md, the longest notebook's used")
        rows[path.stem] = (budget, said)
    return rows


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
    if name.startswith("notebook "):
        notebook = checkout_notebooks() / f"{name.removeprefix('notebook ')}.ipynb"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake",
               f"--nbmake-timeout={budget}", "-o", "addopts=", str(notebook)]
        env = clean_environment(SHARDLAB_RANKS=str(row["ranks"]))
        proc = subprocesses.run_process_group(cmd, env, budget, f"pytest --nbmake {notebook.name}")
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        return f"{notebook.name} on {row['on']}: {summary}", proc.returncode == 0
    if name == "loading-memory":
        return gpu_lessons.run_loading_memory(row["ranks"], [n for n in sizes if n > 1] or [2], budget)
    if name == "timeline":
        return gpu_lessons.run_timeline(row["ranks"], budget)
    if name == "flight-record":
        return gpu_lessons.run_flight_record(row["ranks"], COLLECTIVE_TIMEOUT_S, budget)
    if name == "transolver-parity":
        return gpu_lessons.run_transolver_parity(row["ranks"], budget)
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
    if name == "scaling":
        report, label = _measure(name, max(sizes), sizes, budget)
        cells = [f"{r['scaling']} N={r['N']} {r['step_s'] * 1e3:.1f} ms (ideal {r['ideal_s'] * 1e3:.1f}, "
                 f"{100 * r['communication']:.0f} % comm.)" for r in report["rows"]]
        return f"on {label}: " + "; ".join(cells), _on_cuda(report, label)
    if name == "compile-speed":
        report, label = _measure(name, 1, [1], budget)
        r = report["rows"][0]
        # Whether compiled is faster depends on the GPU and this small model, not on a correct stack: reported only.
        if "compiled_relative_diff" not in r:
            return (f"on {label}: the compile-speed table reports no compiled_relative_diff (compiled vs eager "
                    "output): shardlab.measure's compile_speed_table must compare them"), False
        return (f"on {label}: compiled vs eager {r['compiled_relative_diff']:.1e}, eager {r['eager_step_s'] * 1e3:.2f} "
                f"ms, compiled {r['compiled_step_s'] * 1e3:.2f} ms, compiled/eager {r['compiled/eager']:.2f}, first "
                f"compiled call {r['first_call_s']:.1f} s"), (_on_cuda(report, label)
                                                             and r["compiled_relative_diff"] < COMPILED_VS_EAGER_ERROR)
    if name == "tf32-error":
        report, label = _measure(name, 1, [1], budget)
        r = report["rows"][0]
        return (f"on {label}: relative error with TF32 {r['tf32_relative_error']:.1e}, inside strict_fp32 "
                f"{r['strict_fp32_relative_error']:.1e}" + ("" if r["tf32_hardware"] else " (no TF32 before sm_80)"),
                _on_cuda(report, label) and r["tf32_relative_error"] < TF32_ERROR
                and r["strict_fp32_relative_error"] < STRICT_FP32_ERROR)
    raise ValueError(f"no such row: {name}")


def skipped_collective(timeout_s: float) -> tuple[str, bool]:
    """Two CUDA engines; rank 1 skips a collective rank 0 enters: the cell must fail within the collective timeout
    (plus the watchdog's reaction), naming rank 1 as the one that never arrived."""
    from ..ranks.cluster import RankCluster

    with RankCluster(n=2, timeout_s=COLLECTIVE_TIMEOUT_S, start_timeout_s=timeout_s) as cluster:
        t0 = time.monotonic()
        try:
            cluster.run(SKIPPED_COLLECTIVE, timeout_s=timeout_s, what="fail the skipped collective")
        except Exception as error:  # the CompositeError of the ranks that raised, or our time-out
            seconds = time.monotonic() - t0
            lines = summarize_rank_errors(rank_errors(error), [0, 1]) if hasattr(error, "elist") else [str(error)]
            named = any("waiting for rank(s) [1]" in line for line in lines)
            return (f"on {cluster.placement.label}, failed after {seconds:.0f} s: " + " | ".join(lines)[:400],
                    cluster.device == "cuda" and named and seconds < 3 * COLLECTIVE_TIMEOUT_S)
        return "the cell finished: the skipped collective did not fail", False


def checks(gpus: int, json_file: Path | None = None, deadline_s: float | None = None) -> list[dict]:
    """Every row of ``plan(gpus)`` as a result row (check, on, status, seconds, result), each run within its own
    budget and all within ``deadline_s`` (default: the sum of the budgets): a row whose budget no longer fits is not
    run, one still running at the deadline is stopped, with what it started. ``json_file`` is rewritten after every
    row, so a run cut short keeps what it measured."""
    planned_rows = plan(gpus)
    if deadline_s is None:
        deadline_s = sum(r["budget_s"] for r in planned_rows if r["runs"])
    ends, rows = time.monotonic() + deadline_s, []
    previous = signal.signal(signal.SIGALRM, _raise_stopped)
    try:
        for planned in planned_rows:
            row = {"name": planned["name"], "check": planned["check"], "on": planned["on"]}
            t0 = time.monotonic()
            if not planned["runs"]:
                row |= {"status": f"needs {planned['needs']}+ GPUs", "result": "not run with this many GPUs"}
            elif planned["budget_s"] > ends - t0:
                row |= {"status": NO_TIME, "result": f"not run: its {planned['budget_s']} s budget does not fit in the "
                                                     f"{max(ends - t0, 0):.0f} s left of --deadline-s {deadline_s:g}"}
            else:
                bound = planned["budget_s"] + OVERRUN_S
                signal.setitimer(signal.ITIMER_REAL, min(bound, ends - t0))
                try:
                    result, ok = run_row(planned, gpus)
                    row |= {"status": "passed" if ok else "FAILED", "result": result}
                except Exception as error:  # a check that breaks is a failed check, reported with the rest
                    row |= {"status": "FAILED", "result": f"{type(error).__name__}: {str(error)[-300:]}"}
                except Stopped as stopped:
                    if stopped.signum != signal.SIGALRM:
                        raise
                    past_own = time.monotonic() - t0 >= bound - 1
                    row |= {"status": "FAILED", "result": (
                        f"stopped {OVERRUN_S} s past its own {planned['budget_s']} s budget, with what it started"
                        if past_own and bound <= ends - t0 else
                        f"stopped at --deadline-s {deadline_s:g}, before the end of its own "
                        f"{planned['budget_s']} s budget")}
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            rows.append(row | {"seconds": round(time.monotonic() - t0, 1)})
            if json_file is not None:
                write_json(json_file, gpus, rows)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return rows


def checkout_commit() -> str | None:
    """The commit of the checkout these checks ran from: what a committed record was measured on."""
    git = shutil.which("git")
    if git is None or not (CHECKOUT / ".git").exists():  # a node without git, or an installed copy: no commit to name
        return None
    out = subprocess.run([git, "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.strip() or None


def write_json(path: Path, gpus: int, rows: list[dict], **extra) -> None:
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": checkout_commit(), "gpus": names,
                                "rows": rows} | extra, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows, the GPUs and the date to this file (after every row)")
    parser.add_argument("--plan", type=int, metavar="GPUS", help="print the rows GPUS GPUs would run, run nothing")
    parser.add_argument("--deadline-s", type=float, help="seconds for the whole run: rows whose budget no longer fits "
                                                         "are not run (default: the sum of the rows' budgets)")
    args = parser.parse_args(argv)
    if args.plan is not None:
        print(Table(plan(args.plan), ["check", "on", "budget_s"], tablefmt="plain"))
        return 0
    gpus = visible_gpus()
    json_file = Path(args.json) if args.json else None
    if problem := unusable_gpus(gpus):
        print(f"gpu-check: {problem}", file=sys.stderr)
        if json_file is not None:
            write_json(json_file, 0, [], error=problem)
        return 1
    if gpus == 0:
        hidden = (f" with CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
                  if "CUDA_VISIBLE_DEVICES" in os.environ else "")
        print(f"No GPU is visible here{hidden} (CUDA counts none): nothing to check. Run `make "
              "gpu-check` on a GPU node; on this machine the CPU ranks of `make test` rehearse the same program.")
        if json_file is not None:
            write_json(json_file, 0, [])
        return 0
    print(f"# shardlab gpu-check, {time.strftime('%Y-%m-%d')}, {gpus} GPU(s)")
    handlers = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with owned.own_origin("gpucheck"):  # what the rows start: stopped at the end, and nothing else
            rows = checks(gpus, json_file, args.deadline_s)
    except Stopped as stopped:
        print(f"gpu-check: stopped by {stopped}; the processes it started are stopped too.", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    print(Table(rows, ["check", "on", "status", "seconds", "result"], floatfmt=".1f", tablefmt="plain"))
    if skipped := sum(r["status"] == NO_TIME for r in rows):
        print(f"{skipped} row(s) not run for lack of time: give the run more with --deadline-s.")
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
