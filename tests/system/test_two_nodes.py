"""Two Slurm nodes for real: node1 and node2 of `scripts/local-slurm.sh start --nodes 2`, each a slurmd in network, UTS
and mount namespaces of its own (its own address, host name and /tmp), this machine their login node. What only
differs across nodes runs here: where rank 0 listens, a job's result from a node that did not start it, engines that
reach the kernel's controller, notebooks on engines of both nodes, and a node that dies mid-cell.

Each node declares 2 CPUs, so a job of 4 tasks takes both: ranks 0-1 on node1, 2-3 on node2, as on a cluster of
two-GPU nodes. ``conftest.py`` gives every Slurm test the nodes' shared folder (SHARDLAB_SHARED_DIR); the tests
that need it gone unset it. They skip, saying how to start the nodes, without the two-node Slurm:

    sudo scripts/local-slurm.sh start --nodes 2 && .venv/bin/python -m pytest tests/system/test_two_nodes.py
"""

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import machine_changes
import shardlab as sl
from notebook_runner import run_notebook
from shardlab.ranks import forkserver, owned
from shardlab.ranks.launch import JobFailed, run_job
from shardlab.ranks.px import ClusterError, rank_errors, summarize_rank_errors

pytestmark = [pytest.mark.multirank, pytest.mark.slurm, pytest.mark.two_nodes]
ROOT = Path(__file__).resolve().parents[2]
LOCAL_SLURM = ROOT / "scripts" / "local-slurm.sh"
SMOKE = ["shardlab.tools.smoke", "--distributed", "--domain=2"]
LOGIN_NODE = "10.213.0.1"  # the bridge's host end: where srun runs from, and slurmctld listens


def on_each_node(command: str) -> dict[str, str]:
    """What ``command`` prints on each node (a step of one task per node), by node name."""
    out = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
                          f"echo $(hostname) $({command})"], capture_output=True, text=True, timeout=60, check=True)
    said = (line.partition(": ")[2].partition(" ") for line in out.stdout.splitlines())
    return {node: text.strip() for node, _, text in said}


def left_on_the_nodes() -> dict[str, list[str]]:
    """What each node's /tmp holds, but for torch.compile's cache (kept on purpose, as on this machine) and a checkout
    in this machine's /tmp (scripts/local-slurm.sh shows it to the nodes, as a shared file system would)."""
    listed = on_each_node("ls -A /tmp | grep -v '^torchinductor_' | tr '\\n' ' '")
    checkout = ROOT.relative_to("/tmp").parts[0] if ROOT.is_relative_to("/tmp") else None
    left = {node: [f for f in files.split() if f != checkout] for node, files in listed.items()}
    return {node: files for node, files in left.items() if files}


def processes_on(node: str) -> list[str]:
    """The command line of every process in ``node``'s network namespace."""
    pids = subprocess.run(["ip", "netns", "pids", f"shardlab-{node}"], capture_output=True, text=True).stdout.split()
    commands = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile
            commands.append(" ".join(psutil.Process(int(pid)).cmdline()))
    return commands


