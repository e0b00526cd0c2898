"""Workshop operations: memory per engine and per learner measured, and the container recipe's `make lab` path. The
kernel spec per user: tests/unit/test_kernel_user.py; a hung %%px cell interrupted from the kernel:
tests/multirank/test_faults.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multirank
def test_memory_per_engine_and_per_learner_is_measured(no_leftovers):
    """scripts/learner_memory.py (the figures on INSTRUCTORS.md's operations page): a kernel with a 4-rank
    cluster, every process measured after DistributedManager and ShardTensor's operators are ready."""
    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, str(ROOT / "scripts/learner_memory.py"), "--ranks", "4", "--json",
                          str(artifacts / "learner-memory.json")], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    result = json.loads((artifacts / "learner-memory.json").read_text())
    roles = [row["process"] for row in result["processes"]]
    assert roles.count("notebook kernel") == 1 and "controller" in roles
    assert [f"rank {r} engine" in roles for r in range(4)] == [True] * 4
    # Measured once the ranks were ready: every engine holds PyTorch and PhysicsNeMo, which the controller lacks.
    pss = {row["process"]: row["pss_mib"] for row in result["processes"]}
    assert all(pss[f"rank {r} engine"] > pss["controller"] for r in range(4)), pss
    assert result["per_learner_pss_mib"] < result["per_learner_rss_mib"]
    assert "per learner: PSS" in out.stdout
