"""Cluster layer, without ranks: bad arguments and environment values, the rank count and the cores it may share,
the launcher and engines chosen for where the kernel runs, and start-up errors that name what went wrong. Starting
and stopping real MPI ranks: tests/multirank/test_cluster_start_stop.py."""

import os
from pathlib import Path

import pytest
import torch

from shardlab.ranks import bringup, commands, devices, engine_launchers, launch, owned, settings
from shardlab.ranks import cluster as cl
from shardlab.ranks.devices import usable_cores
from shardlab.ranks.px import ClusterError
from world_sizes import DEFAULT_SIZE


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n": 0}, ValueError, r"n=0: a cluster needs a whole number of engines, at least 1"),
    ({"n": 2.5}, ValueError, r"n=2\.5: a cluster needs a whole number"),
    ({"device": "tpu"}, ValueError, r"device='tpu': use 'auto', 'cpu' or 'cuda'"),
    ({"engines": "pbs"}, ValueError, r"engines='pbs': use 'mpi' .* or 'slurm'"),
    ({"engines": "slurm"}, ValueError, r"pass controller_ip='\*'"),
])
def test_bad_arguments_say_what_to_change(kwargs, error, match):
    with pytest.raises(error, match=match):
        cl.RankCluster(**kwargs)


def test_more_cuda_engines_than_gpus_says_how_to_get_cpu_ranks():
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"{gpus + 1} ranks but {gpus} GPU\(s\) visible to them.*device='cpu' for "
                                         rf"{gpus + 1} CPU ranks"):
        cl.RankCluster(n=gpus + 1, device="cuda")


@pytest.mark.parametrize("value, expected", [("2", 2), ("8", 8)])
def test_shardlab_ranks_picks_the_default_size(monkeypatch, value, expected):
    monkeypatch.setenv("SHARDLAB_RANKS", value)
    assert settings.ranks_asked(None, os.environ) == expected
    # CPU ranks, which every machine can place (8 ranks on 2-7 GPUs are refused): the size is under test, not the device
    assert cl.RankCluster(device=DEFAULT_SIZE.ranks(expected).or_skip().device).n == expected


@pytest.mark.parametrize("value", ["four", "0", "-2"])
def test_bad_shardlab_ranks_names_the_variable_and_its_value(monkeypatch, value):
    monkeypatch.setenv("SHARDLAB_RANKS", value)
    with pytest.raises(ClusterError, match=rf"SHARDLAB_RANKS='{value}' is not a whole number of ranks, at least 1"):
        cl.RankCluster()


def test_more_cpu_ranks_per_core_than_the_limit_are_refused_with_the_numbers_and_the_override(monkeypatch):
    monkeypatch.delenv("SHARDLAB_MAX_RANKS_PER_CORE", raising=False)
    cores = usable_cores()
    too_many = 4 * cores + 1
    with pytest.raises(ValueError, match=rf"{too_many} CPU ranks on {cores} CPU core\(s\) is .* more than the 4 this "
                                         rf"series starts \({4 * cores} ranks here\).*SHARDLAB_MAX_RANKS_PER_CORE=5"):
        cl.RankCluster(n=too_many, device="cpu")
    cl.RankCluster(n=4 * cores, device="cpu")  # at the limit: accepted
    monkeypatch.setenv("SHARDLAB_MAX_RANKS_PER_CORE", "5")
    assert cl.RankCluster(n=too_many, device="cpu").n == too_many  # asked for: accepted
    monkeypatch.setenv("SHARDLAB_MAX_RANKS_PER_CORE", "many")
    with pytest.raises(ValueError, match=r"SHARDLAB_MAX_RANKS_PER_CORE='many' is not a number"):
        cl.RankCluster(n=2, device="cpu")


class _Answer:
    """An ipyparallel result, answered by every rank or by none yet."""

    def __init__(self, value, ranks: int):
        self.value, self.ranks = value, ranks

    def wait(self, timeout):
        return self.value is not None

    def split(self):
        return [self] * self.ranks

    def ready(self):
        return self.value is not None

    def get(self):
        return self.value


class _SlowRanks:
    """A view whose ranks report their launcher rank, then never finish initialising."""

    def __init__(self, ranks: int):
        self.ranks = ranks

    def apply_async(self, function, *args):
        if function is launch.detect_launch:
            return _Answer([launch.LaunchInfo("openmpi", r, r, self.ranks, "", "", "OPENMPI")
                            for r in range(self.ranks)], self.ranks)
        return _Answer(None, self.ranks)


