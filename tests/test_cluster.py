"""Cluster layer: bad arguments, start/stop on real MPI ranks, start-up errors that name what went wrong."""

import json
import os
import stat
from pathlib import Path

import psutil
import pytest
import torch

import shardlab as sl
from shardlab import cluster as cl
from shardlab import launch
from shardlab import launcher_programs as programs


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
    monkeypatch.setattr(programs, "find_mpiexec", lambda flavour="openmpi": str(broken))
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


# -- who starts the engines: arguments, else the environment (so notebooks run unchanged) --------------------


@pytest.fixture
def no_cluster_variables(monkeypatch):
    for name in ("SHARDLAB_ENGINES", "SHARDLAB_MPI", "SHARDLAB_CONTROLLER_IP", "SHARDLAB_SHARED_DIR", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_are_openmpi_on_loopback_in_the_temp_folder(no_cluster_variables):
    cluster = cl.MPICluster(n=2, device="cpu")
    assert (cluster.engines, cluster.mpi, cluster.launcher, cluster.expected_method) == ("mpi", "openmpi", "openmpi",
                                                                                         "openmpi")
    assert cluster.controller_ip == "127.0.0.1" and cluster.shared_dir is None


def test_the_environment_chooses_slurm_engines_for_unchanged_notebooks(no_cluster_variables, tmp_path):
    no_cluster_variables.setenv("SHARDLAB_ENGINES", "slurm")
    with pytest.raises(ValueError, match=r"SHARDLAB_CONTROLLER_IP='\*'"):
        cl.MPICluster(n=2, device="cpu")  # engines on other nodes cannot reach loopback: say so
    no_cluster_variables.setenv("SHARDLAB_CONTROLLER_IP", "*")
    no_cluster_variables.setenv("SHARDLAB_SHARED_DIR", str(tmp_path))
    cluster = cl.MPICluster(n=2, device="cpu")
    assert (cluster.launcher, cluster.expected_method, cluster.controller_ip) == ("slurm", "slurm", "*")
    assert cluster.shared_dir == str(tmp_path)
    # An argument wins over the environment.
    assert cl.MPICluster(n=2, device="cpu", engines="mpi", controller_ip="127.0.0.1").launcher == "openmpi"


def test_the_environment_chooses_mpich(no_cluster_variables):
    no_cluster_variables.setenv("SHARDLAB_MPI", "mpich")
    cluster = cl.MPICluster(n=2, device="cpu")
    assert (cluster.launcher, cluster.expected_method) == ("mpich", "env")


@pytest.mark.parametrize("variable, value, match", [
    ("SHARDLAB_ENGINES", "pbs", r"SHARDLAB_ENGINES='pbs': use 'mpi' \(mpiexec on this machine\) or 'slurm'"),
    ("SHARDLAB_MPI", "intel", r"SHARDLAB_MPI='intel': use 'openmpi' \(.*\) or 'mpich' \(MPICH's hydra"),
])
def test_bad_environment_values_name_the_variable(no_cluster_variables, variable, value, match):
    no_cluster_variables.setenv(variable, value)
    with pytest.raises(ValueError, match=match):
        cl.MPICluster(n=2, device="cpu")


def test_bad_mpi_argument_says_what_to_use():
    with pytest.raises(ValueError, match=r"mpi='intel': use 'openmpi' \(.*\) or 'mpich'"):
        cl.MPICluster(n=2, mpi="intel")


def _launcher(cluster, profile, monkeypatch):
    """The engine launcher ipyparallel would build for this cluster, configured as start() does, not started."""
    import ipyparallel as ipp

    ipp_cluster = ipp.Cluster(engines=cluster._engine_launcher(), n=cluster.n, cluster_id=cluster.cluster_id,
                              profile_dir=str(profile))
    cluster._configure_engines(ipp_cluster.config, str(profile), cl.engine_environment("cpu"))
    return ipp_cluster.engine_launcher_class(work_dir=".", parent=ipp_cluster, profile_dir=str(profile),
                                             cluster_id=cluster.cluster_id)


def test_outside_an_allocation_slurm_engines_are_one_sbatch_job_in_the_profile(no_cluster_variables, tmp_path):
    cluster = cl.MPICluster(n=4, device="cpu", engines="slurm", controller_ip="*",
                            slurm_args=["--partition=gpu", "--time=02:00:00"])
    launcher = _launcher(cluster, tmp_path, no_cluster_variables)
    launcher.write_batch_script(4)
    script = Path(launcher.batch_file).read_text()
    assert Path(launcher.batch_file).parent == tmp_path  # in the profile, not in the notebook's folder
    assert f"#SBATCH --job-name={cluster.job_name}\n#SBATCH --ntasks=4\n" in script
    assert "#SBATCH --partition=gpu\n#SBATCH --time=02:00:00\n" in script
    assert "\nsrun --kill-on-bad-exit=1 " in script and "ipengine" in script and "--mpi" not in script
    assert launcher.get_env()["SHARDLAB_ORIGIN"] and launcher.get_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_inside_an_allocation_srun_starts_the_engines_as_a_step(no_cluster_variables, tmp_path):
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    no_cluster_variables.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    no_cluster_variables.setenv("SLURM_JOB_ID", "42")
    cluster = cl.MPICluster(n=4, device="cpu", engines="slurm", controller_ip="*")
    launcher = _launcher(cluster, tmp_path, no_cluster_variables)
    launcher.n = 4
    assert isinstance(launcher, cl.RankEngineSetLauncher)
    args = launcher.find_args()
    assert args[:4] == [str(fake), "-n", "4", "--kill-on-bad-exit=1"] and "--mpi" not in args

