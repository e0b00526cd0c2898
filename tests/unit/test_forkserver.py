"""The fork server's cheap parts (shardlab.ranks.forkserver, forkstub): when it is not used, and the stub's fallback to
today's start when no server answers. A server that imports and forks: tests/multirank/test_forkserver_on_ranks.py.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shardlab.ranks import forkserver


def test_the_fallback_is_chosen_where_a_fork_cannot_be_used(monkeypatch):
    short = tempfile.gettempdir()
    monkeypatch.delenv(forkserver.FORK_ENGINES, raising=False)
    assert forkserver.why_not(short) is None
    assert "too long" in forkserver.why_not("/" + "x" * 120)
    assert forkserver.why_not("/" + "x" * 120, on_other_nodes=True) is None  # Slurm's ranks ask their node's server
    monkeypatch.setenv(forkserver.FORK_ENGINES, "0")
    assert forkserver.why_not(short) == f"{forkserver.FORK_ENGINES}=0"


def test_a_stub_without_a_server_runs_the_program_itself_and_says_so(tmp_path):
    """No server at the socket: the rank runs as today (same program, arguments, environment and exit code), and its
    stderr has the one line that says so."""
    stub = forkserver.stub_command(tmp_path)
    code = "import os, sys; print(sys.argv[1:], os.environ['MARK']); sys.exit(3)"
    done = subprocess.run([*stub, "-c", code, "a", "b"], capture_output=True, text=True, timeout=60,
                          env=os.environ | {"MARK": "launcher's"})
    assert done.returncode == 3
    assert done.stdout.strip() == "['a', 'b'] launcher's"
    assert done.stderr.count("\n") == 1 and "without the fork server" in done.stderr, done.stderr


def test_a_stub_for_a_nodes_server_outside_a_slurm_step_runs_the_program_itself(tmp_path, monkeypatch):
    """``@node`` (Slurm's ranks) names a server by the task's job step: without one, today's start, said in a line."""
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    done = subprocess.run([*forkserver.stub_command(tmp_path, on_other_nodes=True), "-c", "print('ran')"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert "not a task of a Slurm job step" in done.stderr, done.stderr


def test_the_stub_needs_only_the_standard_library():
    """The launcher starts it once per rank in an isolated interpreter (-I): it must not import shardlab (or torch)."""
    stub = Path(forkserver.stub_command(tempfile.gettempdir())[2])
    code = (f"import runpy, sys; sys.argv = ['stub']; runpy.run_path({str(stub)!r}, run_name='not main'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('shardlab', 'torch', 'psutil', 'zmq')))")
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_a_thread_in_the_parent_is_an_unsafe_fork(tmp_path):
    """The check the server runs after its imports: in a process with a second thread it names the threads."""
    code = ("import threading, time; from shardlab.ranks import forkserver; print(forkserver.invariants()); "
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); print(forkserver.invariants())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == ["[]", "['2 threads']"], (done.stdout, done.stderr)
