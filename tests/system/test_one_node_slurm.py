"""The one-node Slurm of scripts/local-slurm.sh, as the docs have a user start it: `start` comes up, a job runs, `stop`
leaves no daemon of it running. Its slurmd writes its pid file by SlurmdPidFile's ``%n``, the host's own name, which
the script has to read by that name (it once looked for ``slurmd.pid``: `start` waited 30 s for a slurmd that ran,
and `stop` left it running).

The lifecycle needs the machine to itself: marked ``slurm_lifecycle``, it is the first test of a run (conftest.py
sorts it before the Slurm tests, which start the two-node mode), holds the lock under which the session's Slurm is
started, and skips where a Slurm of the script is up already."""

import os
import subprocess
from pathlib import Path

import psutil
import pytest

import machine_changes

ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "scripts" / "local-slurm.sh"
STATE = Path("/run/shardlab-slurm")


def local_slurm(*command: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LOCAL_SLURM), *command], capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.multirank
@pytest.mark.slurm_lifecycle
def test_the_one_node_slurm_starts_runs_a_job_and_stops_its_daemons(slurm_setup_lock):
    if os.geteuid() != 0 or not machine_changes.setup_allowed():
        pytest.skip(f"starts a Slurm as root: {machine_changes.SYSTEM_SETUP}=1 as root (`sudo make test-system`)")
    if local_slurm("status").returncode == 0 or local_slurm("status", "--nodes", "2").returncode == 0:
        pytest.skip("a Slurm of scripts/local-slurm.sh is up: the one-node lifecycle runs where none is")
    started = local_slurm("start")
    try:
        assert started.returncode == 0, started.stderr
        assert local_slurm("status").returncode == 0
        pid_file = STATE / f"slurmd-{os.uname().nodename.split('.')[0]}.pid"
        slurmd = int(pid_file.read_text())
        assert psutil.Process(slurmd).name() == "slurmd"
        job = subprocess.run(["srun", "--overcommit", "-n", "2", "hostname"], capture_output=True, text=True,
                             timeout=60)
        assert job.returncode == 0 and len(job.stdout.split()) == 2, job.stderr
    finally:
        stopped = local_slurm("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not psutil.pid_exists(slurmd) or psutil.Process(slurmd).name() != "slurmd", "stop left slurmd running"
    assert local_slurm("status").returncode != 0
