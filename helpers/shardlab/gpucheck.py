"""What only GPUs prove, in one command: ``python -m shardlab.gpucheck [--json FILE]`` (``make gpu-check``).

CPU ranks rehearse the program; this runs, on the GPUs this machine has, what they cannot show:

- the smoke test under torchrun with NCCL, one rank per visible GPU, every check;
- every notebook on CUDA engines (``tests/test_notebooks.py``, from a checkout of the repository);
- the memory tables with the CUDA allocator's peak per rank next to the byte model;
- eager vs compiled step time, synchronised.

One GPU proves what one CUDA rank can (device placement, allocator peaks, TF32, compile speed);
what needs two or more is listed, not guessed. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import procs
from .launch import clean_environment, run_job
from .plan import gpu_check as plan_gpu_check
from .report import Table
from .smoke import run_smoke

BUDGET_S = 8 * 60
REPO = Path(__file__).resolve().parents[2]  # a checkout: helpers/shardlab/gpucheck.py


def _pytest(timeout_s: float, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args]
    return procs.run_process_group(cmd, clean_environment(), timeout_s, "pytest " + " ".join(args))


def _measure(table: str, ranks: int, sizes: list[int], timeout_s: float) -> dict:
    args = [table, "--sizes", *map(str, sizes)]
    return run_job("torchrun", ranks, "shardlab.measure", args, timeout_s=timeout_s).result[table]


def checks(gpus: int, deadline: float) -> list[dict]:
    """Each check as a row: what, result, status (passed, failed, needs N GPUs)."""
    rows = []
    left = lambda: max(30.0, deadline - time.monotonic())  # noqa: E731

    def record(what: str, run) -> None:
        t0 = time.monotonic()
        try:
            result, ok = run()
            rows.append({"check": what, "result": result, "status": "passed" if ok else "FAILED"})
        except Exception as error:  # a check that breaks is a failed check, reported with the rest
            rows.append({"check": what, "result": f"{type(error).__name__}: {str(error)[-300:]}", "status": "FAILED"})
        rows[-1]["seconds"] = round(time.monotonic() - t0, 1)

    def needs_two(what: str) -> None:
        rows.append({"check": what, "result": "one GPU cannot show it", "status": "needs 2+ GPUs", "seconds": 0})

    if gpus >= 2:
        def smoke():
            report = run_smoke("torchrun", n=gpus, domain=2 if gpus % 2 == 0 else 1, timeout_s=left())
            backends = {r["backend"] for r in report["ranks"]}
            return f"{gpus} ranks, backend {sorted(backends)}, mesh {report['mesh']}", report["ok"] and backends == {
                "nccl"}
        record(f"smoke under torchrun, NCCL, {gpus} ranks, every check", smoke)

        def notebooks():
            if not (REPO / "tests" / "test_notebooks.py").exists():
                return "not a checkout of the repository: run make gpu-check from one", False
            proc = _pytest(left(), str(REPO / "tests" / "test_notebooks.py"))
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            return summary, proc.returncode == 0
        record(f"every notebook on {gpus} CUDA engines", notebooks)

        def skipped_collective():
            proc = _pytest(left(), "-k", "skipping_a_collective", str(REPO / "tests" / "test_negative_notebooks.py"))
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            return f"the fixture notebook on 2 CUDA engines: {summary}", proc.returncode == 0
        record("a skipped NCCL collective raises within timeout_s, naming the missing rank", skipped_collective)
    else:
        needs_two("smoke under torchrun with NCCL")
        needs_two("notebooks on CUDA engines (every lesson needs a domain of 2)")
        needs_two("a skipped NCCL collective raises within timeout_s")

    sizes = [n for n in (1, 2, 4) if n <= gpus and gpus % n == 0]

    def activation_memory():
        table = _measure("activation-memory", max(sizes), sizes, left())
        cells = [f"N={r['N']}: saved {r['bytes_max_rank']} B, CUDA peak {r.get('cuda_peak_above_start_max_rank')} B"
                 for r in table["rows"]]
        return "; ".join(cells), all("cuda_peak_above_start_max_rank" in r for r in table["rows"])
    record(f"activation memory per rank: CUDA peak beside saved bytes, N in {sizes}", activation_memory)

    def state_memory():
        ddp_sizes = [n for n in sizes if n > 1] or [1]
        table = _measure("state-memory", max(sizes), ddp_sizes, left())
        cells = [f"ddp={r['ddp_size']}: DDP {r['DDP_bytes_max_rank']} B (peak {r.get('cuda_peak_ddp_max_rank')}), "
                 f"FSDP2 {r['FSDP2_bytes_max_rank']} B (peak {r.get('cuda_peak_fsdp2_max_rank')})"
                 for r in table["rows"]]
        return "; ".join(cells), all("cuda_peak_ddp_max_rank" in r for r in table["rows"])
    record("state bytes per rank: CUDA peaks beside the byte model", state_memory)

    def memory_planner():
        return plan_gpu_check(gpus, left())
    record("memory planner: predicted peak per rank within 10 % of max_memory_allocated", memory_planner)

    def compile_speed():
        row = _measure("compile-speed", 1, [1], left())["rows"][0]
        return (f"eager {row['eager_step_s'] * 1e3:.2f} ms, compiled {row['compiled_step_s'] * 1e3:.2f} ms, "
                f"compiled/eager {row['compiled/eager']:.2f}"), True
    record("eager vs compiled step time, synchronised, one GPU", compile_speed)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows, the GPUs and the date to this file")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("No GPU is visible here (torch.cuda.device_count() == 0): nothing to check. Run `make gpu-check` on a "
              "GPU node; on this machine the CPU ranks of `make test` rehearse the same program.")
        rows, names = [], []
    else:
        names = [torch.cuda.get_device_name(i) for i in range(gpus)]
        print(f"# shardlab gpu-check, {time.strftime('%Y-%m-%d')}, {gpus} GPU(s): {', '.join(sorted(set(names)))}")
        rows = checks(gpus, time.monotonic() + BUDGET_S)
        print(Table(rows, ["check", "status", "seconds", "result"], floatfmt=".1f", tablefmt="plain"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gpus": names, "rows": rows},
                                              indent=1))
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
