"""`make gpu-check` behaves on every machine: without a GPU it says so and exits 0; with one it runs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shardlab.ranks import procs


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the gpu-marked test runs instead")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.gpucheck", "--json", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "No GPU is visible here" in proc.stdout and "make gpu-check" in proc.stdout
    assert json.loads(out.read_text())["rows"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_every_check_passes_or_says_it_needs_more_gpus(tmp_path, no_leftovers):
    out = tmp_path / "gpu-check.json"
    # Rows that do not fit in 780 s are not run; past 900 s gpu-check gets SIGTERM (not SIGKILL), so it stops its ranks.
    proc = procs.run_process_group([sys.executable, "-m", "shardlab.tools.gpucheck", "--json", str(out), "--deadline-s",
                                    "780"], dict(os.environ), 900, "make gpu-check", grace_s=60)
    rows = json.loads(out.read_text())["rows"]
    assert rows and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {r["status"] for r in rows} <= {"passed", "needs 2+ GPUs", "no time left"}
    assert any(r["status"] == "passed" for r in rows)
