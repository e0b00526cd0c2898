"""Slurm across nodes, simulated on one machine with ranks: rank 0's result when it runs on another node than
``run_job`` (a fake ``srun`` on PATH that runs its task where the launching node's temp folder is not), and two
ranks given a login node's address meet on the first node of their step. Without ranks:
tests/unit/test_slurm_nodes.py."""

import os
import socket
import tempfile

import pytest

from shardlab.ranks.launch import JobFailed, run_job

# -- rank 0's result from another node ---------------------------------------------------------------------------

RANK_SCRIPT = """
import os, sys
from shardlab.ranks.launch import write_job_result
if os.environ["SLURM_PROCID"] == "0":
    write_job_result({"args": sys.argv[1:], "tmp": os.environ["TMPDIR"]})
"""

# srun whose one task runs on "another node": the same paths, but that node's temp folder is its own, so the one
# this process made its job folder in is not there while the task runs.
OTHER_NODE_SRUN = """\
#!/bin/sh
while [ "${{1#--}}" != "$1" ]; do shift; done  # srun's own options
{hide}
TMPDIR="{temp}" SLURM_PROCID=0 SLURM_NPROCS=1 SLURM_LOCALID=0 "$@"
rc=$?
{show}
exit $rc
"""


@pytest.fixture
def srun_on(tmp_path, monkeypatch):
    """``srun_on(other_node)``: a fake srun on PATH; this process's temp folder is tmp_path/launching-node-tmp. On
    another node, that folder is the node's own, empty one while the task runs."""
    temp = tmp_path / "launching-node-tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["SHARDLAB_SHARED_DIR"]:
        monkeypatch.delenv(name, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)

    def srun_on(other_node: bool):
        hidden = f"{temp}.launching-node"
        srun = bin_dir / "srun"
        srun.write_text(OTHER_NODE_SRUN.format(
            temp=temp, hide=f'mv "{temp}" "{hidden}" && mkdir "{temp}"' if other_node else "",
            show=f'rm -rf "{temp}" && mv "{hidden}" "{temp}"' if other_node else ""))
        srun.chmod(0o755)
        return script, temp

    return srun_on


@pytest.mark.multirank
def test_rank_0_on_another_node_hands_its_result_back_through_the_shared_folder(srun_on, tmp_path, monkeypatch,
                                                                                no_leftovers):
    script, temp = srun_on(other_node=True)
    shared = tmp_path / "shared"  # not there yet: run_job makes it, as a cluster's start does
    monkeypatch.setenv("SHARDLAB_SHARED_DIR", str(shared))
    job = run_job("slurm", 1, script, ["a", "b"], timeout_s=120)
    assert job.result == {"args": ["a", "b"], "tmp": str(temp)}
    assert list(shared.iterdir()) == [] and list(temp.iterdir()) == []  # the job's folder is gone, wherever it was


@pytest.mark.multirank
def test_rank_0_on_another_node_without_a_shared_folder_says_what_to_set(srun_on, no_leftovers):
    script, _ = srun_on(other_node=True)
    with pytest.raises(JobFailed, match=r"no result written\)\. If rank 0 ran on another node than this one.*"
                                        r"Set SHARDLAB_SHARED_DIR to a folder every node of the job sees") as failed:
        run_job("slurm", 1, script, timeout_s=120)
    # what rank 0 itself said, in the job's stderr
    assert "which does not see" in str(failed.value) and "cannot reach it. Set SHARDLAB_SHARED_DIR" in str(failed.value)


@pytest.mark.multirank
def test_rank_0_on_the_launching_node_needs_no_shared_folder(srun_on, no_leftovers):
    """A single-node Slurm (scripts/local-slurm.sh), or srun inside an allocation on its first node: as before."""
    script, temp = srun_on(other_node=False)
    assert run_job("slurm", 1, script, ["x"], timeout_s=120).result == {"args": ["x"], "tmp": str(temp)}
    assert list(temp.iterdir()) == []


TWO_NODE_RANK = """
import torch, torch.distributed as dist
from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result
state = init_distributed(60)
total = torch.tensor([float(state.rank)])
dist.all_reduce(total)
import os
if state.rank == 0:
    write_job_result({"world": state.world_size, "method": state.method, "total": total.item(),
                      "met_at": os.environ["MASTER_ADDR"]})
shutdown_distributed()
"""

# srun of a two-node step started from a login node whose address (TEST-NET, nothing listens there) Slurm hands to
# every task; both "nodes" are this machine, the first named by its host name.
TWO_NODE_SRUN = """\
#!/bin/sh
while [ "${{1#--}}" != "$1" ]; do shift; done
for rank in 0 1; do
    SLURM_PROCID=$rank SLURM_NPROCS=2 SLURM_LOCALID=0 SLURM_NODEID=$rank SLURM_STEP_NUM_NODES=2 \\
    SLURM_STEP_NODELIST="{first},{first}-second" SLURM_LAUNCH_NODE_IPADDR=192.0.2.1 "$@" &
    eval "task$rank=$!"
done
wait $task0; rc0=$?
wait $task1; rc1=$?
exit $((rc0 | rc1))
"""


@pytest.mark.multirank
def test_two_ranks_given_a_login_node_address_meet_on_the_first_node_of_their_step(tmp_path, monkeypatch,
                                                                                   no_leftovers):
    """The whole path: run_job("slurm") -> srun -> two ranks -> init_distributed -> a gloo group, all_reduce."""
    first = socket.gethostname()
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["MASTER_ADDR", "SHARDLAB_SHARED_DIR"]:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(TWO_NODE_SRUN.format(first=first))
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "ranks.py"
    script.write_text(TWO_NODE_RANK)
    job = run_job("slurm", 2, script, timeout_s=240)
    assert job.result == {"world": 2, "method": "slurm", "total": 1.0, "met_at": first}