def test_a_slow_start_on_oversubscribed_cores_is_reported_as_that():
    cores = usable_cores()
    ranks = cores + 1
    slow_start = rf"initialise DistributedManager within 60 s\. {ranks} ranks share {cores} CPU core\(s\) here"
    with pytest.raises(ClusterError, match=slow_start + ".*longer start_timeout_s") as slow:
        bringup.initialise_ranks(_SlowRanks(ranks), list(range(ranks)), 0.0, 1.0)  # waits timeout_s + 60 s at least
    assert "collective" not in str(slow.value)
    with pytest.raises(ClusterError, match=r"within 60 s\. If they wait in a collective"):
        bringup.initialise_ranks(_SlowRanks(1), [0], 0.0, 1.0)  # not oversubscribed: a rank that never answered


def test_the_start_waits_longer_for_ranks_that_share_a_core(monkeypatch):
    """Ranks sharing a core run and import PyTorch by turns: both waits of a start (for the first answer, for the
    initialisation) grow with the ranks per core, never below the start timeout given."""
    cores, waits = usable_cores(), {}

    def wait_for(result, ids, timeout_s, what, hint=None):
        waits.setdefault(len(ids), set()).add(timeout_s)
        return result.get() if what == "report its launcher rank" else [{"rank": r} for r in ids]

    monkeypatch.setattr(bringup, "wait_for", wait_for)
    for ranks in (1, cores, 2 * cores, 4 * cores):
        bringup.initialise_ranks(_SlowRanks(ranks), list(range(ranks)), 0.0, 100.0)
    assert waits == {1: {100.0}, cores: {100.0}, 2 * cores: {200.0}, 4 * cores: {400.0}}


def test_cuda_engines_keep_the_visible_gpus_and_cpu_engines_see_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert "CUDA_VISIBLE_DEVICES" not in engine_launchers.engine_environment("cuda")  # inherited: engines use GPUs 4-7
    assert engine_launchers.engine_environment("cpu")["CUDA_VISIBLE_DEVICES"] == ""
    assert engine_launchers.engine_environment("cpu")["SHARDLAB_ORIGIN"]  # marked as ours


def test_engine_ids_that_are_not_ranks_are_refused():
    bringup.check_engine_ids([0, 1], [0, 1])  # ids equal ranks: accepted
    with pytest.raises(ClusterError, match=r"engine ids \[0, 1\] do not match launcher ranks \[1, 0\]"):
        bringup.check_engine_ids([0, 1], [1, 0])


# -- who starts the engines: arguments, else the environment (so notebooks run unchanged) --------------------


