"""Memory one learner takes on a shared node, measured: a notebook kernel (the "shardlab" kernel, as JupyterLab
starts it) that runs ``sl.start_cluster(n)``, with its controller, launcher and engines, once every rank has
initialised DistributedManager and ShardTensor's operators (what the first cell of notebooks 02-08 leaves).

    python scripts/learner_memory.py [--ranks 4] [--json FILE]

Prints one row per process and the totals. RSS counts shared pages (libraries mapped by several processes) in
each of them; PSS splits shared pages between the processes that map them, so PSS sums to what the learner
really takes. Divide a node's free memory by the PSS per learner (with a margin for what the notebooks then
compute) to size a workshop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the kernel failed on {code!r}:\n{''.join(printed)[-3000:]}")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="engines per learner (default 4, as in the notebooks)")
    parser.add_argument("--json", help="also write the measurement to this file")
    args = parser.parse_args(argv)
    result = measure(args.ranks)
    print(f"# memory of one learner: notebook kernel + sl.start_cluster(n={args.ranks}) after init, CPU ranks; "
          f"{result['machine']}")
    print(f"{'process':<26}{'RSS MiB':>10}{'PSS MiB':>10}{'USS MiB':>10}")
    for row in result["processes"]:
        print(f"{row['process']:<26}{row['rss_mib']:>10.0f}{row['pss_mib']:>10.0f}{row['uss_mib']:>10.0f}")
    print(f"per engine (with its nanny): RSS {result['per_engine_mib']['rss_mib']} MiB, "
          f"PSS {result['per_engine_mib']['pss_mib']} MiB")
    print(f"per learner: PSS {result['per_learner_pss_mib']} MiB (RSS summed: {result['per_learner_rss_mib']} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
