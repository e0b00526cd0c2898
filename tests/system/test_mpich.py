"""A real MPICH (Debian's mpich: hydra's mpiexec.mpich, where the machine has it or `make test-system` installs it;
see conftest.py): the smoke CLI on 4 ranks through the PMI_* mapping, and cluster engines started by it. Notebook 01
runs `sl.tools.smoke.run_smoke("mpich", n=2)` where MPICH is installed, as CI's machine has it."""

import json
import subprocess
import sys

import pytest

import shardlab as sl
from shardlab.ranks import launch

pytestmark = [pytest.mark.multirank, pytest.mark.mpich]


def test_smoke_cli_passes_on_4_mpich_ranks_typed_as_a_user_would(no_leftovers):
    """No MASTER_ADDR, no MASTER_PORT: exactly what MPICH's mpiexec sets (PMI_*), nothing simulated. (Only
    MPIEXEC_PORT_RANGE is added: on a machine where other tests start and stop clusters all the time, it keeps
    hydra's own port away from clients still reconnecting to stopped ones.)"""
    env = {k: v for k, v in launch.clean_environment().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env |= {k: v for k, v in launch.mpi_environment().items() if k == "MPIEXEC_PORT_RANGE"}
    cmd = [launch.find_mpiexec("mpich"), "-n", "4", sys.executable, "-m", "shardlab.tools.smoke", "--distributed",
           "--check-scatter", "--check-sync", "--check-grad"]
    out = subprocess.run(cmd, env=env | {"CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["mesh"] == {"ddp": 2, "domain": 2}
    for row in report["ranks"]:
        assert (row["launcher"], row["method"], row["world_size"]) == ("mpich", "env", 4)
        assert all(row[name]["ok"] for name in sl.tools.smoke.CHECKS)
    assert [(r["rank"], r["local_rank"]) for r in report["ranks"]] == [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_cluster_engines_started_by_mpich(monkeypatch, no_leftovers):
    monkeypatch.delenv("SHARDLAB_MPI", raising=False)
    with sl.RankCluster(n=2, device="cpu", mpi="mpich") as cluster:
        assert cluster.engine_launcher.command()[0] == launch.find_mpiexec("mpich")
        assert [s["rank"] for s in cluster.states] == [0, 1]
        assert {(s["launcher"], s["method"]) for s in cluster.states} == {("mpich", cluster.expected_method)}
        cluster.view.execute("import torch, torch.distributed as dist; t = torch.tensor([dist.get_rank() + 1.0]); "
                             "dist.all_reduce(t)")
        assert cluster.view.pull("t.item()") == [3.0, 3.0]
    assert not cluster.alive_processes()

