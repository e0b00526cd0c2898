"""The README's test command from a fresh clone, with and without the fork server, side by side in one run:
``python scripts/suite_cost.py [--json FILE]``.

Clones this checkout's HEAD into the temp folder twice and runs ``make test`` in each (the clone creates its own
.venv, as CI's does), one after the other: first with ``SHARDLAB_FORK_ENGINES=0`` (every engine and every job's rank
imports PyTorch and PhysicsNeMo itself: the start before the fork server), then as the series runs now (engines forked
from one imported parent, ``shardlab.ranks.forkserver``). The rest of the environment is this one's: run it as CI runs
the suite (``SHARDLAB_SYSTEM_SETUP=1``, root) to include the Slurm, MPICH and browser tests. Each clone is removed once
measured. Prints one table: the command's seconds (environment, then pytest, from the clone's JUnit XML), tests
passed/skipped/failed, and the ratio of each to the run without the fork server. About 75 minutes on 2 cores. The
last run's JUnit XML (the suite as it runs now) is copied into this checkout's test-artifacts/junit/, where
``make timings`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timings import machine, read_junit  # noqa: E402

from shardlab.ranks.forkserver import FORK_ENGINES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JUNIT = ROOT / "test-artifacts" / "junit"
RUNS = (("without the fork server", {FORK_ENGINES: "0"}), ("fork server", {}))


def interruptible() -> None:
    """In the suite's process, before it runs: Ctrl-C delivered again. A shell that starts this script in the
    background (``&``, nohup) has it ignore SIGINT, and an ignored signal stays ignored in every program it starts:
    the suite's Ctrl-C tests would then wait for an interrupt that never comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_suite(label: str, extra: dict[str, str]) -> dict:
    """Clone HEAD, run ``make test`` in the clone with ``extra`` set, and remove the clone: the timings."""
    clone = Path(tempfile.mkdtemp(prefix="shardlab-suite-"))
    clone.chmod(0o755)  # readable as a checkout is: the class-node tests run its .venv as other accounts
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=600)
        environment = {k: v for k, v in os.environ.items() if k != FORK_ENGINES} | extra
        print(f"{label}: make test in a fresh clone ({clone.name})", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(["make", "test"], cwd=clone, env=environment, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=3 * 3600, preexec_fn=interruptible)
        seconds = time.perf_counter() - t0
        junit = clone / "test-artifacts" / "junit" / "make-test.xml"
        if not junit.exists():
            sys.exit(f"{label}: make test wrote no JUnit XML (exit {done.returncode}):\n{done.stderr[-3000:]}")
        pytest = read_junit(junit)
        result = {"run": label, "command_s": round(seconds), "pytest_s": pytest["wall_s"],
                  "setup_s": round(seconds - pytest["wall_s"]), "exit": done.returncode, **pytest["counts"]}
        print(f"  {result}", flush=True)
        JUNIT.mkdir(parents=True, exist_ok=True)
        shutil.copy(junit, JUNIT / junit.name)
        return result
    finally:
        shutil.rmtree(clone, ignore_errors=True)


def table(results: list[dict]) -> str:
    base = results[0]
    rows = ["| run | command s | of which pytest s | command / without | pytest / without | passed | skipped "
            "| failed |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['run']} | {r['command_s']} | {r['pytest_s']} | {r['command_s'] / base['command_s']:.2f}x | "
                    f"{r['pytest_s'] / base['pytest_s']:.2f}x | {r['passed']} | {r['skipped']} | {r['failed']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    results = [run_suite(label, extra) for label, extra in RUNS]
    print(table(results))
    print(f"\n{machine()}; commit {head.strip()}; taken in turn, each from a fresh clone with a .venv of its own.")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": head.strip(), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
