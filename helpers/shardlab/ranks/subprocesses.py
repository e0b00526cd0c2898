"""Commands run as processes of their own: a process group waited for with a deadline, or a detached session."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from .owned import identity


def run_process_group(cmd: list[str], env: dict[str, str], timeout_s: float, what: str, capture: bool = True,
                      grace_s: float = 15.0) -> subprocess.CompletedProcess:
    """Run ``cmd`` as the leader of a process group of its own and wait for it at most ``timeout_s``.

    On time-out, or when the wait is interrupted (Ctrl-C in a notebook), the whole group gets SIGTERM, then
    SIGKILL after ``grace_s``: a launcher and every rank it started (srun cancels its job step). A time-out
    raises TimeoutError naming ``what``. ``capture``: keep stdout and stderr (else they go to this process's)."""
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as error:
        _stop_group(proc, grace_s)
        if isinstance(error, subprocess.TimeoutExpired):
            raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s, so its launcher and every process "
                               f"it started were stopped. The command was: {' '.join(cmd)}") from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout or "", stderr or "")


def start_detached(cmd: list[str], env: dict[str, str]) -> tuple[int, float]:
    """Start ``cmd`` in a session of its own (Ctrl-C and the end of this process do not reach it), its output
    discarded; (pid, creation time). A thread of this process waits for it: a child that exits while its parent
    lives stays a ``<defunct>`` entry in the process table until the parent reaps it (a parked cluster's keeper
    exits as soon as another kernel claims the cluster, and the kernel that parked it may run for hours)."""
    child = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = identity(child.pid)  # before the wait: until reaped, the pid stays this child's
    threading.Thread(target=child.wait, name=f"reap(pid={child.pid})", daemon=True).start()
    return started


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL if its leader still runs after ``grace_s``. The leader is not
    reaped before the signals, so its group id cannot belong to anyone else yet."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.communicate()
