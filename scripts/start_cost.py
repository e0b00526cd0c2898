"""What a learner's ranks cost to start and to hold, side by side with a bare mpiexec job doing the same work:
``python scripts/start_cost.py [--ranks 2 4 8] [--repeats 1] [--json FILE]``.

For each size, in one run, taken in turn so that a machine that gets busier or quieter affects each alike:

- ``fork server``: a fresh ``sl.RankCluster(n, keep_warm=False).start()`` as it starts now (controller, mpiexec, each
  rank's engine forked from a parent that imported PyTorch and PhysicsNeMo once, ``shardlab.ranks.forkserver``; then
  every rank initialises DistributedManager, and imports ShardTensor), timed from the call until it returns;
- ``cluster``: the same start without the fork server (``SHARDLAB_FORK_ENGINES=0``): every engine imports on its own,
  the start before the fork server, and its fallback;
- ``bare mpiexec``: ``mpiexec -n N python RANK_PROGRAM``, the launcher variables and thread limits ``run_job`` gives a
  job, where every rank runs ``sl.init_distributed`` and imports ShardTensor: timed from the launch until the last
  rank is ready (the latest of the ranks' clocks, which this machine shares), then held while its memory is read.

Memory is PSS, the ``Pss:`` line of ``/proc/<pid>/smaps_rollup`` summed over the processes: shared pages (libraries,
a parent's pages a forked child still shares) are split between the processes that map them, so the sum is what the
processes take together. The cluster's processes are those it recorded (controller, launcher, engines and their
nannies) and those marked with its id (its warden); the job's, the launcher and everything it started. The process
that runs this script (a notebook kernel, for a learner) is in neither.

Before measuring it compiles shardlab's modules into their ``__pycache__`` folders (``cache_bytecode``), as Python
does at a first import unless PYTHONDONTWRITEBYTECODE is set; the table says when it is.

Prints one table: seconds and GiB of each, and each cluster's ratio to the bare job. CPU ranks here rehearse the
start; on GPUs the same script measures theirs (CUDA ranks when every rank has a GPU, as ``sl.place_ranks`` decides).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardlab import quiet
from shardlab.ranks import commands, devices, forkserver, launch, owned, warden
from shardlab.ranks.cluster import RankCluster

# What every rank of the bare job runs: the work a cluster's rank does to be ready, then it waits for the word to end.
RANK_PROGRAM = """
import os, sys, time
from pathlib import Path

from shardlab.ranks import launch

state = launch.init_distributed(30)
from physicsnemo.domain_parallel import ShardTensor  # noqa: F401 (what a cluster's rank imports at its first start)

import torch.distributed as dist

ready = [None] * state.world_size
dist.all_gather_object(ready, time.time())
folder = Path(os.environ["START_COST_FOLDER"])
if state.rank == 0:
    (folder / "ready.tmp").write_text(repr(max(ready)))
    (folder / "ready.tmp").rename(folder / "ready")