@pytest.fixture
def no_cluster_variables(monkeypatch):
    for name in ("SHARDLAB_ENGINES", "SHARDLAB_MPI", "SHARDLAB_CONTROLLER_IP", "SHARDLAB_SHARED_DIR", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_are_openmpi_on_loopback_in_the_temp_folder(no_cluster_variables):
    cluster = cl.RankCluster(n=2, device="cpu")
    assert (cluster.engines, cluster.mpi, cluster.launcher, cluster.expected_method) == ("mpi", "openmpi", "openmpi",
                                                                                         "openmpi")
    assert cluster.controller_ip == "127.0.0.1" and cluster.shared_dir is None


def test_the_environment_chooses_slurm_engines_for_unchanged_notebooks(no_cluster_variables, tmp_path):
    no_cluster_variables.setenv("SHARDLAB_ENGINES", "slurm")
    with pytest.raises(ValueError, match=r"SHARDLAB_CONTROLLER_IP='\*'"):
        cl.RankCluster(n=2, device="cpu")  # engines on other nodes cannot reach loopback: say so
    no_cluster_variables.setenv("SHARDLAB_CONTROLLER_IP", "*")
    no_cluster_variables.setenv("SHARDLAB_SHARED_DIR", str(tmp_path))
    cluster = cl.RankCluster(n=2, device="cpu")
    assert (cluster.launcher, cluster.expected_method, cluster.controller_ip) == ("slurm", "slurm", "*")
    assert cluster.shared_dir == str(tmp_path)
    # An argument wins over the environment.
    assert cl.RankCluster(n=2, device="cpu", engines="mpi", controller_ip="127.0.0.1").launcher == "openmpi"


def test_the_environment_chooses_mpich(no_cluster_variables):
    no_cluster_variables.setenv("SHARDLAB_MPI", "mpich")
    cluster = cl.RankCluster(n=2, device="cpu")
    assert (cluster.launcher, cluster.expected_method) == ("mpich", "env")


@pytest.mark.parametrize("variable, value, match", [
    ("SHARDLAB_ENGINES", "pbs", r"SHARDLAB_ENGINES='pbs': use 'mpi' \(mpiexec on this machine\) or 'slurm'"),
    ("SHARDLAB_MPI", "intel", r"SHARDLAB_MPI='intel': use 'openmpi' \(.*\) or 'mpich' \(MPICH's hydra"),
])
def test_bad_environment_values_name_the_variable(no_cluster_variables, variable, value, match):
    no_cluster_variables.setenv(variable, value)
    with pytest.raises(ValueError, match=match):
        cl.RankCluster(n=2, device="cpu")


def test_bad_mpi_argument_says_what_to_use():
    with pytest.raises(ValueError, match=r"mpi='intel': use 'openmpi' \(.*\) or 'mpich'"):
        cl.RankCluster(n=2, mpi="intel")


def _engine_set(launcher, profile):
    """The engine set ipyparallel builds from ``launcher`` when a cluster starts it, built here and not started."""
    return launcher.engine_set_class(work_dir=".", profile_dir=str(profile), cluster_id="shardlab-test",
                                     **launcher.engine_set_options(str(profile)))


def test_mpiexec_engines_run_this_environments_mpiexec_with_its_helpers_on_path(tmp_path):
    launcher = engine_launchers.MpiexecEngines(4, engine_launchers.engine_environment("cpu"))
    assert (launcher.name, launcher.started_by, launcher.expected_method) == ("openmpi", "mpiexec", "openmpi")
    command = launcher.command()
    assert command[0] == commands.find_mpiexec() and command[1:3] == ["--bind-to", "none"]
    assert ("--oversubscribe" in command) == (4 > usable_cores()) and launcher.jobs() == []
    engine_set = _engine_set(launcher, tmp_path)
    engine_set.n = 4
    args = engine_set.find_args()
    assert args[:3] == [command[0], "-n", "4"] and "--mpi" not in args  # ids come from ENGINE_CONFIG, not mpi4py
    assert engine_set.get_env()["PATH"].startswith(str(Path(command[0]).parent) + os.pathsep)
    assert engine_set.get_env()["CUDA_VISIBLE_DEVICES"] == "" and engine_set.get_env()["SHARDLAB_ORIGIN"]


def test_mpich_engines_are_reported_as_the_env_method(monkeypatch, tmp_path):
    hydra = tmp_path / "mpiexec.mpich"
    hydra.write_text("#!/bin/sh\n")
    hydra.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    launcher = engine_launchers.MpiexecEngines(2, {}, mpi="mpich")
    assert (launcher.started_by, launcher.expected_method) == ("mpiexec (MPICH)", "env")
    assert launcher.command() == [str(hydra)]  # hydra neither pins ranks nor needs --oversubscribe


def test_sbatch_engines_are_one_job_whose_script_is_in_the_profile(tmp_path):
    launcher = engine_launchers.SbatchEngines(4, engine_launchers.engine_environment("cpu"), "ipengine-test",
                                     ["--partition=gpu", "--time=02:00:00"])
    assert (launcher.name, launcher.expected_method, launcher.on_other_nodes) == ("slurm", "slurm", True)
    engine_set = _engine_set(launcher, tmp_path)
    engine_set.write_batch_script(4)
    script = Path(engine_set.batch_file).read_text()
    assert Path(engine_set.batch_file).parent == tmp_path  # in the profile, not in the notebook's folder
    assert "#SBATCH --job-name=ipengine-test\n#SBATCH --ntasks=4\n" in script
    assert "#SBATCH --partition=gpu\n#SBATCH --time=02:00:00\n" in script
    assert "\nsrun --kill-on-bad-exit=1 " in script and "ipengine" in script and "--mpi" not in script
    assert engine_set.get_env()["SHARDLAB_ORIGIN"] and engine_set.get_env()["CUDA_VISIBLE_DEVICES"] == ""
    assert "#SBATCH --no-requeue\n" in script and f"#SBATCH --comment={owned.origin()}\n" in script
    # Nodes use their own temp folder, and an IPython folder in the profile: nothing of this node's on theirs.
    assert engine_set.get_env()["TMPDIR"] == "" and engine_set.get_env()["IPYTHONDIR"] == str(tmp_path / "ipython")
    assert not launcher.exited()  # sbatch returns once the job is queued: that says nothing about the engines


def test_an_engines_job_that_ended_before_its_engines_registered_is_noticed_and_explained(monkeypatch, tmp_path):
    """Its nodes did not see the profile (this node's temp folder): the job failed at once, and wrote nothing."""
    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\ncase "$*" in *"%T %N"*) echo "FAILED node[1-2]";; '
                    '*) echo "7 is FAILED (JobLaunchFailure)";; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("SHARDLAB_SHARED_DIR", raising=False)
    launcher = engine_launchers.SbatchEngines(4, {}, "ipengine-test")
    launcher.engine_set_options(str(tmp_path / "profile"))
    launcher.engine_sets = [type("JobOf", (), {"job_id": "7", "get_output": lambda self: ""})()]
    assert launcher.exited() and launcher.job_state() == "7 is FAILED (JobLaunchFailure)"
    said = launcher.output()
    assert said.startswith(f"(nothing: the job ran on node[1-2] and wrote no output into {tmp_path / 'profile'}.")
    assert "Set SHARDLAB_SHARED_DIR to a folder every node of the job sees" in said
    fake.write_text('#!/bin/sh\necho "RUNNING node[1-2]"\n')
    assert not launcher.exited() and launcher._asked > 0  # rationed: the queue was read only a moment ago
    launcher._asked -= engine_launchers.QUEUE_EVERY_S
    assert not launcher.exited()  # read again: the job runs


