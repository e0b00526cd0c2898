"""The smoke CLI on real ranks, CPU: mpirun on 4 ranks, and torchrun refusing a bad domain size. MPICH's
mpiexec: tests/test_mpich.py; Slurm's srun: tests/test_slurm.py."""

import json
import subprocess
import sys

import pytest

from shardlab.smoke import CHECKS, run_smoke


def test_single_process_reports_versions_and_device():
    out = subprocess.run([sys.executable, "-m", "shardlab.smoke"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["check"]["ok"] and report["versions"]["nvidia-physicsnemo"]
    assert report["backend"] == ("nccl" if len(report["gpus"]) >= 2 else "gloo")  # one GPU: the cluster is CPU ranks
    assert report["one_rank_runs_on"] == ("cuda" if report["gpus"] else "cpu")


@pytest.mark.multirank
@pytest.mark.parametrize(
    "launcher, n, expected_mesh, expected_method",
    [
        # notebooks/01_launchers.ipynb runs torchrun and mpirun on 2 ranks (a 1x2 mesh); this is the 2x2 mesh. The same
        # checks on 4 ranks of srun and of MPICH: test_slurm.py, test_mpich.py (torchrun at 4 ranks: test_plan.py).
        ("openmpi", 4, {"ddp": 2, "domain": 2}, "openmpi"),
    ],
)
def test_distributed_checks_pass_on_every_rank(launcher, n, expected_mesh, expected_method, no_leftovers):
    report = run_smoke(launcher, n)
    assert report["returncode"] == 0 and report["ok"], json.dumps(report, indent=1)[-3000:]
    assert report["mesh"] == expected_mesh
    assert [r["rank"] for r in report["ranks"]] == list(range(n))
    for row in report["ranks"]:
        assert row["world_size"] == n and row["method"] == expected_method and row["backend"] == "gloo"
        assert all(row[name]["ok"] for name in CHECKS)
    # Ranks of one domain group hold different halves; the global shape is the same everywhere.
    assert {tuple(r["scatter"]["global_shape"]) for r in report["ranks"]} == {(1, 3, 10, 6)}
    assert {tuple(r["scatter"]["local_shape"]) for r in report["ranks"]} == {(1, 3, 5, 6)}


@pytest.mark.multirank
def test_bad_domain_size_exits_with_a_message_not_a_traceback(no_leftovers):
    with pytest.raises(RuntimeError, match="does not divide the world size 2"):
        run_smoke("torchrun", 2, checks=(), domain=3)


def test_checks_without_distributed_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "shardlab.smoke", "--check-grad"], capture_output=True, text=True)
    assert out.returncode == 2 and "needs --distributed" in out.stderr
