"""Cluster failures on real ranks (CPU), in one place: engines that never start, a raising rank, a dead engine, a
hung %%px cell interrupted from the kernel, a killed notebook kernel, and two notebooks at once. Each must end in a
clear error or a clean recovery, never a hang or orphans. Notebook 08 shows the same to learners."""

import importlib.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ipyparallel.error import CompositeError, EngineError, NoEnginesRegistered
from jupyter_client.manager import start_new_kernel

import shardlab as sl
from shardlab.ranks.px import rank_errors

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
pytestmark = pytest.mark.multirank


def _script(name: str):
    """A module of scripts/, which are run as files, not installed."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_in_kernel = _script("learner_memory").run  # runs code in a kernel: what it printed, or RuntimeError if it failed


def test_engines_that_never_start_are_reported_with_what_mpiexec_said(monkeypatch, tmp_path, no_leftovers):
    broken = tmp_path / "mpiexec"
    broken.write_text("#!/bin/sh\necho 'mpiexec: no slots left on this node' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sl.ranks.engine_launchers, "find_mpiexec", lambda flavour="openmpi": str(broken))
    cluster = sl.RankCluster(n=2, device="cpu", start_timeout_s=60)
    with pytest.raises(sl.ClusterError, match=r"only 0 of 2 engines registered(.|\n)*no slots left on this node"):
        cluster.start()
    assert not cluster.alive_processes()


@pytest.fixture
def cluster():
    """A fresh 2-rank cluster per test; request it after no_leftovers so it is stopped before that check."""
    with sl.RankCluster(n=2, device="cpu", timeout_s=10) as c:
        yield c


def test_rank_error_names_the_rank_and_the_cluster_stays_usable(no_leftovers, cluster):
    with pytest.raises(CompositeError) as failure:
        cluster.run("import torch.distributed as dist\nif dist.get_rank() == 1: raise ValueError('boom')", 60)
    lines = sl.summarize_rank_errors(rank_errors(failure.value), [0, 1])
    assert lines == ["rank 1: ValueError: boom"]
    cluster.run("ok = dist.get_rank() + 1", 60)
    assert cluster.view.pull("ok") == [1, 2]


def test_dead_engine_is_a_clear_error_and_restart_recovers(no_leftovers, cluster):
    old = [s["pid"] for s in cluster.states]
    os.kill(old[1], signal.SIGKILL)
    # MPI takes every rank down with the one that died; within 30 s a call must say so.
    with pytest.raises((CompositeError, EngineError, NoEnginesRegistered)) as failure:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cluster.run("x = 1", 10)
            time.sleep(0.5)
    said = str(failure.value)
    assert isinstance(failure.value, NoEnginesRegistered) or "Engine 1 died" in said, said
    cluster.restart()
    assert not set(old) & {s["pid"] for s in cluster.states}
    cluster.run("import torch.distributed as dist; world = dist.get_world_size()", 60)
    assert cluster.view.pull("world") == [2, 2]


KERNEL = """
import sys, time
import shardlab as sl
cluster = sl.RankCluster(n=2, device="cpu").start()
print("ready", flush=True)
time.sleep(600)
"""


def _wait_for_marks(folder: Path, prefix: str, ranks: int, timeout_s: float = 120) -> None:
    """Until every rank has marked that it is inside the cell; a time-out names the ranks that never did."""
    deadline = time.monotonic() + timeout_s
    while (missing := [r for r in range(ranks) if not (folder / f"{prefix}-{r}").exists()]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {missing} never started the {prefix} cell within {timeout_s:.0f} s")
        time.sleep(0.1)


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
# Each rank leaves a mark in MARKS once it is inside the cell: the test interrupts only then.
SLEEPS = """\
%%px
import pathlib, time
import torch.distributed as dist
pathlib.Path(MARKS, f"sleeps-{dist.get_rank()}").touch()
try:
    time.sleep(600)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True"""
RANK_1_SKIPS_THE_BARRIER = """\
%%px
pathlib.Path(MARKS, f"barrier-{dist.get_rank()}").touch()
if dist.get_rank() == 0:
    dist.barrier()
else:
    time.sleep(600)"""
RESTART = """\
cluster.restart()
cluster.run("import torch, torch.distributed as dist; t = torch.ones(1); dist.all_reduce(t)", 60)
print(cluster.view.pull("t.item()"), set(pids) & {s["pid"] for s in cluster.table()})"""


def test_interrupting_a_hung_px_cell_reaches_the_ranks_and_they_recover(no_leftovers, tmp_path):
    """The kernel is interrupted (JupyterLab's stop button sends the same SIGINT) while a %%px cell sleeps on
    every rank: %%px passes SIGINT on to the engines, the cell ends within seconds, and the same ranks run the
    next cell. A cell stuck in a collective fails after timeout_s instead; cluster.restart() gives fresh ranks."""
    km, kc = start_new_kernel(kernel_name="shardlab", startup_timeout=120,
                              env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    try:
        run_in_kernel(kc, START + f"\ncluster.view.push({{'MARKS': {str(tmp_path)!r}}})", 400)
        msg_id = kc.execute(SLEEPS)
        _wait_for_marks(tmp_path, "sleeps", 2)
        km.interrupt_kernel()
        _wait_for_reply(kc, msg_id, 60)
        said = run_in_kernel(kc, "print(cluster.view.pull('interrupted'), [s['pid'] for s in cluster.table()] == pids)",
                             60)
        assert said.strip() == "[True, True] True", said  # SIGINT reached both ranks' sleeps; the same ranks run on

        # Rank 1 never joins rank 0's barrier: interrupting leaves rank 0 waiting in C++ until timeout_s, and the
        # process group is unusable after; restart() gives fresh ranks in the same kernel.
        msg_id = kc.execute(RANK_1_SKIPS_THE_BARRIER)
        _wait_for_marks(tmp_path, "barrier", 2)
        km.interrupt_kernel()
        _wait_for_reply(kc, msg_id, 60)
        said = run_in_kernel(kc, RESTART, 400)
        assert said.strip().endswith("[2.0, 2.0] set()"), said
        run_in_kernel(kc, "cluster.stop()", 60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_killed_kernel_is_cleaned_up_by_the_next_start(no_leftovers):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True)
    try:
        said = []  # the start's own status lines, then ours
        while not said or said[-1] not in ("ready", ""):
            said.append(kernel.stdout.readline().strip())
        assert said[-1] == "ready" and any(line.startswith("started 2 CPU ranks") for line in said), said
        kernel.kill()  # no atexit, no stop(): what a crashed notebook kernel leaves behind
        kernel.wait(10)
        assert sl.leftover_processes(), "expected orphaned engines/controller after the kernel died"
        assert sl.ranks.records.clean_stale_clusters() >= 1  # what the next start_cluster does first
        deadline = time.monotonic() + 20
        while sl.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not sl.leftover_processes()
    finally:
        if kernel.poll() is None:
            kernel.kill()
        sl.ranks.records.clean_stale_clusters()  # a failed assertion above must not leave the dead kernel's ranks on


def test_two_notebooks_at_once_do_not_collide(tmp_path, no_leftovers):
    for name in ("a.ipynb", "b.ipynb"):
        shutil.copy(FIXTURES / "passes.ipynb", tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--nbmake", "-p", "no:cacheprovider", "a.ipynb",
                           "b.ipynb"], cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:]
