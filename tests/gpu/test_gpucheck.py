"""`make gpu-check` behaves on every machine: without a GPU it says so and exits 0; with one it runs. What it
recorded is the GPU status line the notebooks print (``sl.gpu_status()``)."""

import json
import os
import sys

import pytest
import torch

import shardlab as sl
from shardlab.ranks import subprocesses
from shardlab.tools import gpucheck
from shardlab.tools.gpu_record import RECORD, gpu_status


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the gpu-marked test runs instead")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys):
    # This machine as it is, nothing simulated; test_gpu_driver.py starts the real python -m shardlab.tools.gpucheck.
    out = tmp_path / "gpu-check.json"
    assert gpucheck.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "No GPU is visible here" in printed and "make gpu-check" in printed
    assert json.loads(out.read_text())["rows"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_every_check_passes_or_says_it_needs_more_gpus(tmp_path, no_leftovers):
    out = tmp_path / "gpu-check.json"
    # Rows that do not fit in 780 s are not run; past 900 s gpu-check gets SIGTERM (not SIGKILL), so it stops its ranks.
    proc = subprocesses.run_process_group([sys.executable, "-m", "shardlab.tools.gpucheck", "--json", str(out),
                                           "--deadline-s", "780"], dict(os.environ), 900, "make gpu-check", grace_s=60)
    rows = json.loads(out.read_text())["rows"]
    assert rows and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {r["status"] for r in rows} <= {"passed", "needs 2+ GPUs", "no time left"}
    assert any(r["status"] == "passed" for r in rows)



def test_gpu_status_says_plainly_when_no_gpu_run_is_recorded(tmp_path, monkeypatch):
    record = tmp_path / "gpu-check.json"
    where = f"{tmp_path.name}/gpu-check.json"
    assert gpu_status(record) == f"GPU path: no `make gpu-check` run on GPUs is recorded ({where})"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: pytest.fail("no GPU to name"))
    gpucheck.write_json(record, 0, [])  # what gpu-check writes on a machine without a GPU
    assert "no `make gpu-check` run on GPUs is recorded" in gpu_status(record)


def test_gpu_status_reports_the_recorded_run_its_date_gpus_and_checks(tmp_path, monkeypatch):
    record = tmp_path / "gpu-check.json"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    statuses = {"smoke": "passed", "notebooks": "passed", "planner": "FAILED", "tf32-error": "no time left"}
    rows = [{"name": r["name"], "check": r["check"], "on": r["on"], "status": statuses.get(r["name"], "passed"),
             "result": "", "seconds": 1.0} for r in gpucheck.plan(2)]
    gpucheck.write_json(record, 2, rows)
    written = json.loads(record.read_text())
    status = gpu_status(record)
    assert status.startswith(f"GPU path: `make gpu-check` on {written['date']}")
    assert "2 × NVIDIA H100 80GB HBM3" in status and f"{len(rows) - 2} of {len(rows) - 1} checks passed" in status
    assert "failed: planner" in status and "1 not run" in status
    assert (f"(commit {written['commit']})" in status) == bool(written["commit"])



def test_the_status_line_the_notebooks_print_is_the_committed_record():
    assert RECORD.parent.name == "data" and RECORD.parent.is_dir()
    assert sl.gpu_status() == gpu_status(RECORD)
