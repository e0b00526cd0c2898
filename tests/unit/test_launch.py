"""detect_launch over plain environment dicts, and launcher command lines and ports (no processes, no
torch.distributed). run_job on real ranks: tests/multirank/test_run_job.py."""

import atexit
import socket
import sys
import tempfile

import pytest

from shardlab.ranks import commands
from shardlab.ranks.commands import (
    CONTROLLER_PORTS,
    ephemeral_range,
    free_port,
    free_ports,
    job_command,
    torchrun_command,
)
from shardlab.ranks.devices import usable_cores
from shardlab.ranks.launch import LaunchError, LaunchInfo, detect_launch, run_job

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NPROCS": "4", "SLURM_LOCALID": "0", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}


@pytest.mark.parametrize(
    "env, launcher, method, rank, local_rank, world",
    [
        (TORCHRUN, "torchrun", "ENV", 1, 1, 4),
        (SLURM, "slurm", "SLURM", 2, 0, 4),
        (OPENMPI, "openmpi", "OPENMPI", 3, 3, 4),
        (MPICH, "mpich", None, 1, 1, 2),
        ({}, "none", None, 0, 0, 1),
    ],
)
def test_each_launcher(env, launcher, method, rank, local_rank, world):
    info = detect_launch(env)
    assert (info.launcher, info.physicsnemo_method) == (launcher, method)
    assert (info.rank, info.local_rank, info.world_size) == (rank, local_rank, world)


def test_torchrun_address_and_port():
    info = detect_launch(TORCHRUN)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", "29500")


def test_slurm_address_comes_from_slurm_not_master_addr():
    # PhysicsNeMo's SLURM method ignores MASTER_ADDR, so the report must too.
    info = detect_launch({**SLURM, "MASTER_ADDR": "ignored"})
    assert info.master_addr == "10.0.0.9"


def test_mpich_note_explains_pmi_is_not_read():
    assert "PMI" in detect_launch(MPICH).note


@pytest.mark.parametrize(
    "env, launcher",
    [
        ({**OPENMPI, **SLURM, **TORCHRUN}, "torchrun"),
        ({**OPENMPI, **SLURM}, "slurm"),
        # The forced method wins over autodetection, as in PhysicsNeMo.
        ({**TORCHRUN, **OPENMPI, "PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD": "OPENMPI"}, "openmpi"),
        ({**TORCHRUN, **SLURM, "PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD": "SLURM"}, "slurm"),
        ({**TORCHRUN, **SLURM, "PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD": "ENV"}, "torchrun"),
    ],
)
def test_precedence(env, launcher):
    assert detect_launch(env).launcher == launcher


def test_bad_forced_method_lists_accepted_values():
    with pytest.raises(LaunchError, match="ENV, SLURM or OPENMPI"):
        detect_launch({**TORCHRUN, "PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD": "MPI"})


def _without(env, name):
    return {k: v for k, v in env.items() if k != name}


