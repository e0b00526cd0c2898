"""``python -m shardlab.port`` end to end on two models of docs/models.md, the series' U-Net (a field) and Transolver
(points): the tool writes a run that imports no shardlab; the run's own parity test holds under torchrun on 4 CPU
ranks; 4 steps train on 4 ranks (ddp 2 × domain 2), saving a checkpoint every 2 steps, and the run as it stood after
step 2 resumes from that checkpoint on 2 ranks (ddp 1 × domain 2: two samples accumulated a step) with the
uninterrupted run's losses. Transolver's resumed
run reads each rank's rows from a zarr store of the same samples (slab loading against scatter_tensor). And a model
with an op ShardTensor has no handler for is refused in one line that names it, nothing written.

    .venv/bin/python -m pytest tests/multirank/test_port.py -q -p no:randomly
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.ranks.launch import run_job

STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)
TINY = ["--samples", "8", "--global-batch", "2", "--dtype", "float64"]


def port(*argv, cwd, timeout_s=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardlab.port", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, env=os.environ | {"PYTHONUNBUFFERED": "1"})


def on_ranks(folder: Path, n: int, script: str, *args) -> str:
    result = run_job("torchrun", n, folder / script, list(args), timeout_s=300, env={"PYTHONPATH": str(folder)})
    return result.stdout


def losses(out: str) -> dict[int, float]:
    return {int(step): float(value) for step, value in STEP.findall(out)}


def imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.multirank
@pytest.mark.parametrize(("model", "target", "size", "slab"), [
    ("U-Net", ["--field", "4096x4096", "--gpus", "8", "--gpu", "H100"], 32, False),
    ("Transolver", ["--points", "1e6", "--gpus", "8", "--gpu", "H100", "--domain", "2"], 96, True),
])
def test_the_port_writes_a_run_that_holds_parity_and_resumes_on_another_layout(model, target, size, slab, tmp_path,
                                                                                no_leftovers):
    done = port(model, *target, "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for step in ("[1/5] audit", "[2/5] parity", "[3/5] plan", "[4/5] choice", "[5/5] write"):
        assert step in done.stdout
    assert "within 1e-10" in done.stdout and "OVER" not in done.stdout
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["README.md", "model.py", "run.json", "test_parity.py", "train.py",
                                                     "train.sbatch"]
    assert "shardlab" not in imports(run) and {"torch", "physicsnemo"} <= imports(run)
    readme = (run / "README.md").read_text()
    assert all(launcher in readme for launcher in ("torchrun", "mpirun", "srun", "sbatch"))

    checked = on_ranks(run, 4, "test_parity.py")
    held = re.findall(r"^parity at size \d+ .*: holds", checked, re.M)
    assert held and "FAILS" not in checked, checked

    whole = losses(on_ranks(run, 4, "train.py", "--size", str(size), "--domain", "2", "--steps", "4", *TINY,
                            "--save-every", "2", "--checkpoints", str(tmp_path / "a")))
    assert sorted(whole) == [1, 2, 3, 4]
    saved = sorted(p.name for p in (tmp_path / "a").glob("step-*"))
    assert len(saved) == 2 and saved[0].endswith("2") and saved[1].endswith("4"), saved
    (tmp_path / "b").mkdir()  # the run as it stood after step 2: its checkpoint alone
    shutil.copytree(tmp_path / "a" / saved[0], tmp_path / "b" / saved[0])
    store = []
    if slab:
        on_ranks(run, 1, "train.py", "--size", str(size), "--samples", "8", "--write-zarr", str(tmp_path / "store"))
        store = ["--zarr", str(tmp_path / "store")]
    resumed_out = on_ranks(run, 2, "train.py", "--size", str(size), "--domain", "2", "--steps", "4", *TINY, *store,
                           "--checkpoints", str(tmp_path / "b"), "--resume")
    assert "resumed from" in resumed_out and "at step 2, on ddp 1 x domain 2" in resumed_out
    resumed = losses(resumed_out)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # another layout: sums split differently, float64 rounding only
        assert resumed[step] == pytest.approx(whole[step], rel=1e-9), (resumed, whole)
    assert whole[4] != whole[3]  # the steps trained: the losses move


@pytest.mark.multirank
def test_a_model_with_an_unpatched_op_is_refused_in_one_line(tmp_path, no_leftovers):
    done = port("fno_unpadded", "--field", "256x256", "--gpus", "4", "--gpu", "80GiB", "--ranks", "2",
                "--out", str(tmp_path / "run"), cwd=tmp_path)
    assert done.returncode == 1
    [line] = [line for line in done.stderr.splitlines() if line.startswith("port: ")]
    # the op named, and how a handler is registered from user code (function or dispatch handler, by the op's kind)
    assert "the audit stopped the port" in line and "fft" in line and "ShardTensor.register_" in line, line
    assert "[1/5] audit" in done.stdout and "[2/5] parity" not in done.stdout  # stopped at the first step failing
    assert not (tmp_path / "run").exists()
