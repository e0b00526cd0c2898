"""What has been measured on GPUs, in one line: ``sl.gpu_status()``, read from the `make gpu-check` run committed.

`make gpu-check` writes its rows, the GPUs and the date to ``test-artifacts/gpu-check.json`` (ignored by git: every run
writes it). A run worth keeping is committed as ``data/gpu-check.json`` (``RECORD``): copy that file there, or run
``python -m shardlab.tools.gpucheck --json data/gpu-check.json`` on the GPU node. Without a committed run on GPUs the
line says so; it never says more than the record holds.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

RECORD = Path(__file__).resolve().parents[3] / "data" / "gpu-check.json"  # in a checkout of the repository
RAN = ("passed", "FAILED")  # gpucheck's statuses of a row that ran; the others say why a row did not


def gpu_status(record: Path = RECORD) -> str:
    """One line: the committed `make gpu-check` run (date, GPUs, checks passed and failed), or that none is."""
    where = f"{record.parent.name}/{record.name}"
    run = json.loads(record.read_text()) if record.is_file() else {}
    ran = [row for row in run.get("rows", []) if row["status"] in RAN]
    if not run.get("gpus") or not ran:  # a run without a GPU (or stopped before any row) measured nothing on one
        return f"GPU path: no `make gpu-check` run on GPUs is recorded ({where})"
    gpus = ", ".join(f"{count} × {name}" for name, count in Counter(run["gpus"]).items())
    failed = [row.get("name") or row["check"] for row in ran if row["status"] == "FAILED"]
    line = (f"GPU path: `make gpu-check` on {run['date']}" + (f" (commit {run['commit']})" if run.get("commit") else "")
            + f", {gpus}: {len(ran) - len(failed)} of {len(ran)} checks passed")
    if failed:
        line += f"; failed: {'; '.join(failed)}"
    if skipped := len(run["rows"]) - len(ran):
        line += f"; {skipped} not run (more GPUs or more time needed)"
    return f"{line} ({where})"
