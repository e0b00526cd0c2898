"""The smoke CLI on real ranks, CPU: mpirun on 4 ranks (CPU ranks on purpose on any machine,
tests/support/world_sizes.py; CUDA ranks: make gpu-check), and torchrun refusing a bad domain size. MPICH's mpiexec:
tests/system/test_mpich.py; Slurm's srun: tests/system/test_slurm.py; in one process: tests/unit/test_smoke_cli.py."""

import json

import pytest

from shardlab.ranks.launch import run_job
from shardlab.tools.smoke import CHECKS, run_smoke
from world_sizes import SMOKE


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
    placed = SMOKE.ranks(n).or_skip()  # CPU ranks, also where GPUs could hold them or would refuse 4 ranks
    # run_smoke's own job, with the device asked for (run_smoke has no device option: it places its ranks itself).
    job = run_job(launcher, n, "shardlab.tools.smoke",
                  ["--distributed", "--domain=2", *(f"--check-{c}" for c in CHECKS)],
                  timeout_s=180.0, check=False, device=placed.device)
    report = job.result  # check=False: a job that wrote none raised JobFailed, with its stderr
    assert job.returncode == 0 and report["ok"], json.dumps(report, indent=1)[-3000:]
    assert job.placement.device == "cpu" and {r["device"] for r in report["ranks"]} == {"cpu"}
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
