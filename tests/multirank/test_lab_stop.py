"""Ctrl-C in `make lab`'s terminal stops JupyterLab, then the ranks parked for the next notebook, and the terminal's
last line says what stopped (``python -m shardlab.ranks.warm run``, what `make lab` runs around JupyterLab). The real
`make lab` with a kernel and ranks: tests/system/test_home_lab.py."""

import os
import signal
import subprocess
import sys

import pytest

# A stand-in for `jupyter lab`: it leaves in its pool what notebooks leave there (a parked 4-rank cluster; with
# "in-use", also the record of a cluster a kernel never stopped), says so, and exits at Ctrl-C as JupyterLab does.
FAKE_JUPYTER = """#!{python}
import os, sys, time
from pathlib import Path
from shardlab.ranks import records, warm
pool = Path(os.environ[warm.POOL])
records.Record("shardlab-parked", 0, 0.0, profile_dir="", folder=str(pool)).save()
shape = warm.shape_of(4, "cpu", "mpi", "openmpi", "127.0.0.1", None)
warm.Parked(str(pool / ("shardlab-parked" + warm.PARKED)), "shardlab-parked", shape, [0, 0.0], time.time() + 60,
            []).save()
if "in-use" in sys.argv:
    records.Record("shardlab-in-use", 0, 0.0, profile_dir="", folder=str(pool)).save()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    sys.exit(0)
"""


def _ctrl_c(tmp_path, *args: str) -> tuple[str, str, int]:
    """`warm run -- jupyter lab` in a session of its own, Ctrl-C sent to all of it as a terminal does: (what the fake
    JupyterLab printed, what warm run printed, its exit status)."""
    jupyter = tmp_path / "bin" / "jupyter"
    jupyter.parent.mkdir()
    jupyter.write_text(FAKE_JUPYTER.format(python=sys.executable))
    jupyter.chmod(0o755)
    run = subprocess.Popen([sys.executable, "-m", "shardlab.ranks.warm", "run", "--idle-s", "60", "--", str(jupyter),
                            "lab", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, env=os.environ | {"TMPDIR": str(tmp_path)})
    try:
        assert run.stdout.readline().strip() == "ready", run.stderr.read()
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(10)
    return out, err, run.returncode


@pytest.mark.multirank
def test_ctrl_c_says_that_jupyterlab_and_its_warm_ranks_stopped(tmp_path):
    out, err, code = _ctrl_c(tmp_path)
    assert code == 0, err
    assert err.strip().splitlines()[-1] == "shardlab: JupyterLab stopped; stopped 4 warm ranks.", err
    assert not any(p.name.startswith(tuple("0123456789")) or "warm-" in p.name for p in tmp_path.iterdir()), \
        sorted(p.name for p in tmp_path.iterdir())  # the pool's folder is gone


@pytest.mark.multirank
def test_a_cluster_a_kernel_never_stopped_is_stopped_and_counted_too(tmp_path):
    _, err, _ = _ctrl_c(tmp_path, "in-use")
    assert err.strip().splitlines()[-1] == "shardlab: JupyterLab stopped; stopped 4 warm ranks and 1 running " \
                                           "cluster(s).", err