def test_srun_step_engines_are_a_step_of_this_allocation(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    launcher = engine_launchers.SrunStepEngines(4, {}, ["--gpus-per-task=1"])
    assert launcher.command() == [str(fake), "--kill-on-bad-exit=1", "--gpus-per-task=1"]
    engine_set = _engine_set(launcher, tmp_path)
    engine_set.n = 4
    assert isinstance(engine_set, engine_launchers.RankEngineSetLauncher)
    args = engine_set.find_args()
    assert args[:4] == [str(fake), "-n", "4", "--kill-on-bad-exit=1"] and "--mpi" not in args
    assert engine_set.get_env()["TMPDIR"] == ""  # the allocation's other nodes use their own temp folder


def test_the_cluster_picks_the_launcher_for_where_it_runs(no_cluster_variables, tmp_path):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    no_cluster_variables.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    slurm = {"engines": "slurm", "controller_ip": "*", "n": 2, "device": "cpu"}
    assert type(cl.RankCluster(**slurm).engine_launcher) is engine_launchers.SbatchEngines  # outside an allocation
    no_cluster_variables.setenv("SLURM_JOB_ID", "42")
    assert type(cl.RankCluster(**slurm).engine_launcher) is engine_launchers.SrunStepEngines
    assert type(cl.RankCluster(n=2, device="cpu").engine_launcher) is engine_launchers.MpiexecEngines


# -- the rank count, resolved once ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engines", ["mpi", "slurm"])
@pytest.mark.parametrize("gpus", range(9))
def test_a_start_resolves_its_settings_once_and_every_step_reads_them(monkeypatch, gpus, engines):
    """``settings.resolve`` runs once per ``start_cluster`` (a restart reads what it resolved), reads the GPUs the
    engines see once (the kernel's only for mpiexec engines), and the cluster, its placement and its engine launcher
    agree on the count that ``devices.default_ranks`` gives for those GPUs."""
    for name in ("SHARDLAB_RANKS", "SHARDLAB_ENGINES", "SHARDLAB_MPI", "SHARDLAB_SHARED_DIR", "SLURM_JOB_ID",
                 "SLURM_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHARDLAB_MAX_RANKS_PER_CORE", "64")
    reads, resolved, real = [], [], settings.resolve
    monkeypatch.setattr(devices, "visible_gpus", lambda: reads.append(gpus) or gpus)
    monkeypatch.setattr(settings, "resolve", lambda *args, **kw: resolved.append(real(*args, **kw)) or resolved[-1])
    monkeypatch.setattr(cl.RankCluster, "start", lambda self, attach=True: self)  # no processes: settings are tested
    monkeypatch.setattr(cl, "_started_here", [])
    slurm = {"engines": "slurm", "controller_ip": "*", "slurm_args": [f"--gpus={gpus}"]} if engines == "slurm" else {}
    cluster = cl.start_cluster(activate=False, keep_warm=False, **slurm)
    cluster.restart()
    expected = devices.default_ranks(gpus)
    assert len(resolved) == 1 and cluster.settings is resolved[0]
    assert reads == ([gpus] if engines == "mpi" else [])
    assert cluster.n == cluster.placement.ranks == cluster.engine_launcher.n == expected
    assert (cluster.device, cluster.placement.gpus) == ("cuda" if gpus >= 2 else "cpu", gpus)
