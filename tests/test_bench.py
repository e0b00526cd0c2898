"""The performance report runs end to end and its deterministic rows are right (timings are only
reported, never asserted)."""

import json
import subprocess
import sys


def test_bench_reports_every_row(tmp_path, no_leftovers):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "shardlab.bench", "--json", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["measurement"]: r["value"] for r in report["rows"]}
    assert "CPU cores" in report["machine"] and "measurement" in proc.stdout
    timed = [k for k in rows if k.startswith(("bare mpiexec", "cluster start,", "5 DDP steps"))]
    assert len(timed) == 4 and all(rows[k] > 0 for k in timed)
    ratios = {k: v for k, v in rows.items() if "(ideal" in k}
    assert len(ratios) == 6
    for name, value in ratios.items():
        ideal = float(name.split("(ideal ")[1].rstrip(")"))
        assert abs(value - ideal) <= 0.10 * ideal, (name, value)
    assert rows["max |sharded - single device| (conv stack output, input grad; fp32)"] <= 1e-5
