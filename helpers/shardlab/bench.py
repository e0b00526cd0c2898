"""Performance report: ``python -m shardlab.bench [--json FILE]`` measures, side by side in one run,
what the series claims about cost, and prints one stable table (and JSON) to compare across runs.

Rows: cluster start vs bare ``mpiexec``; one workload in ``%%px`` cells vs as a torchrun script;
activation-memory ratio per domain size; FSDP2/DDP state-bytes ratio per ddp size; largest
sharded-vs-single-device error. Timings are this machine's; byte ratios are deterministic.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .launch import torchrun_command

# The workload timed both ways: 5 DDP steps of the surrogate on a (ddp=2, domain=2) mesh.
WORKLOAD = """
import time, shardlab as sl
mesh = sl.build_mesh(ddp=-1, domain=2)
trainer = sl.train.Trainer(sl.models.conv_stack(seed=0), mesh, "ddp")
trainer.step()  # warm-up: first-call costs are not the workload
t0 = time.perf_counter()
for _ in range(5):
    trainer.step()
workload_s = time.perf_counter() - t0
"""

# Largest |sharded - single-device| over a conv stack's output and input gradient (fp32).
MAX_ERROR = """
import torch, torch.distributed as dist, shardlab as sl
from physicsnemo.domain_parallel import scatter_tensor
from torch.distributed.tensor import Shard
line = sl.build_mesh(ddp=1, domain=dist.get_world_size())
field = sl.data.load_darcy(samples=1)["permeability"]
model = sl.models.conv_stack(width=16, layers=3, seed=0)
x = scatter_tensor(field, 0, line["domain"], (Shard(2),), requires_grad=True)
model(x).square().mean().backward()
ref = field.clone().requires_grad_(True)
model(ref).square().mean().backward()
max_error = max((model(x).full_tensor() - model(field)).abs().max().item(), (x.grad.full_tensor() - ref.grad).abs().max().item())
"""

TORCHRUN_SCRIPT = "import shardlab as sl\nsl.init_distributed(60)\n" + WORKLOAD + (
    "\nimport torch.distributed as dist\nif dist.get_rank() == 0: print('WORKLOAD', workload_s)\n"
    "sl.launch.shutdown_distributed()\n")


def _measure_table(what: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "table.json"
        subprocess.run([sys.executable, "-m", "shardlab.measure", what, "--json", str(out)], check=True,
                       capture_output=True, timeout=900)
        return json.loads(out.read_text())


def run() -> list[dict]:
    from .cluster import MPICluster
    from .measure import bare_mpiexec_seconds

    rows = []
    bare = bare_mpiexec_seconds(4)
    with MPICluster(n=4, device="cpu") as cluster:
        rows += [
            {"measurement": "bare mpiexec -n 4 python -c 'import physicsnemo'", "value": bare, "unit": "s"},
            {"measurement": "cluster start, 4 ranks, DistributedManager ready", "value": cluster.start_seconds, "unit": "s"},
            {"measurement": "cluster start / bare mpiexec", "value": cluster.start_seconds / bare, "unit": "x"},
        ]
        t0 = time.perf_counter()
        cluster.run(WORKLOAD, timeout_s=300, what="run the workload")
        px_wall = time.perf_counter() - t0
        px_workload = max(cluster.view.pull("workload_s"))
        cluster.run(MAX_ERROR, timeout_s=300, what="compare sharded and single-device results")
        max_error = max(cluster.view.pull("max_error"))

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(TORCHRUN_SCRIPT)
        t0 = time.perf_counter()
        proc = subprocess.run(torchrun_command(4, str(script)), capture_output=True, text=True, timeout=600, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
        torchrun_wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"torchrun workload failed:\n{proc.stderr[-3000:]}")
    torchrun_workload = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("WORKLOAD")))
    rows += [
        {"measurement": "5 DDP steps in %%px cells (cluster already up)", "value": px_workload, "unit": "s"},
        {"measurement": "5 DDP steps as a torchrun script", "value": torchrun_workload, "unit": "s"},
        {"measurement": "%%px / torchrun, same 5 steps", "value": px_workload / torchrun_workload, "unit": "x"},
        {"measurement": "%%px cell round trip incl. warm-up step", "value": px_wall, "unit": "s"},
        {"measurement": "torchrun script end to end (start, init, warm-up, 5 steps)", "value": torchrun_wall, "unit": "s"},
    ]
    for r in _measure_table("activation-memory")["rows"]:
        rows.append({"measurement": f"activation bytes per rank, domain N={r['N']} / N=1 (ideal {r['ideal_1/N+halo']:.4f})",
                     "value": r["ratio"], "unit": "ratio"})
    for r in _measure_table("state-memory")["rows"]:
        rows.append({"measurement": f"FSDP2 / DDP state bytes per rank, ddp={r['ddp_size']} (ideal {r['ideal_1/ddp']:.4f})",
                     "value": r["FSDP2/DDP"], "unit": "ratio"})
    rows.append({"measurement": "max |sharded - single device| (conv stack output, input grad; fp32)", "value": max_error,
                 "unit": "abs"})
    return rows


def machine() -> str:
    import torch

    gpus = torch.cuda.device_count()
    kind = f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}" if gpus else "no GPU"
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, {kind}, Python {platform.python_version()}, torch {torch.__version__}"


def format_rows(rows: list[dict]) -> str:
    width = max(len(r["measurement"]) for r in rows)
    cell = lambda v: f"{v:.2e}" if abs(v) < 1e-3 and v != 0 else f"{v:.4f}"  # noqa: E731
    return "\n".join([f"{'measurement'.ljust(width)}  {'value':>10}  unit"] +
                     [f"{r['measurement'].ljust(width)}  {cell(r['value']):>10}  {r['unit']}" for r in rows])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shardlab.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows, machine and date as JSON to this file")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run()
    print(f"# shardlab bench, {time.strftime('%Y-%m-%d')}, {machine()}; {time.perf_counter() - t0:.0f} s")
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
