"""Slurm across nodes, simulated on one machine (no Slurm needed): the GPUs a job's options give on several nodes
(``devices.slurm_gpus``); rank 0's result when it runs on another node than ``run_job`` (a fake ``srun`` on PATH
that runs its task where the launching node's temp folder is not); and where the ranks of a step started from a
login node meet (``workarounds.slurm_rendezvous_on_first_node``, PhysicsNeMo #819), rank by rank, with and without
``scontrol``."""

import os
import socket
import sys
import tempfile
import textwrap

import pytest
import torch.distributed.distributed_c10d as c10d
from physicsnemo.distributed import DistributedManager

from shardlab import workarounds
from shardlab.ranks import cluster as cl
from shardlab.ranks import devices, launch
from shardlab.ranks.devices import DeviceError
from shardlab.ranks.launch import JobFailed, run_job

# -- the GPUs of a job on several nodes ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, args, env, expected", [
    (8, ["--ntasks-per-node=4", "--gpus-per-node=4"], {}, 8),  # the nodes are the tasks over --ntasks-per-node
    (8, ["--ntasks-per-node", "4", "--gres=gpu:a100:4"], {}, 8),
    (8, ["-N", "2", "--gpus-per-node=4"], {}, 8),  # -N 2 as two arguments
    (8, ["-N2", "--gpus-per-node=4"], {}, 8),
    (8, ["-N 2", "--gpus-per-node=4"], {}, 8),
    (8, ["--nodes", "2", "--gpus-per-node=4"], {}, 8),  # --nodes 2 as two arguments
    (8, ["--nodes 2", "--gres=gpu:4"], {}, 8),
    (8, ["--gpus-per-node", "4", "--nodes=2"], {}, 8),  # the GPU option as two arguments too
    (8, ["-N", "2", "--gres=gpu"], {}, 2),  # --gres=gpu: one per node
    (8, ["--nodes=3", "--ntasks-per-node=4", "--gpus-per-node=4"], {}, 12),  # a node count wins: --ntasks rules
    (8, ["--nodes=1-4", "--ntasks-per-node=4", "--gpus-per-node=4"], {}, 8),  # a range, decided by the tasks
    (16, ["--nodes=2-3", "--ntasks-per-node=4", "--gpus-per-node=4"], {}, 12),  # at most the range's top
    (8, ["--nodes=2-2", "--gpus-per-node=4"], {}, 8),
    (8, ["--nodes=2", "--nodes=1", "--gpus-per-node=4"], {}, 4),  # the last one wins, as in Slurm
    (8, ["-N", "2"], {"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "4"}, 8),  # a step on 2 of 4 nodes
    (8, ["--ntasks-per-node=4"], {"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "4"}, 8),
    (4, ["--gres=nvme:1"], {"SLURM_GPUS_ON_NODE": "2"}, 2),  # a --gres without GPUs asks for none
    (8, ["-G", "8", "-N", "2"], {}, 8),
    (8, ["--exclusive", "-N", "2", "--gpus-per-task=1"], {}, 8),
])
def test_slurm_gpus_count_every_node_however_the_nodes_are_spelled(n, args, env, expected):
    assert devices.slurm_gpus(n, args, env) == expected


@pytest.mark.parametrize("args, match", [
    (["--nodes=2-4", "--gpus-per-node=4"], r"--nodes=2-4: Slurm picks between 2 and 4 nodes.*Give one node count "
                                           r"\(e\.g\. --nodes=2\), or --ntasks-per-node"),
    (["-N", "2-4", "--gres=gpu:4"], r"--nodes=2-4: .*--ntasks-per-node"),
    (["--nodes=two", "--gpus-per-node=4"], r"--nodes=two: give the job's node count \(--nodes=2, -N 2\)"),
])
def test_a_node_count_that_does_not_say_how_many_gpus_is_refused_with_the_fix(args, match):
    with pytest.raises(DeviceError, match=match):
        devices.slurm_gpus(8, args, {})


def test_slurm_engines_on_two_nodes_of_four_gpus_are_8_cuda_ranks(monkeypatch):
    """What notebook 01 shows for GPU nodes: --ntasks-per-node=4 --gpus-per-node=4, eight engines."""
    for var in ("SHARDLAB_RANKS", "SHARDLAB_ENGINES", "SLURM_JOB_ID", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
                "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cl, "visible_gpus", lambda: 0)  # a kernel on a login node sees none
    cluster = cl.MPICluster(n=8, engines="slurm", controller_ip="*",
                            slurm_args=["--ntasks-per-node=4", "--gpus-per-node=4"])
    assert (cluster.device, cluster.placement.gpus) == ("cuda", 8)


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


def test_a_job_folder_goes_to_the_shared_folder_only_for_slurm(tmp_path, monkeypatch):
    from shardlab.ranks.programs import job_folder

    monkeypatch.setenv("SHARDLAB_SHARED_DIR", str(tmp_path / "shared"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with job_folder("slurm") as slurm, job_folder("openmpi") as local:
        assert os.path.dirname(slurm) == str(tmp_path / "shared") and os.path.dirname(local) == str(tmp_path)


# -- where the ranks of a step meet ---------------------------------------------------------------------------------

LOGIN_NODE = "10.0.0.250"  # SLURM_LAUNCH_NODE_IPADDR of a srun started on a login node


def rank_environment(rank: int, nodes: int = 2, per_node: int = 2, **extra: str) -> dict[str, str]:
    """What Slurm gives task ``rank`` of a step of ``nodes`` nodes × ``per_node`` tasks launched from a login node."""
    node = rank // per_node
    nodelist = f"node[01-{nodes:02d}]" if nodes > 1 else "node01"
    env = {"SLURM_PROCID": str(rank), "SLURM_NPROCS": str(nodes * per_node), "SLURM_NTASKS": str(nodes * per_node),
           "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(node), "SLURMD_NODENAME": f"node{node + 1:02d}",
           "SLURM_LAUNCH_NODE_IPADDR": LOGIN_NODE, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "4242",
           "SLURM_STEP_ID": "0", "MASTER_PORT": "29500"}
    return {k: v for k, v in (env | extra).items() if v is not None}


class Recorded(Exception):
    """Raised by the recording ``DistributedManager.setup``: where the process group would be created."""


@pytest.fixture
def meeting_point(monkeypatch, tmp_path):
    """``meeting_point(env, scontrol=False)``: run ``launch.init_distributed`` as a rank with exactly ``env`` (and a
    PATH with a fake ``scontrol`` or none) up to where PhysicsNeMo creates the process group; the address it passes
    (rank 0's, every rank's rendezvous)."""
    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        raise Recorded

    monkeypatch.setattr(DistributedManager, "setup", staticmethod(record))
    monkeypatch.setitem(DistributedManager._shared_state, "_is_initialized", False)
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    monkeypatch.setattr(c10d, "default_pg_timeout", c10d.default_pg_timeout)  # init_distributed sets them
    monkeypatch.setattr(c10d, "default_pg_nccl_timeout", c10d.default_pg_nccl_timeout)
    launch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items()
            if k not in launch_vars and not k.startswith(("SLURM", "OMPI_", "PMI_", "PHYSICSNEMO_"))}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "no-scontrol").mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        with open({str(tmp_path / "scontrol.log")!r}, "a") as log:
            log.write(" ".join(sys.argv[1:]) + "\\n")
        # a real scontrol's answer for the lists these tests use
        print("\\n".join(["node01", "node02"] if sys.argv[1:3] == ["show", "hostnames"] else []))
    """))
    scontrol.chmod(0o755)

    def meeting_point(env: dict[str, str], scontrol: bool = False) -> str:
        saved = dict(os.environ)
        path = str(bin_dir if scontrol else tmp_path / "no-scontrol")
        try:
            os.environ.clear()
            os.environ.update(base | {"PATH": path} | env)
            with pytest.raises(Recorded):
                launch.init_distributed(5)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        assert calls[-1]["method"] == "slurm"
        return calls[-1]["addr"]

    meeting_point.scontrol_log = tmp_path / "scontrol.log"
    return meeting_point


@pytest.mark.parametrize("scontrol", [True, False], ids=["scontrol", "no-scontrol"])
@pytest.mark.parametrize("master_addr", [None, "127.0.0.1"], ids=["unset", "run_job-loopback"])
def test_every_rank_of_a_two_node_step_from_a_login_node_meets_on_node_1(meeting_point, scontrol, master_addr):
    """Rank 2 runs on node 2 (and rank 0 on node 1): each is told the login node's address by Slurm."""
    addresses = [meeting_point(rank_environment(rank, MASTER_ADDR=master_addr), scontrol) for rank in range(4)]
    assert addresses == ["node01"] * 4
    if scontrol:
        assert meeting_point.scontrol_log.read_text().splitlines() == ["show hostnames node[01-02]"] * 4


def test_an_explicit_master_addr_is_what_every_rank_meets_at(meeting_point):
    assert [meeting_point(rank_environment(rank, MASTER_ADDR="10.1.2.3")) for rank in range(4)] == ["10.1.2.3"] * 4


def test_a_step_on_one_node_meets_on_loopback(meeting_point):
    assert [meeting_point(rank_environment(rank, nodes=1, per_node=4)) for rank in range(4)] == ["127.0.0.1"] * 4


def test_a_batch_script_without_srun_meets_on_the_first_node_of_the_job(meeting_point):
    """#819 itself: sbatch sets no SLURM_LAUNCH_NODE_IPADDR (nor a step's node list) for the batch script."""
    env = rank_environment(0, SLURM_LAUNCH_NODE_IPADDR=None, SLURM_STEP_NODELIST=None, SLURM_STEP_NUM_NODES=None,
                           SLURM_STEP_ID=None)
    assert meeting_point(env) == "node01"


def test_a_step_whose_first_node_cannot_be_read_is_refused_with_what_to_set(meeting_point):
    env = rank_environment(2, SLURM_STEP_NODELIST="node[01-02", SLURM_JOB_NODELIST=None)
    with pytest.raises(RuntimeError, match=r"runs on 2 nodes, and which one rank 0 listens on cannot be read from "
                                           r"SLURM_STEP_NODELIST/SLURM_JOB_NODELIST \('node\[01-02'\)\. Set "
                                           r"MASTER_ADDR to the step's first node before srun"):
        meeting_point(env)


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


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("gpu[1-2],cpu05,io[3]", ["gpu1", "gpu2", "cpu05", "io3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n1.cluster.org,n2.cluster.org", ["n1.cluster.org", "n2.cluster.org"]),
])
def test_node_lists_expand_without_scontrol(nodelist, hosts):
    assert workarounds.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[01-02", "node[02-01]", "node[a-b]", "a,,b", "node]1["])
def test_node_lists_the_parser_cannot_read_are_refused(nodelist):
    with pytest.raises(ValueError):
        workarounds.expand_nodelist(nodelist)


def test_819_physicsnemo_still_meets_at_the_launch_node(meeting_point, monkeypatch):
    """Upstream still takes SLURM_LAUNCH_NODE_IPADDR and ignores MASTER_ADDR. When this fails, upstream changed its
    SLURM method: check whether slurm_rendezvous_on_first_node (shardlab/workarounds.py) is still needed."""
    monkeypatch.setattr(workarounds, "slurm_rendezvous_on_first_node", _nothing, raising=False)
    assert meeting_point(rank_environment(2, MASTER_ADDR="node01")) == LOGIN_NODE, (
        "upstream fixed physicsnemo #819's address: delete slurm_rendezvous_on_first_node from shardlab/workarounds.py")


def _nothing():
    import contextlib

    return contextlib.nullcontext()
