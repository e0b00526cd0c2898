"""Workshop operations: the kernel spec installed per user (where a JupyterHub single-user server looks), a
hung %%px cell interrupted from the kernel (what JupyterLab's stop button does) with the ranks recovering,
memory per engine and per learner measured, and the container recipe's `make lab` path."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    """A module of scripts/, which are run as files, not installed."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_in_kernel = _script("learner_memory").run  # runs code in a kernel: what it printed, or RuntimeError if it failed


def _as_another_server(home: Path) -> dict:
    """The environment of a Jupyter server that is not .venv's own (a JupyterHub single-user server, say): it
    searches the user's folder first. From inside .venv, jupyter would prefer .venv's own folder; this says not
    to, as a server from another environment does not even see it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
    return env | {"HOME": str(home), "JUPYTER_PREFER_ENV_PATH": "0"}


def test_make_kernel_user_installs_the_kernel_where_jupyterhub_finds_it(tmp_path):
    """`make kernel-user` puts the spec in ~/.local/share/jupyter/kernels, which every Jupyter server run by this
    user (a JupyterHub single-user server included) searches first; the spec runs this environment's Python."""
    env = _as_another_server(tmp_path)
    out = subprocess.run(["make", "-s", "kernel-user"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    specs = json.loads(subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"], env=env,
                                      capture_output=True, text=True, check=True).stdout)["kernelspecs"]
    spec = specs["shardlab"]
    assert Path(spec["resource_dir"]) == tmp_path / ".local/share/jupyter/kernels/shardlab"
    assert spec["spec"]["argv"][0] == sys.executable
    assert spec["spec"]["display_name"] == "Python (shardlab: PhysicsNeMo distributed)"
    # The spec found through the user's folder starts a kernel that imports the helpers.
    probe = ("from jupyter_client.manager import start_new_kernel\n"
             "km, kc = start_new_kernel(kernel_name='shardlab')\n"
             "out = []\n"
             "kc.execute_interactive('import shardlab, sys; print(sys.executable)', timeout=60,\n"
             "                       output_hook=lambda m: out.append(m['content'].get('text', '')))\n"
             "kc.stop_channels(); km.shutdown_kernel(now=True)\n"
             "print(''.join(out).strip())\n")
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0 and ran.stdout.strip().endswith(sys.executable), ran.stderr[-2000:]


def _wait_for_reply(kc, msg_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        msg = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg["content"]


START = """\
import shardlab as sl
cluster = sl.start_cluster(n=2, device="cpu", timeout_s=10)
pids = [s["pid"] for s in cluster.table()]"""
SLEEPS = "%%px\nimport time\nstarted = time.time()\ntime.sleep(600)"
RANK_1_SKIPS_THE_BARRIER = """\
%%px
import torch.distributed as dist
if dist.get_rank() == 0:
    dist.barrier()
else:
    time.sleep(600)"""
RESTART = """\
cluster.restart()
cluster.run("import torch, torch.distributed as dist; t = torch.ones(1); dist.all_reduce(t)", 60)
print(cluster.view.pull("t.item()"), set(pids) & {s["pid"] for s in cluster.table()})"""


@pytest.mark.multirank
def test_interrupting_a_hung_px_cell_reaches_the_ranks_and_they_recover(no_leftovers):
    """The kernel is interrupted (JupyterLab's stop button sends the same SIGINT) while a %%px cell sleeps on
    every rank: %%px passes SIGINT on to the engines, the cell ends within seconds, and the same ranks run the
    next cell. A cell stuck in a collective fails after timeout_s instead; cluster.restart() gives fresh ranks."""
    km, kc = start_new_kernel(kernel_name="shardlab", startup_timeout=120,
                              env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    try:
        run_in_kernel(kc, START, 400)
        msg_id = kc.execute(SLEEPS)
        time.sleep(8)  # the cell is running on both ranks
        km.interrupt_kernel()
        _wait_for_reply(kc, msg_id, 60)  # the interrupted cell replies (its ranks' sleeps are measured below)
        run_in_kernel(kc, "%%px\nslept = time.time() - started", 60)
        said = run_in_kernel(kc, "print(cluster.view.pull('slept'), [s['pid'] for s in cluster.table()] == pids)", 60)
        slept, same_ranks = re.fullmatch(r"\[(.*)\] (True|False)\s*", said).groups()
        assert all(float(s) < 60 for s in slept.split(",")) and same_ranks == "True", said

        # Rank 1 never joins rank 0's barrier: interrupting leaves rank 0 waiting in C++ until timeout_s, and the
        # process group is unusable after; restart() gives fresh ranks in the same kernel.
        msg_id = kc.execute(RANK_1_SKIPS_THE_BARRIER)
        time.sleep(5)
        km.interrupt_kernel()
        _wait_for_reply(kc, msg_id, 60)
        said = run_in_kernel(kc, RESTART, 400)
        assert said.strip().endswith("[2.0, 2.0] set()"), said
        run_in_kernel(kc, "cluster.stop()", 60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.multirank
def test_memory_per_engine_and_per_learner_is_measured(no_leftovers):
    """scripts/learner_memory.py (the figures on INSTRUCTORS.md's operations page): a kernel with a 4-rank
    cluster, every process measured after DistributedManager and ShardTensor's operators are ready."""
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/learner_memory.py"), "--ranks", "4", "--json",
                          str(artifacts / "learner-memory.json")], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    result = json.loads((artifacts / "learner-memory.json").read_text())
    roles = [row["process"] for row in result["processes"]]
    assert roles.count("notebook kernel") == 1 and "controller" in roles
    assert [f"rank {r} engine" in roles for r in range(4)] == [True] * 4
    assert 200 < result["per_engine_mib"]["pss_mib"] < 4000
    assert result["per_learner_pss_mib"] < result["per_learner_rss_mib"]
    assert "per learner: PSS" in out.stdout
