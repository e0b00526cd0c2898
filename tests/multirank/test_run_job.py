"""run_job, the one way a job of ranks is run: it hands back what rank 0 wrote and leaves no log folder, and on
time-out stops every rank and names the job. Its command lines, without ranks: tests/unit/test_launch.py."""

import tempfile
from pathlib import Path

import pytest

from shardlab.ranks.launch import JobFailed, run_job

RESULT = """
import os, sys
from shardlab.ranks.launch import write_job_result
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
if rank == 0:
    write_job_result({"args": sys.argv[1:], "world": os.environ["OMPI_COMM_WORLD_SIZE"],
                      "session": os.environ["PMIX_SERVER_TMPDIR"]})
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.multirank
def test_run_job_returns_what_rank_0_wrote_and_leaves_no_log_folder(tmp_path, monkeypatch, no_leftovers):
    script = tmp_path / "job.py"
    script.write_text(RESULT)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    job = run_job("openmpi", 2, script, ["0", "more"], timeout_s=120, env={"CUDA_VISIBLE_DEVICES": ""})
    session = Path(job.result.pop("session"))  # OpenMPI's session folder: in the job's log folder, not the temp folder
    assert session.parent.parent == tmp_path / "temp" and session.parent.name.startswith("shardlab-job-")
    assert (job.result, job.returncode) == ({"args": ["0", "more"], "world": "2"}, 0)
    assert job.command[0].endswith("mpiexec") and job.seconds > 0
    failing = r"openmpi job of 2 rank\(s\) running .*job\.py failed \(exit code 3\)"
    with pytest.raises(JobFailed, match=failing) as failed:
        run_job("openmpi", 2, script, ["3"], timeout_s=120)
    assert failed.value.result["args"] == ["3"]  # what it wrote before it failed
    assert run_job("openmpi", 2, script, ["3"], timeout_s=120, check=False).returncode == 3
    assert not list((tmp_path / "temp").iterdir())  # the jobs' log folders are gone


@pytest.mark.multirank
def test_run_job_on_time_out_stops_every_rank_and_names_the_job(tmp_path, no_leftovers):
    script = tmp_path / "stuck.py"
    script.write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    with pytest.raises(TimeoutError, match=r"openmpi job of 2 rank\(s\) running .*stuck\.py did not finish within 5 s"):
        run_job("openmpi", 2, script, timeout_s=5)