def queued_by_this_test() -> list[str]:
    """Ids of the queued engine jobs that this test started (their comment is its origin): not the other worker's."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True, timeout=30, check=True)
    return [job for job, _, comment in (line.partition(" ") for line in out.stdout.splitlines())
            if comment.startswith(os.environ[owned.ORIGIN])]


def rows(report: dict) -> list[tuple]:
    return [(r["rank"], r["hostname"], r["node_id"], r["local_rank"], r["master_addr"]) for r in report["ranks"]]


ACROSS = [(0, "node1", 0, 0, "node1"), (1, "node1", 0, 1, "node1"), (2, "node2", 1, 0, "node1"),
          (3, "node2", 1, 1, "node1")]


def test_srun_from_the_login_node_meets_at_rank_0s_node(no_leftovers):
    """srun -N 2 -n 4 from the login node: each rank says its node and local rank, and all met rank 0 on node1,
    not at the login node's address that Slurm hands them as SLURM_LAUNCH_NODE_IPADDR (PhysicsNeMo #819:
    workarounds.slurm_rendezvous_on_first_node)."""
    out = subprocess.run(["srun", "--nodes=2", "--ntasks=4", "--kill-on-bad-exit=1", sys.executable, "-m", *SMOKE,
                          "--check-scatter", "--check-sync", "--check-grad"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and rows(report) == ACROSS
    assert all(r["method"] == "slurm" and r["launcher"] == "slurm" for r in report["ranks"])
    launched_from = on_each_node("echo $SLURM_LAUNCH_NODE_IPADDR")
    assert set(launched_from.values()) == {LOGIN_NODE}, launched_from  # where upstream would have looked


def test_run_job_hands_back_rank_0s_result_from_a_node_that_did_not_start_it(monkeypatch, no_leftovers):
    monkeypatch.delenv(forkserver.FORK_ENGINES, raising=False)  # what the series does, whatever the run's setting
    job = run_job("slurm", 4, SMOKE[0], SMOKE[1:], timeout_s=180)
    assert rows(job.result) == ACROSS
    assert "fork server" not in job.stderr, job.stderr  # every rank forked from its node's server: none fell back
    assert not list(Path(os.environ["SHARDLAB_SHARED_DIR"]).glob("shardlab-job-*")), "the job's folder is left"

    # Without a shared folder, rank 0 on node1 cannot reach the login node's temp folder: it says so before the
    # rendezvous. Were it to wait for the collectives' time-out (120 s here), run_job would time out instead.
    monkeypatch.delenv("SHARDLAB_SHARED_DIR")
    with pytest.raises(JobFailed) as failed:
        run_job("slurm", 4, SMOKE[0], [*SMOKE[1:], "--timeout=120"], timeout_s=90)
    assert "rank 0 runs on node1, which does not see" in str(failed.value)
    assert "Set SHARDLAB_SHARED_DIR to a folder every node of the job sees" in str(failed.value)
    assert not left_on_the_nodes()


def test_px_engines_on_both_nodes_reach_the_controller_and_leave_nothing(tmp_path, monkeypatch, no_leftovers):
    """An sbatch job of engines across both nodes: the controller listens where they reach it, %%px collectives
    cross the nodes, and stop() leaves no job, no process and no file on either node, nor in the shared folder.
    The kernel's temp folder is one no node has, as a notebook's is under the test runner."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.delenv(forkserver.FORK_ENGINES, raising=False)
    with pytest.raises(ValueError, match="runs engines on other nodes: pass controller_ip='\\*'"):
        sl.RankCluster(n=4, device="cpu", engines="slurm", controller_ip="127.0.0.1")
    with sl.RankCluster(n=4, device="cpu", engines="slurm", controller_ip="*") as cluster:
        assert [(s["rank"], s["hostname"], s["node_id"]) for s in cluster.table()] == [
            (0, "node1", 0), (1, "node1", 0), (2, "node2", 1), (3, "node2", 1)]
        cluster.view.execute("import torch, torch.distributed as dist\nt = torch.tensor([dist.get_rank() + 1.0])\n"
                             "dist.all_reduce(t)", block=True)
        assert cluster.view.pull("t.item()", block=True) == [10.0] * 4
        # Forked from one server on each node, which the node's first stub started (shardlab.ranks.forkserver)
        cluster.view.execute("import os, psutil, socket\nparent = (socket.gethostname(), os.getppid(), "
                             "psutil.Process(os.getppid()).cmdline()[2])", block=True)
        parents = cluster.view.pull("parent", block=True)
        assert {cmd for _, _, cmd in parents} == {"shardlab.ranks.forkserver"}, parents
        assert len({(node, pid) for node, pid, _ in parents}) == 2 == len({node for node, _, _ in parents}), parents
        assert Path(cluster.profile_dir).parent == Path(os.environ["SHARDLAB_SHARED_DIR"])
    assert not sl.ranks.slurm.slurm_jobs_named(cluster.job_name)
    assert not Path(cluster.profile_dir).exists()
    assert not left_on_the_nodes(), "engines left files in a node's /tmp"