deadline = time.monotonic() + 300
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
launch.shutdown_distributed()
"""
WAIT_S = 600.0


def pss_gib(pids: list[int]) -> float:
    """The PSS of ``pids``, summed, in GiB; a process that ended meanwhile counts nothing."""
    kib = 0
    for pid in set(pids):
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        kib += sum(int(line.split()[1]) for line in lines if line.startswith("Pss:"))
    return kib / 2**20


def cluster_start(n: int, fork: bool = False) -> dict:
    """A fresh cluster of ``n`` ranks (``fork``: its engines forked from a fork server; else each imports on its own):
    seconds to start, PSS of its processes once started, how many."""
    cluster = RankCluster(n=n, keep_warm=False)
    said = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(said), forking(fork):
            cluster.start()
        seconds = time.perf_counter() - t0
        pids = {p.pid for p in owned.alive(cluster._record.processes)}
        pids |= {p.pid for p in warden.marked_processes(cluster.cluster_id)}
        return {"seconds": seconds, "pss_gib": pss_gib(sorted(pids)), "processes": len(pids),
                "device": cluster.device}
    finally:
        cluster.stop()


@contextlib.contextmanager
def forking(on: bool):
    """``SHARDLAB_FORK_ENGINES`` as ``on`` says while the body runs."""
    before = os.environ.get(forkserver.FORK_ENGINES)
    os.environ[forkserver.FORK_ENGINES] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[forkserver.FORK_ENGINES]
        else:
            os.environ[forkserver.FORK_ENGINES] = before


def bare_job(n: int) -> dict:
    """``mpiexec -n n`` of RANK_PROGRAM: seconds from launch until every rank is ready, PSS of the job then."""
    placement = devices.place_ranks(n, devices.visible_gpus(), "auto")
    hidden = {"CUDA_VISIBLE_DEVICES": ""} | quiet.CPU_RANK_ENVIRONMENT if placement.device == "cpu" else {}
    with tempfile.TemporaryDirectory(prefix="shardlab-start-cost-") as folder:
        program = Path(folder, "rank.py")
        program.write_text(RANK_PROGRAM)
        env = launch.job_environment(**(commands.mpi_environment() | commands.mpi_session_environment(folder)
                                         | devices.rank_thread_environment(n) | hidden
                                         | {"START_COST_FOLDER": folder}))
        cmd = commands.job_command("openmpi", n, str(program))
        t0 = time.time()
        job = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + WAIT_S
            while not Path(folder, "ready").exists():
                if job.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bare {n}-rank job ended or took over {WAIT_S:.0f} s before its ranks "
                                       f"were ready: {job.stderr.read()[-2000:] if job.poll() is not None else ''}")
                time.sleep(0.05)
            seconds = float(Path(folder, "ready").read_text()) - t0
            pids = [pid for pid, _ in owned.process_tree(job.pid)]
            pss = pss_gib(pids)
            Path(folder, "go").touch()
            _, err = job.communicate(timeout=WAIT_S)
            if job.returncode:
                raise RuntimeError(f"the bare {n}-rank job exited with {job.returncode}: {err[-2000:]}")
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return {"seconds": seconds, "pss_gib": pss, "processes": len(pids), "device": placement.device}


def cache_bytecode() -> None:
    """Compile shardlab's modules into their ``__pycache__`` folders, as Python does at a module's first import unless
    PYTHONDONTWRITEBYTECODE is set: every way then reads shardlab's bytecode, as on a learner's machine, instead of
    each process compiling the modules it imports (the fork server's share: 0.2-0.3 CPU-s on its critical path)."""
    import compileall

    import shardlab

    compileall.compile_dir(Path(shardlab.__file__).parent, quiet=1)


WAYS = {"cluster": cluster_start, "fork server": lambda n: cluster_start(n, fork=True), "bare mpiexec": bare_job}


def measure(sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        runs = {way: [] for way in WAYS}
        for _ in range(repeats):
            for way, run in WAYS.items():
                runs[way].append(run(n))
                print(f"  {n} ranks, {way}: {runs[way][-1]['seconds']:.1f} s, {runs[way][-1]['pss_gib']:.2f} GiB",
                      file=sys.stderr, flush=True)
        row = {"ranks": n, "device": runs["cluster"][0]["device"]}
        for way, results in runs.items():
            row[way] = {key: statistics.median(r[key] for r in results) for key in ("seconds", "pss_gib", "processes")}
        rows.append(row)
    return rows


def table(rows: list[dict], repeats: int) -> str:
    """Seconds and PSS of each way, and each cluster's against the bare job's."""
    clusters = [way for way in WAYS if way != "bare mpiexec"]
    head = ("| ranks | " + " | ".join(f"{way} s" for way in WAYS) + " | "
            + " | ".join(f"{way} / bare" for way in clusters) + " | "
            + " | ".join(f"{way} PSS GiB" for way in WAYS) + " | " + " | ".join(f"{way} PSS / bare" for way in clusters)
            + " | processes (" + " / ".join(WAYS) + ") |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        bare = row["bare mpiexec"]
        cells = [f"{row['ranks']} {row['device'].upper()}"]
        cells += [f"{row[way]['seconds']:.1f}" for way in WAYS]
        cells += [f"{row[way]['seconds'] / bare['seconds']:.2f}x" for way in clusters]
        cells += [f"{row[way]['pss_gib']:.2f}" for way in WAYS]
        cells += [f"{row[way]['pss_gib'] / bare['pss_gib']:.2f}x" for way in clusters]
        cells.append(" / ".join(f"{row[way]['processes']:.0f}" for way in WAYS))
        lines.append("| " + " | ".join(cells) + " |")
    machine = (f"{os.cpu_count()} CPU cores; median of {repeats} run(s) each, taken in turn. A cluster's PSS is all "
               "that one learner's ranks hold (controller, launcher, engines, their nannies, the fork server). "
               "shardlab's bytecode compiled first, as Python caches it"
               + (" (PYTHONDONTWRITEBYTECODE is set here: without it, every process compiles shardlab's modules)."
                  if os.environ.get("PYTHONDONTWRITEBYTECODE") else "."))
    return "\n".join(lines) + f"\n\n{machine}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    args = parser.parse_args(argv)
    cache_bytecode()
    with owned.own_origin("start-cost"):  # whatever the runs leave, nothing outlives the script
        rows = measure(args.ranks, args.repeats)
    print(table(rows, args.repeats))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
