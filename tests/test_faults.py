"""Faults on real ranks (CPU): a raising rank, a dead engine, a killed notebook kernel, and two
notebooks at once. Each must end in a clear error or a clean recovery, never a hang or orphans."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ipyparallel.error import CompositeError, EngineError, NoEnginesRegistered

import shardlab as sl
from shardlab.report import rank_errors

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.multirank


@pytest.fixture
def cluster():
    """A fresh 2-rank cluster per test; request it after no_leftovers so it is stopped before that check."""
    with sl.MPICluster(n=2, device="cpu", timeout_s=10) as c:
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
cluster = sl.MPICluster(n=2, device="cpu").start()
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_kernel_is_cleaned_up_by_the_next_start(no_leftovers):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout.readline().strip() == "ready"
        kernel.kill()  # no atexit, no stop(): what a crashed notebook kernel leaves behind
        kernel.wait(10)
        assert sl.leftover_processes(), "expected orphaned engines/controller after the kernel died"
        assert sl.procs.clean_stale_clusters() >= 1  # what the next start_cluster does first
        deadline = time.monotonic() + 20
        while sl.leftover_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not sl.leftover_processes()
    finally:
        if kernel.poll() is None:
            kernel.kill()


def test_two_notebooks_at_once_do_not_collide(tmp_path, no_leftovers):
    for name in ("a.ipynb", "b.ipynb"):
        shutil.copy(FIXTURES / "passes.ipynb", tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--nbmake", "-p", "no:cacheprovider", "a.ipynb",
                           "b.ipynb"], cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:]