def test_without_a_shared_folder_the_engines_job_fails_at_once_and_says_what_to_set(monkeypatch, no_leftovers):
    """The profile goes to the login node's temp folder, which the nodes do not see: the job fails on them at once,
    and the start says so (not "timed out" after its whole wait, with nothing said)."""
    monkeypatch.delenv("SHARDLAB_SHARED_DIR")
    cluster = sl.RankCluster(n=4, device="cpu", engines="slurm", controller_ip="*", timeout_s=120)
    with pytest.raises(ClusterError) as failed:
        cluster.start()
    said = str(failed.value)
    assert "the engine launcher has exited" in said and "the job ran on node[1-2]" in said, said
    assert "Set SHARDLAB_SHARED_DIR to a folder every node of the job sees" in said
    assert not cluster.alive_processes() and not sl.ranks.slurm.slurm_jobs_named(cluster.job_name)


@pytest.mark.notebook
@pytest.mark.parametrize("name", ["02_device_mesh", "07_capstone"])
def test_notebooks_run_unchanged_on_engines_of_both_nodes(name, no_leftovers):
    """The series as a Slurm cluster's instructor runs it: the environment picks Slurm engines, 4 ranks, two per
    node; the notebook's own cells check its meshes, and the capstone its losses against one process."""
    env = os.environ | {"SHARDLAB_ENGINES": "slurm", "SHARDLAB_CONTROLLER_IP": "*", "SHARDLAB_RANKS": "4",
                        "CAPSTONE_STEPS": "20"}
    run_notebook(ROOT / "notebooks" / f"{name}.ipynb", timeout_s=500, rehearse=False, env=env)
    assert not queued_by_this_test()
    assert not left_on_the_nodes()


@pytest.mark.whole_slurm
def test_a_node_that_dies_mid_cell_is_named_and_the_rest_stop_cleanly(no_leftovers):
    """node2 goes down (its link, and every process on it, at once) while the ranks are in collectives: the cell's
    summary names node2 and its ranks, the others time out waiting for them (30 s, before Slurm gives up on the
    node), stop() ends the job and node1's engines, and once node2 is back nothing of the job is left on either
    node. Bringing node2 back starts its slurmd again: only with the opt-in that lets a run start daemons."""
    if not machine_changes.setup_allowed():
        pytest.skip(f"takes node2 down and starts its slurmd again: {machine_changes.SYSTEM_SETUP}=1 (what "
                    "`sudo make test-system` sets) allows it")
    cluster = sl.RankCluster(n=4, device="cpu", engines="slurm", controller_ip="*").start()
    try:
        hosts = {s["rank"]: s["hostname"] for s in cluster.table()}
        running = cluster.view.execute("import time, torch, torch.distributed as dist\nfor _ in range(600):\n"
                                       "    dist.all_reduce(torch.ones(1)); time.sleep(0.05)", block=False)
        time.sleep(2)
        down = subprocess.run(["bash", str(LOCAL_SLURM), "down", "node2"], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        with pytest.raises(Exception) as failed:
            running.get(timeout=120)
        summary = summarize_rank_errors(rank_errors(failed.value), sorted(hosts), hosts)
        assert ("rank(s) [2, 3] on node2 died: their engines stopped answering (every rank on node2: the node went "
                "down, or all its processes were killed).") in summary, summary
        # each of 0 and 1 either times out or sees its connection to node2 close first, whichever gloo meets first
        assert any(line.startswith("rank(s) [0, 1] timed out") and line.endswith(
            "in a collective waiting for rank(s) [2, 3], which died.") for line in summary), summary
    finally:
        cluster.stop()
        back = subprocess.run(["bash", str(LOCAL_SLURM), "start", "--nodes", "2"], capture_output=True, text=True,
                              timeout=120)
    assert back.returncode == 0, back.stderr
    assert not cluster.alive_processes()
    deadline = time.monotonic() + 60  # cancelled, the job completes once node2's slurmd answers again
    while sl.ranks.slurm.slurm_jobs_named(cluster.job_name) and time.monotonic() < deadline:
        time.sleep(1)
    assert not sl.ranks.slurm.slurm_jobs_named(cluster.job_name), "the engines' job is still in the queue"
    assert not left_on_the_nodes()
    deadline = time.monotonic() + 15  # likeliest: the step that listed /tmp, whose slurmstepd outlives srun a moment
    while len(on_node1 := processes_on("node1")) > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [command.split(" ")[0] for command in on_node1] == ["slurmd"], f"node1 runs more than its slurmd: {on_node1}"
