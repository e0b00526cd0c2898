"""A real Slurm (one of scripts/local-slurm.sh that is up, its single node or its two; `make test-system` starts the
two; see conftest.py). On two nodes, 4 tasks take both and the kernel runs on the login node, so these run across
nodes too (tests/system/test_two_nodes.py asserts what only differs there):
srun runs the smoke CLI, a notebook kernel drives Slurm engines with %%px, a failed start leaves no job, and
engines started inside an allocation are a step of it. Notebooks on Slurm engines: test_two_nodes.py.

Every test checks that the queue holds none of its jobs afterwards, and ``no_leftovers`` that no process
it started is still alive."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest

import shardlab as sl
from notebook_runner import run_notebook
from shardlab.ranks import bringup, records
from shardlab.ranks import cluster as cl
from shardlab.ranks.px import ClusterError

pytestmark = [pytest.mark.multirank, pytest.mark.slurm]


def queue() -> list[tuple[str, str]]:
    """(job id, job name) of every job in the queue."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True, timeout=30, check=True)
    return [tuple(line.split(maxsplit=1)) for line in out.stdout.splitlines() if line.strip()]


def left_in_queue(job: str, wait_s: float = 30.0) -> bool:
    """Whether ``job`` is still queued after ``wait_s`` (a job that just ended is COMPLETING for a moment)."""
    deadline = time.monotonic() + wait_s
    while job in {j for j, _ in queue()}:
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)
    return False


def test_srun_runs_the_smoke_cli_on_4_ranks_with_every_check(no_leftovers):
    report = sl.tools.smoke.run_smoke("slurm", 4)
    assert report["returncode"] == 0 and report["ok"], json.dumps(report, indent=1)[-3000:]
    assert report["command"].endswith("srun --ntasks=4 --kill-on-bad-exit=1 python -m shardlab.tools.smoke "
                                      "--distributed --domain=2 --check-scatter --check-sync --check-grad")
    assert report["mesh"] == {"ddp": 2, "domain": 2}
    assert [r["rank"] for r in report["ranks"]] == [0, 1, 2, 3]
    for row in report["ranks"]:
        assert (row["launcher"], row["method"], row["backend"], row["world_size"]) == ("slurm", "slurm", "gloo", 4)
        assert all(row[name]["ok"] for name in sl.tools.smoke.CHECKS)


CLUSTER_NOTEBOOK = [
    """\
import subprocess
import shardlab as sl

cluster = sl.start_cluster(n=4, device="cpu", engines="slurm", controller_ip="*")
job = cluster.slurm_jobs[0]
print("job", job, cluster.job_name)
assert (job, cluster.job_name) in [tuple(line.split()) for line in
                                   subprocess.run(["squeue", "-h", "-o", "%i %j"], capture_output=True,
                                                  text=True).stdout.splitlines()]
assert [s["rank"] for s in cluster.table()] == [0, 1, 2, 3]
assert {s["method"] for s in cluster.table()} == {"slurm"} == {cluster.expected_method}""",
    """\
%%px
import torch
import torch.distributed as dist

total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, dist.get_rank())""",
    """\
assert cluster.view.pull("total.item()") == [6.0] * 4
assert cluster.view.pull("gathered") == [[0, 1, 2, 3]] * 4
cluster.stop()
assert not sl.ranks.slurm.slurm_jobs_named(cluster.job_name), "the engines' job is still in the queue"
assert not cluster.alive_processes()""",
]


def test_slurm_engines_run_px_collectives_from_a_notebook_kernel(tmp_path, no_leftovers):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in CLUSTER_NOTEBOOK])
    nb.metadata.kernelspec = {"name": "shardlab", "display_name": "shardlab", "language": "python"}
    path = tmp_path / "slurm_cluster.ipynb"
    nbformat.write(nb, path)
    run_notebook(path, timeout_s=400, rehearse=False)  # the notebook's last cell checks the queue after stop()


