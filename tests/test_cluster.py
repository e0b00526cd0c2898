"""Cluster layer: bad arguments, start/stop on real MPI ranks, start-up errors that name what went wrong."""

import json
import stat
from pathlib import Path

import psutil
import pytest
import torch

import shardlab as sl
from shardlab import cluster as cl
from shardlab import launch


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n": 0}, ValueError, r"n=0: a cluster needs a whole number of engines, at least 1"),
    ({"n": 2.5}, ValueError, r"n=2\.5: a cluster needs a whole number"),
    ({"device": "tpu"}, ValueError, r"device='tpu': use 'auto', 'cpu' or 'cuda'"),
    ({"engines": "pbs"}, ValueError, r"engines='pbs': use 'mpi' .* or 'slurm'"),
    ({"engines": "slurm"}, ValueError, r"pass controller_ip='\*'"),
])
def test_bad_arguments_say_what_to_change(kwargs, error, match):
    with pytest.raises(error, match=match):
        cl.MPICluster(**kwargs)


def test_more_cuda_engines_than_gpus_says_how_to_get_cpu_ranks():
    gpus = torch.cuda.device_count()
    with pytest.raises(cl.ClusterError, match=rf"n={gpus + 1} engines with device='cuda', but only {gpus} GPU\(s\) "
                                              rf"are visible.*device='cpu' for {gpus + 1} CPU ranks"):
        cl.MPICluster(n=gpus + 1, device="cuda")


@pytest.mark.parametrize("value, expected", [("2", 2), ("8", 8)])
def test_shardlab_ranks_picks_the_default_size(monkeypatch, value, expected):
    monkeypatch.setenv("SHARDLAB_RANKS", value)
    assert cl.default_engine_count() == expected
    assert cl.MPICluster().n == expected


def test_bad_shardlab_ranks_says_what_to_set(monkeypatch):
    monkeypatch.setenv("SHARDLAB_RANKS", "four")
    with pytest.raises(cl.ClusterError, match=r"SHARDLAB_RANKS='four' is not a whole number"):
        cl.default_engine_count()


def test_cuda_engines_keep_the_visible_gpus_and_cpu_engines_see_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert "CUDA_VISIBLE_DEVICES" not in cl.engine_environment("cuda")  # inherited: engines use GPUs 4-7
    assert cl.engine_environment("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert cl.engine_environment("cpu")["SHARDLAB_ORIGIN"]  # marked as ours


class _Answers:
    """An ipyparallel result whose ranks are given: what _check_ranks reads."""

    def __init__(self, ranks):
        self.ranks = ranks

    def wait(self, timeout):
        return True

    def get(self):
        return [launch.LaunchInfo("openmpi", r, r, 2, "", "", "OPENMPI") for r in self.ranks]


class _Client:
    ids = [0, 1]

    def __init__(self, ranks):
        self.ranks = ranks

    def __getitem__(self, key):
        return type("View", (), {"apply_async": lambda view, fn: _Answers(self.ranks), "targets": [0, 1]})()


def test_engine_ids_that_are_not_ranks_are_refused():
    cluster = cl.MPICluster(n=2, device="cpu")
    cluster.client = _Client([0, 1])
    cluster._check_ranks()  # ids equal ranks: accepted
    cluster.client = _Client([1, 0])
    with pytest.raises(cl.ClusterError, match=r"engine ids \[0, 1\] do not match launcher ranks \[1, 0\]"):
        cluster._check_ranks()


@pytest.mark.multirank
def test_engines_that_never_start_are_reported_with_what_mpiexec_said(monkeypatch, tmp_path, no_leftovers):
    broken = tmp_path / "mpiexec"
    broken.write_text("#!/bin/sh\necho 'mpiexec: no slots left on this node' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(launch, "find_mpiexec", lambda flavour="openmpi": str(broken))
    cluster = cl.MPICluster(n=2, device="cpu", start_timeout_s=60)
    with pytest.raises(cl.ClusterError, match=r"only 0 of 2 engines registered(.|\n)*no slots left on this node"):
        cluster.start()
    assert not cluster.alive_processes()


@pytest.mark.multirank
def test_cluster_starts_blocking_and_stops_without_leftovers(no_leftovers):
    with sl.MPICluster(n=2, device="cpu") as cluster:
        assert [s["rank"] for s in cluster.states] == [0, 1]
        assert {s["backend"] for s in cluster.states} == {"gloo"}
        assert cluster.view.block is True
        cluster.view.execute("import sys, torch.distributed as dist; world = dist.get_world_size()")
        assert cluster.view.pull("world") == [2, 2]
        # Engines take their ids from the launcher's rank, without importing an MPI library of their own.
        cluster.view.execute("no_mpi4py = 'mpi4py' not in sys.modules")
        assert cluster.view.pull("no_mpi4py") == [True, True]
        # Connection files hold the CurveZMQ keys: owner-only, inside an owner-only profile folder.
        profile = Path(cluster._record.profile_dir)
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
        assert cluster.alive_processes()
    assert not cluster.alive_processes()
    assert not profile.exists() and not cluster._record.path.exists()
