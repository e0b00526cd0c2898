"""Slurm across nodes, simulated on one machine (no Slurm, no ranks): the GPUs a job's options give on several nodes
(``devices.slurm_gpus``); where the ranks of a step started from a login node meet
(``workarounds.slurm_rendezvous_on_first_node``, PhysicsNeMo #819), with and without ``scontrol``; node lists.
Ranks started through a fake ``srun``: tests/system/test_slurm_nodes_on_ranks.py."""

import os
import sys
import tempfile
import textwrap

import pytest
import torch.distributed.distributed_c10d as c10d
from physicsnemo.distributed import DistributedManager

from shardlab import workarounds
from shardlab.ranks import cluster as cl
from shardlab.ranks import devices, launch, slurm
from shardlab.ranks.devices import DeviceError

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
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)  # a kernel on a login node sees none
    cluster = cl.RankCluster(n=8, engines="slurm", controller_ip="*",
                            slurm_args=["--ntasks-per-node=4", "--gpus-per-node=4"])
    assert (cluster.device, cluster.placement.gpus) == ("cuda", 8)


def test_a_job_folder_goes_to_the_shared_folder_only_for_slurm(tmp_path, monkeypatch):
    from shardlab.ranks.commands import job_folder

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


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("gpu[1-2],cpu05,io[3]", ["gpu1", "gpu2", "cpu05", "io3"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("n1.cluster.org,n2.cluster.org", ["n1.cluster.org", "n2.cluster.org"]),
])
def test_node_lists_expand_without_scontrol(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[01-02", "node[02-01]", "node[a-b]", "a,,b", "node]1["])
def test_node_lists_the_parser_cannot_read_are_refused(nodelist):
    with pytest.raises(ValueError):
        slurm.expand_nodelist(nodelist)


def test_819_physicsnemo_still_meets_at_the_launch_node(meeting_point, monkeypatch):
    """Upstream still takes SLURM_LAUNCH_NODE_IPADDR and ignores MASTER_ADDR. When this fails, upstream changed its
    SLURM method: check whether slurm_rendezvous_on_first_node (shardlab/workarounds.py) is still needed."""
    monkeypatch.setattr(workarounds, "slurm_rendezvous_on_first_node", _nothing, raising=False)
    assert meeting_point(rank_environment(2, MASTER_ADDR="node01")) == LOGIN_NODE, (
        "upstream fixed physicsnemo #819's address: delete slurm_rendezvous_on_first_node from shardlab/workarounds.py")


def _nothing():
    import contextlib

    return contextlib.nullcontext()