# Every mistake must surface as a LaunchError that says what to change, never as the
# ZeroDivisionError/ValueError/TypeError PhysicsNeMo or int() would raise later.
@pytest.mark.parametrize(
    "env, match",
    [
        (_without(TORCHRUN, "LOCAL_RANK"), r"LOCAL_RANK is not set(.|\n)*also set LOCAL_RANK"),
        ({**TORCHRUN, "RANK": "one"}, "RANK='one' is not an integer"),
        ({**TORCHRUN, "RANK": ""}, "RANK is not set"),
        ({**TORCHRUN, "RANK": "4"}, r"rank 4 is outside 0\.\.3"),
        ({**TORCHRUN, "RANK": "-1"}, r"rank -1 is outside"),
        ({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "0"}, "world size is 0; it must be at least 1"),
        ({**TORCHRUN, "LOCAL_RANK": "9"}, "local rank 9 is outside"),
        ({**SLURM, "SLURM_NPROCS": "x"}, "SLURM_NPROCS='x' is not an integer"),
        (_without(OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK"),
         "OMPI_COMM_WORLD_LOCAL_RANK is not set.*set OMPI_COMM_WORLD_LOCAL_RANK too"),
        (_without(MPICH, "MPI_LOCALRANKID"), "MPI_LOCALRANKID nor PMI_LOCAL_RANK.*set LOCAL_RANK"),
        (_without(MPICH, "PMI_SIZE"), "PMI_SIZE is not set"),
    ],
)
def test_bad_environment_raises_launch_error(env, match):
    with pytest.raises(LaunchError, match=match):
        detect_launch(env)


def test_mpich_accepts_pmi_local_rank():
    env = {**_without(MPICH, "MPI_LOCALRANKID"), "PMI_LOCAL_RANK": "0"}
    assert detect_launch(env).local_rank == 0


def test_as_row_has_the_dataclass_fields():
    row = detect_launch(TORCHRUN).as_row()
    assert list(row) == list(LaunchInfo.__dataclass_fields__)
    assert row["launcher"] == "torchrun" and row["rank"] == 1 and row["note"] == ""


@pytest.fixture
def fake_srun(monkeypatch, tmp_path):
    """An ``srun`` (that does nothing) alone on PATH."""
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    return fake


def test_srun_command_runs_this_python_as_one_job_step(fake_srun):
    assert job_command("slurm", 4, "-m", "shardlab.tools.smoke") == [
        str(fake_srun), "--ntasks=4", "--kill-on-bad-exit=1", sys.executable, "-m", "shardlab.tools.smoke"]


def test_missing_srun_says_where_slurm_comes_from(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"srun not found: run this on a Slurm cluster.*scripts/local-slurm.sh start"):
        job_command("slurm", 2, "x.py")


def test_unknown_launcher_lists_the_four():
    with pytest.raises(ValueError, match="use torchrun, openmpi, mpich or slurm"):
        job_command("pbs", 2, "x.py")


def test_srun_inside_a_job_step_overlaps_it(fake_srun, monkeypatch):
    """JupyterLab started with srun runs in a step; a second srun without --overlap would wait for it forever."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert job_command("slurm", 2, "x.py")[:4] == [str(fake_srun), "--ntasks=2", "--kill-on-bad-exit=1", "--overlap"]


def test_free_ports_are_below_the_range_outgoing_connections_take():
    """A port from the ephemeral range could be handed to an engine's outgoing connection before rank 0 listens."""
    low, _ = ephemeral_range()
    assert all(1024 <= port < low for port in (free_port() for _ in range(20)))


def test_the_controllers_ports_are_distinct_free_and_from_their_own_window(monkeypatch):
    monkeypatch.setattr(commands, "ephemeral_range", lambda: (32768, 60999))  # Linux's default, whatever this machine's
    ports = free_ports(24, CONTROLLER_PORTS)
    assert len(set(ports)) == 24 and all(CONTROLLER_PORTS[0] <= port < CONTROLLER_PORTS[1] for port in ports)
    with socket.socket() as taken:  # a port something listens on is never handed out
        taken.bind(("", ports[0]))
        taken.listen()
        monkeypatch.setattr(commands.random, "Random", lambda: FixedDraws([ports[0], ports[1]]))
        assert free_ports(1, CONTROLLER_PORTS) == [ports[1]]
    # Where the ephemeral range starts below the window, none: ipyparallel then picks its ports itself.
    monkeypatch.setattr(commands, "ephemeral_range", lambda: (CONTROLLER_PORTS[0], 60999))
    assert free_ports(24, CONTROLLER_PORTS) == []


class FixedDraws:
    def __init__(self, draws):
        self.draws = iter(draws)

    def randrange(self, *window):
        return next(self.draws)


def test_torchrun_command_is_only_a_command_line(monkeypatch, tmp_path):
    """No temp folder and no exit handler at call time: the job runner owns torchrun's log folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(atexit, "register", lambda *a, **k: pytest.fail("torchrun_command registered an exit handler"))
    cmd = torchrun_command(2, "-m", "shardlab.tools.smoke", log_dir="/logs/here")
    assert cmd[:2] == [sys.executable, "-m"] and "--nproc-per-node=2" in cmd and "--log-dir=/logs/here" in cmd
    assert cmd[-2:] == ["-m", "shardlab.tools.smoke"] and not list(tmp_path.iterdir())


def test_a_torchrun_job_without_a_log_folder_is_refused():
    with pytest.raises(ValueError, match="torchrun needs log_dir"):
        job_command("torchrun", 2, "x.py")
    # no_leftovers: mpiexec and both ranks are gone


def test_a_job_of_more_cpu_ranks_per_core_than_the_limit_is_refused_before_it_starts(monkeypatch):
    monkeypatch.delenv("SHARDLAB_MAX_RANKS_PER_CORE", raising=False)
    too_many = 4 * usable_cores() + 1
    with pytest.raises(ValueError, match=rf"{too_many} CPU ranks on .*SHARDLAB_MAX_RANKS_PER_CORE="):
        run_job("openmpi", too_many, "shardlab.tools.smoke", timeout_s=1, device="cpu")
