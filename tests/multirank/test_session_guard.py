"""The session guard stops only what its run started (processes of another origin are left alone). The process
records behind it: tests/unit/test_procs.py."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.ranks import owned

# -- the test session's guard, through a whole pytest run ------------------------------------------------------

INNER_TEST = """
import subprocess, sys

def test_leaves_a_process_behind():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # inherits this run's origin
"""


@pytest.mark.multirank
def test_the_session_guard_stops_only_what_its_run_started(tmp_path):
    """An mpiexec-named process nobody marked, and a learner's engine marked with its kernel's origin, stay alive
    through a whole pytest run whose guard finds, reports and stops the one process that run left behind."""
    root = Path(__file__).resolve().parents[2]
    fake = tmp_path / "bin" / "mpiexec"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport time; time.sleep(300)\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (owned.ORIGIN, "PYTEST_XDIST_WORKER")}
    unrelated = subprocess.Popen([str(fake), "-n", "4", "ipengine", "--mpi"], env=env)
    learner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "ipengine"],
                               env=env | {owned.ORIGIN: "learner-kernel-1234"})
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(root / "conftest.py", run / "conftest.py")
    shutil.copytree(root / "tests" / "support", run / "tests" / "support")  # what the conftest imports from there
    (run / "pytest.ini").write_text("[pytest]\n")
    (run / "test_inner.py").write_text(INNER_TEST)
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                              "test_inner.py"], cwd=run, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 1 and "this run left processes behind (now stopped)" in out.stdout, out.stdout[-2000:]
        reported = out.stdout.split("this run left processes behind (now stopped):")[1]
        assert "time.sleep(120)" in reported and str(unrelated.pid) not in reported
        assert unrelated.poll() is None and learner.poll() is None
    finally:
        for proc in (unrelated, learner):
            proc.kill()
            proc.wait()
