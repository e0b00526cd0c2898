"""Start-up and step costs, measured side by side in one run: ``python -m shardlab.bench [--json FILE]``.

Two comparisons, each against the same work done without the cluster:

- starting the ``%%px`` cluster vs an ``mpiexec`` script that does the same per-rank work
  (launch, ``DistributedManager``, ShardTensor operators ready), with where the seconds go;
- five DDP steps in ``%%px`` cells vs the same steps in a ``torchrun`` script.

Byte ratios are the measurement script's job (``python -m shardlab.measure``), not repeated here.
Timings are this machine's, on the CPU ranks it has; they say nothing about GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cluster import MPICluster, engine_environment
from .launch import job_command, job_environment

# The per-rank work of a cluster start, without the cluster: rank 0 prints the slowest rank's phases.
SAME_WORK = """
import shardlab.launch as launch
state = launch.init_distributed(60)
import torch.distributed as dist
rows = [None] * state.world_size
dist.all_gather_object(rows, state.phases)
if state.rank == 0:
    import json
    print("PHASES", json.dumps({k: max(r[k] for r in rows) for k in rows[0]}))
launch.shutdown_distributed()
"""

# The workload timed both ways: 5 DDP steps of the surrogate on a (ddp, domain=2) mesh.
WORKLOAD = """
import time, shardlab as sl
mesh = sl.build_mesh(ddp=-1, domain=2)
trainer = sl.train.Trainer(sl.models.conv_stack(seed=0).to(sl.launch.default_device()), mesh, "ddp")
trainer.step()  # warm-up: first-call costs are not the workload
t0 = time.perf_counter()
for _ in range(5):
    trainer.step()
workload_s = time.perf_counter() - t0
"""
TORCHRUN_SCRIPT = "import shardlab as sl\nsl.init_distributed(60)\n" + WORKLOAD + (
    "\nimport torch.distributed as dist\nif dist.get_rank() == 0: print('WORKLOAD', workload_s)\n"
    "sl.launch.shutdown_distributed()\n")


def _run_script(launcher: str, n: int, code: str, marker: str, device: str) -> tuple[float, str]:
    """(wall seconds, the text rank 0 printed after ``marker``) for ``code`` as a script on n ranks of ``device``."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(code)
        env = job_environment(**engine_environment(device))  # engine_environment includes mpi_environment
        t0 = time.perf_counter()
        proc = subprocess.run(job_command(launcher, n, str(script)), capture_output=True, text=True, timeout=600,
                              env=env)
        wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{launcher} script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, next(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(marker))


def run(n: int = 4) -> list[dict]:
    rows = []
    cluster = MPICluster(n=n)  # one engine per GPU where there are enough, else CPU ranks; scripts alike
    same_work_s, phases = _run_script("openmpi", n, SAME_WORK, "PHASES", cluster.device)
    with cluster:
        start_s = cluster.start_seconds
        cluster_phases = cluster.timings
        rank_phases = {k: max(s["phases"][k] for s in cluster.states) for k in cluster.states[0]["phases"]}
        t0 = time.perf_counter()
        cluster.run(WORKLOAD, timeout_s=300, what="run the workload")
        px_wall = time.perf_counter() - t0
        px_workload = max(cluster.view.pull("workload_s"))
    torchrun_wall, torchrun_workload = _run_script("torchrun", n, TORCHRUN_SCRIPT, "WORKLOAD", cluster.device)
    torchrun_workload = float(torchrun_workload)

    rows.append({"measurement": f"mpiexec -n {n} script: launch + DistributedManager + ShardTensor ops",
                 "value": same_work_s, "unit": "s"})
    for phase, seconds in json.loads(phases).items():
        rows.append({"measurement": f"  of which, slowest rank: {phase}", "value": seconds, "unit": "s"})
    rows.append({"measurement": f"cluster start, {n} ranks, same work + controller + engines", "value": start_s,
                 "unit": "s"})
    for phase, seconds in cluster_phases.items():
        rows.append({"measurement": f"  of which: {phase}", "value": seconds, "unit": "s"})
    for phase, seconds in rank_phases.items():
        rows.append({"measurement": f"    in DistributedManager ready, slowest rank: {phase}", "value": seconds,
                     "unit": "s"})
    rows += [
        {"measurement": "cluster start / mpiexec script (same per-rank work)", "value": start_s / same_work_s,
         "unit": "x"},
        {"measurement": "5 DDP steps in %%px cells (cluster already up)", "value": px_workload, "unit": "s"},
        {"measurement": "5 DDP steps as a torchrun script", "value": torchrun_workload, "unit": "s"},
        {"measurement": "%%px / torchrun, same 5 steps", "value": px_workload / torchrun_workload, "unit": "x"},
        {"measurement": "%%px cell round trip incl. warm-up step", "value": px_wall, "unit": "s"},
        {"measurement": "torchrun script end to end (start, init, warm-up, 5 steps)", "value": torchrun_wall,
         "unit": "s"},
    ]
    return rows


def machine() -> str:
    import torch

    gpus = torch.cuda.device_count()
    kind = f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, {kind}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def format_rows(rows: list[dict]) -> str:
    width = max(len(r["measurement"]) for r in rows)
    return "\n".join([f"{'measurement'.ljust(width)}  {'value':>8}  unit"] +
                     [f"{r['measurement'].ljust(width)}  {r['value']:>8.2f}  {r['unit']}" for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the cluster and of the scripts (default 4)")
    parser.add_argument("--json", help="also write the rows, machine and date as JSON to this file")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args.ranks)
    print(f"# shardlab bench, {time.strftime('%Y-%m-%d')}, {machine()}; {time.perf_counter() - t0:.0f} s")
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