def test_a_failed_start_leaves_no_job_and_no_process(monkeypatch, no_leftovers):
    def refuse(ids, ranks):
        raise ClusterError("refused on purpose, after the engines' job was submitted")

    monkeypatch.setattr(bringup, "check_engine_ids", refuse)
    cluster = cl.RankCluster(n=2, device="cpu", engines="slurm", controller_ip="*")
    with pytest.raises(ClusterError, match="refused on purpose"):
        cluster.start()
    assert cluster.slurm_jobs, "the start never submitted a job: nothing was tested"
    assert not set(cluster.slurm_jobs) & {job for job, _ in queue()}, "a failed start left its job in the queue"
    assert not cluster.alive_processes()
    assert not Path(cluster.profile_dir).exists()


INSIDE_ALLOCATION = textwrap.dedent("""
    import json, os, subprocess, sys
    import shardlab as sl

    with sl.RankCluster(n=4, device="cpu", engines="slurm", controller_ip="*", shared_dir=sys.argv[1]) as cluster:
        cluster.view.execute("import os, torch, torch.distributed as dist; t = torch.ones(1); dist.all_reduce(t); "
                             "job, step = os.environ['SLURM_JOB_ID'], os.environ.get('SLURM_STEP_ID')")
        print(json.dumps({
            "allocation": os.environ["SLURM_JOB_ID"], "engine_jobs": cluster.view.pull("job"),
            "engine_steps": cluster.view.pull("step"), "sums": cluster.view.pull("t.item()"),
            "submitted": cluster.slurm_jobs, "profile": cluster.profile_dir,
            "queued_as_engines": sl.ranks.slurm.slurm_jobs_named(cluster.job_name),
            "queue": subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split(),
        }))
""")


def test_inside_an_allocation_engines_are_a_step_of_it_not_a_new_job(tmp_path, no_leftovers):
    """`salloc -n 4 python script.py`: srun starts the engines in the allocation; nothing new is queued. The
    profile (connection files, engine config) goes to the shared folder given, and is removed at the end."""
    script = tmp_path / "inside.py"
    script.write_text(INSIDE_ALLOCATION)
    shared = Path(os.environ.get("SHARDLAB_SHARED_DIR") or tmp_path, f"inside-{tmp_path.name}")  # two nodes see it
    out = subprocess.run(["salloc", "--ntasks=4", sys.executable, str(script), str(shared)], capture_output=True,
                         text=True, timeout=500, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    allocation = seen["allocation"]
    assert seen["engine_jobs"] == [allocation] * 4 and seen["sums"] == [4.0] * 4
    assert len(set(seen["engine_steps"])) == 1 and None not in seen["engine_steps"]  # one srun step, 4 tasks
    assert seen["submitted"] == [] and seen["queued_as_engines"] == [] and allocation in seen["queue"]
    assert Path(seen["profile"]).parent == shared and not Path(seen["profile"]).exists()
    shared.rmdir()  # empty: the cluster removed its profile
    assert not left_in_queue(allocation)


def test_a_crashed_kernels_slurm_job_is_cancelled_by_the_next_start(tmp_path, no_leftovers):
    """The kernel dies without stop(): its record names the engines' job, and the next start cancels it."""
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time, shardlab as sl
        cluster = sl.RankCluster(n=2, device="cpu", engines="slurm", controller_ip="*").start()
        print("JOB", cluster.slurm_jobs[0], cluster.job_name, flush=True)  # after the start's own line
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    try:
        line = next(line for line in kernel.stdout if line.startswith("JOB "))
        job, name = line.split()[1:]
        assert (job, name) in queue()
        kernel.kill()
        kernel.wait(10)
        assert records.clean_stale_clusters() >= 1  # what the next start_cluster does first
        assert job not in {j for j, _ in queue()}
    finally:
        if kernel.poll() is None:
            kernel.kill()
