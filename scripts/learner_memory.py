"""Memory one learner takes on a shared node, measured: a notebook kernel (the "shardlab" kernel, as JupyterLab
starts it) that runs ``sl.start_cluster(n)``, with its controller, launcher and engines, once every rank has
initialised DistributedManager and ShardTensor's operators (what the first cell of notebooks 02-08 leaves).

    python scripts/learner_memory.py [--ranks 4] [--json FILE] [--imports]

Prints one row per process and the totals. RSS counts shared pages (libraries mapped by several processes) in
each of them; PSS splits shared pages between the processes that map them, so PSS sums to what the learner
really takes. Divide a node's free memory by the PSS per learner (with a margin for what the notebooks then
compute) to size a workshop.

``--imports`` says what an engine's memory is made of: in a fresh interpreter, the private memory (heap and
anonymous pages: what every engine pays alone, whatever it shares) that each step of an engine's start adds, in
the order an engine takes them, with whose code it is. Shared library pages are left out: PSS spreads them over
the engines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import psutil
from jupyter_client.manager import start_new_kernel

MIB = 2**20


def run(kc, code: str, timeout_s: float = 600) -> str:
    """Execute code in the kernel; return what it printed; raise if it failed."""
    printed = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout_s, output_hook=hook)
    if reply["content"]["status"] == "aborted":
        # Never run: after a failed cell ipykernel 7.4 aborts the requests that reach it before its own "stop
        # aborting" message does (kernelbase.py, _abort_queues, lines 1364-1378), a race a busy machine loses.
        reply = kc.execute_interactive(code, timeout=timeout_s, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel failed on {code!r} ({reply['content']['status']}):\n"
                           f"{''.join(printed)[-3000:]}")
    return "".join(printed)


def measure(ranks: int) -> dict:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    km, kc = start_new_kernel(kernel_name="shardlab", startup_timeout=120, env=env)
    try:
        t0 = time.perf_counter()
        run(kc, f"import json, shardlab as sl\ncluster = sl.start_cluster(n={ranks})")
        seconds = time.perf_counter() - t0
        rows = json.loads(run(kc, "print(json.dumps(cluster.memory()))"))
        kernel = psutil.Process(km.provisioner.process.pid).memory_full_info()
        rows.insert(0, {"process": "notebook kernel", "pid": km.provisioner.process.pid, "rss_mib": kernel.rss / MIB,
                        "pss_mib": kernel.pss / MIB, "uss_mib": kernel.uss / MIB})
        run(kc, "cluster.stop()")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    engines = [r for r in rows if r["process"].endswith("engine")]
    per_engine = {k: sum(r[k] for r in rows if "engine" in r["process"]) / ranks for k in ("rss_mib", "pss_mib")}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "ranks": ranks,
        "start_seconds": round(seconds, 1),
        "processes": rows,
        "per_engine_mib": {k: round(v) for k, v in per_engine.items()},  # engine + its nanny, averaged over ranks
        "engine_rss_mib_max": round(max(r["rss_mib"] for r in engines)),
        "per_learner_pss_mib": round(sum(r["pss_mib"] for r in rows)),
        "per_learner_rss_mib": round(sum(r["rss_mib"] for r in rows)),
    }


# An engine's start, step by step: (what, whose code, statement). Each row is what its statement adds on top of the
# rows above it; the third-party rows name the import that brings them in (python -X importtime).
ENGINE_START = (
    ("ipyparallel engine: IPython, ipykernel, zmq", "ipyparallel", "import ipyparallel.engine.app, ipykernel.ipkernel"),
    ("torch", "PyTorch", "import torch"),
    ("torch.distributed.tensor (DTensor; brings sympy)", "PyTorch", "import torch.distributed.tensor"),
    ("warp (physicsnemo/__init__.py)", "PhysicsNeMo", "import warp"),
    ("s3fs, aiohttp, botocore (physicsnemo.core.filesystem)", "PhysicsNeMo", "import s3fs"),
    ("tensordict, torch._dynamo (physicsnemo.distributed.fused_all_reduce)", "PhysicsNeMo", "import tensordict"),
    ("the rest of physicsnemo.distributed", "PhysicsNeMo", "import physicsnemo.distributed"),
    ("shardlab.ranks.launch (what ENGINE_CONFIG and init_rank import)", "ours", "import shardlab.ranks.launch"),
    ("init_distributed: DistributedManager (1 rank), the series' ShardTensor operators", "ours + PhysicsNeMo",
     "shardlab.ranks.launch.init_distributed(60)"),
)
_PRIVATE = """
def private_mib():
    total, anonymous = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: address range, ..., path (none: anonymous)
                anonymous = len(head) < 6 or head[5] == "[heap]"
            elif anonymous and head[0] in ("Private_Clean:", "Private_Dirty:"):
                total += int(head[1])
    return total / 1024
"""


def engine_start_steps() -> list[dict]:
    """Private MiB each step of an engine's start adds, measured in one fresh interpreter (CPU, world size 1)."""
    lines = [_PRIVATE, "import json, os, socket",
             "with socket.socket() as s:\n    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]",
             "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', "
             "MASTER_PORT=str(port))",
             "rows, last = [], private_mib()"]
    for what, whose, statement in ENGINE_START:
        lines += [statement,
                  f"now = private_mib(); rows.append({{'step': {what!r}, 'whose': {whose!r}, 'mib': now - last}})",
                  "last = now"]
    lines.append("shardlab.ranks.launch.shutdown_distributed(); print(json.dumps(rows))")
    out = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    if out.returncode != 0:
        raise RuntimeError(f"measuring an engine's start failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="engines per learner (default 4, as in the notebooks)")
    parser.add_argument("--json", help="also write the measurement to this file")
    parser.add_argument("--imports", action="store_true", help="also: what each step of an engine's start adds")
    args = parser.parse_args(argv)
    result = measure(args.ranks)
    if args.imports:
        result["engine_start"] = engine_start_steps()
    print(f"# memory of one learner: notebook kernel + sl.start_cluster(n={args.ranks}) after init, CPU ranks; "
          f"{result['machine']}")
    print(f"{'process':<26}{'RSS MiB':>10}{'PSS MiB':>10}{'USS MiB':>10}")
    for row in result["processes"]:
        print(f"{row['process']:<26}{row['rss_mib']:>10.0f}{row['pss_mib']:>10.0f}{row['uss_mib']:>10.0f}")
    print(f"per engine (with its nanny): RSS {result['per_engine_mib']['rss_mib']} MiB, "
          f"PSS {result['per_engine_mib']['pss_mib']} MiB")
    print(f"per learner: PSS {result['per_learner_pss_mib']} MiB (RSS summed: {result['per_learner_rss_mib']} MiB)")
    if args.imports:
        print("\n# an engine's private memory (heap + anonymous pages), step by step in a fresh interpreter")
        print(f"{'step':<84}{'whose':<20}{'MiB':>6}")
        for row in result["engine_start"]:
            print(f"{row['step']:<84}{row['whose']:<20}{row['mib']:>6.0f}")
        by_whose = {}
        for row in result["engine_start"]:
            by_whose[row["whose"]] = by_whose.get(row["whose"], 0) + row["mib"]
        print("total: " + ", ".join(f"{whose} {mib:.0f} MiB" for whose, mib in by_whose.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
