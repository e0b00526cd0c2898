"""The performance report runs end to end and its rows are measured where they say (timings are reported, never
asserted against a number: these machines are noisy; rows computed from other rows are not re-checked)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.bench


def test_bench_compares_like_with_like_and_accounts_for_its_phases(tmp_path, no_leftovers):
    out = tmp_path / "bench.json"
    # 2 ranks: the rows and how they hang together are what is tested; the README's table is a 4-rank run.
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.bench", "--ranks", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "CPU cores" in report["machine"] and "measurement" in proc.stdout
    rows = {r["measurement"]: r["value"] for r in report["rows"]}
    script = rows["mpiexec -n 2 script: launch + DistributedManager + ShardTensor ops"]
    # Each total is broken down into the phases the series names, measured where they happen.
    script_phases = [v for k, v in rows.items() if k.startswith("  of which, slowest rank:")]
    cluster_phases = [k for k in rows if k.startswith("  of which:")]
    rank_phases = [v for k, v in rows.items() if k.startswith("    in DistributedManager ready")]
    assert len(script_phases) == len(rank_phases) == 3
    assert cluster_phases == ["  of which: engines registered", "  of which: DistributedManager ready"]
    # The ranks' own clocks run inside the job's wall time: a rank's phase cannot outlast the job it ran in.
    assert max(script_phases) <= script
    assert max(rank_phases) <= rows["  of which: DistributedManager ready"]
    end_to_end = rows["torchrun script end to end (start, init, warm-up, 5 steps)"]
    assert rows["5 DDP steps as a torchrun script"] <= end_to_end
    assert all(value > 0 for value in rows.values())
