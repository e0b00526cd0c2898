"""The smoke CLI in one process: it reports versions and device, and its distributed checks without ranks are a
usage error. On real ranks: tests/multirank/test_smoke.py."""

import json
import subprocess
import sys

import pytest

from shardlab.tools.gpu_record import gpu_status
from shardlab.tools.smoke import main as smoke_main


def test_single_process_reports_versions_and_device():
    out = subprocess.run([sys.executable, "-m", "shardlab.tools.smoke"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["check"]["ok"] and report["versions"]["nvidia-physicsnemo"]
    assert report["backend"] == ("nccl" if len(report["gpus"]) >= 2 else "gloo")  # one GPU: the cluster is CPU ranks
    assert report["one_rank_runs_on"] == ("cuda" if report["gpus"] else "cpu")
    assert report["gpu_path"] == gpu_status()  # the committed `make gpu-check` run, or that there is none


def test_checks_without_distributed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        smoke_main(["--check-grad"])
    assert stop.value.code == 2 and "needs --distributed" in capsys.readouterr().err
