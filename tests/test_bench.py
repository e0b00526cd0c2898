"""The performance report runs end to end and its rows hang together (timings are reported, never asserted
against a number: these machines are noisy)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench


def test_bench_compares_like_with_like_and_accounts_for_its_phases(tmp_path, no_leftovers):
    out = tmp_path / "bench.json"
    # 2 ranks: the rows and how they hang together are what is tested; the README's table is a 4-rank run.
    proc = subprocess.run([sys.executable, "-m", "shardlab.bench", "--ranks", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "CPU cores" in report["machine"] and "measurement" in proc.stdout
    rows = {r["measurement"]: r["value"] for r in report["rows"]}
    script = rows["mpiexec -n 2 script: launch + DistributedManager + ShardTensor ops"]
    start = rows["cluster start, 2 ranks, same work + controller + engines"]
    assert rows["cluster start / mpiexec script (same per-rank work)"] == pytest.approx(start / script)
    # The phases are parts of their totals: no phase is missing, none counted twice.
    script_phases = [v for k, v in rows.items() if k.startswith("  of which, slowest rank:")]
    cluster_phases = [v for k, v in rows.items() if k.startswith("  of which:")]
    rank_phases = [v for k, v in rows.items() if k.startswith("    in DistributedManager ready")]
    assert len(script_phases) == len(rank_phases) == 3 and len(cluster_phases) == 2
    assert sum(cluster_phases) == pytest.approx(start)
    assert max(script_phases) <= script and max(rank_phases) <= cluster_phases[1]  # the slowest rank's steps
    steps_px = rows["5 DDP steps in %%px cells (cluster already up)"]
    steps_script = rows["5 DDP steps as a torchrun script"]
    assert rows["%%px / torchrun, same 5 steps"] == pytest.approx(steps_px / steps_script)
    assert all(value > 0 for value in rows.values())
