"""Cluster layer: flags, start/stop on real MPI ranks, and cleaning up after a dead kernel."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

import shardlab as sl
from shardlab import cluster as cl


def test_oversubscribe_only_when_more_ranks_than_cores():
    cores = os.cpu_count()
    assert "--oversubscribe" not in cl.mpi_arguments(cores)
    assert "--oversubscribe" in cl.mpi_arguments(cores + 1)


def test_cluster_starts_blocking_and_stops_without_leftovers(no_leftovers):
    with sl.MPICluster(n=2, device="cpu") as cluster:
        assert [s["rank"] for s in cluster.states] == [0, 1]
        assert {s["backend"] for s in cluster.states} == {"gloo"}
        assert cluster.view.block is True
        cluster.view.execute("import torch.distributed as dist; world = dist.get_world_size()")
        assert cluster.view.pull("world") == [2, 2]
        # Connection files hold the CurveZMQ keys: owner-only, inside an owner-only profile folder.
        profile = Path(cluster._profile_dir)
        assert profile.stat().st_mode & 0o077 == 0
        connection_files = list((profile / "security").glob("ipcontroller-*.json"))
        assert connection_files
        for path in connection_files:
            assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"
            assert json.loads(path.read_text()).get("curve_serverkey"), "CurveZMQ is off"
            assert json.loads(path.read_text())["interface"] == "tcp://127.0.0.1"
        # And the controller really listens on loopback only, whatever its files say.
        controller = psutil.Process(cluster._cluster.controller.process.pid)
        listening = [c.laddr.ip for p in [controller, *controller.children(recursive=True)]
                     for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
        assert listening and set(listening) == {"127.0.0.1"}, listening
        pids = cluster.alive_processes()
        assert pids
    assert not cluster.alive_processes()


def test_stale_cluster_of_a_dead_kernel_is_cleaned(tmp_path):
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc = psutil.Process(orphan.pid)
    cl.REGISTRY.mkdir(parents=True, exist_ok=True)
    record = cl.REGISTRY / "shardlab-test-stale.json"
    record.write_text(json.dumps({
        "owner_pid": dead_owner.pid, "owner_created": 0.0,
        "processes": [[orphan.pid, proc.create_time()]], "profile_dir": str(tmp_path / "profile"),
    }))
    try:
        assert cl.clean_stale_clusters() >= 1
        assert orphan.wait(timeout=10) is not None
        assert not record.exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()
        record.unlink(missing_ok=True)


def test_live_owner_keeps_its_cluster(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    me = psutil.Process()
    record = cl.REGISTRY / "shardlab-test-live.json"
    cl.REGISTRY.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({
        "owner_pid": me.pid, "owner_created": me.create_time(),
        "processes": [[sleeper.pid, psutil.Process(sleeper.pid).create_time()]], "profile_dir": str(tmp_path),
    }))
    try:
        cl.clean_stale_clusters()
        time.sleep(0.2)
        assert sleeper.poll() is None, "a cluster whose kernel is alive was killed"
    finally:
        sleeper.kill()
        record.unlink(missing_ok=True)
