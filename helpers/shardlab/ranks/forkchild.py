"""What a child of the fork server (``forkserver``) does to become what the launcher would have started: a rank's
engine (or its nanny) with exactly the launcher's environment, working folder, arguments and files.

Imports only the standard library at the top: the server imports it before its fork, the child runs it after.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import random
import signal
import socket
import sys
import threading
from pathlib import Path

from .forkstub import send_request

PR_SET_PDEATHSIG = 1
STARTED_ENVIRONMENT: dict[str, str] | None = None  # in a forked engine: the environment its launcher gave it
SERVER_SOCKET: str | None = None  # in a forked engine: where its server listens (its nanny is forked there too)


def started_environment() -> dict[str, str]:
    """The environment this process was started with: the launcher's for a forked engine (``/proc/self/environ``
    holds its server's), else what ``/proc/self/environ`` holds."""
    if STARTED_ENVIRONMENT is not None:
        return dict(STARTED_ENVIRONMENT)
    import psutil

    return psutil.Process().environ()


def become_engine(conn: socket.socket, request: dict, fds: list[int], server: int) -> None:
    """Turn this fresh child into what ``python ARGV`` started by the launcher would be, and run it; exits."""
    global STARTED_ENVIRONMENT
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the server
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256) for fd in fds]  # out of the way of the numbers below
        for fd in fds:
            os.close(fd)
        for target, fd in zip(request.get("fds", [0, 1, 2]), moved):
            os.dup2(fd, target)  # inheritable, as what the launcher handed its rank is
            os.close(fd)
        retitle(request["argv"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        STARTED_ENVIRONMENT = dict(request["env"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fresh_process_state()
        if request.get("watch", True):  # a nanny watches its engine itself, and reports its end
            threading.Thread(target=die_with_stub, args=(conn,), name="shardlab-stub-watch", daemon=True).start()
        if (engine_app := sys.modules.get("ipyparallel.engine.app")) is not None:
            engine_app.start_nanny = start_nanny  # the engine's nanny: forked too, not a new interpreter
        gc.enable()
        code = run(request["argv"], request["cwd"])
    except SystemExit as end:
        code = end.code
    except BaseException:  # what python prints for an uncaught error, then its exit code
        import traceback

        traceback.print_exc()
    sys.exit(code)  # the interpreter's own exit: atexit handlers, flushed output, as a launched engine's


def retitle(argv: list[str]) -> None:
    """Make this process's command line (``ps``, ``/proc/PID/cmdline``) read ``python ARGV``, cut to the length of the
    server's: a forked engine is then found and named as a launched one is (``ps``, clean-up, the tests)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of proc(5)
    title = " ".join([sys.executable, *argv]).encode()[:end - start - 2] + b"\0"
    # The area's last byte no longer NUL: Linux reads the title up to its NUL, as setproctitle(3)'s.
    ctypes.memmove(start, title.ljust(end - start, b" "), end - start)


def die_with_stub(conn: socket.socket) -> None:
    """Block until the stub's end of the connection closes (the stub was killed, or ended), then end this engine: a
    launcher that kills its rank kills the engine."""
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def start_nanny(**kwargs):
    """``ipyparallel.engine.nanny.start_nanny`` for a forked engine: the nanny (a small process that forwards
    interrupts to its engine and reports its end) forked from the server with the engine's environment, instead of a
    new interpreter importing ipyparallel. As there: its stdin gets the settings, its stdout says where it listens;
    it watches its engine and ends with it (here its connection, which the engine holds, is not watched). Returns
    (url, what must stay open while the engine runs)."""
    import pickle

    kwargs["pid"] = os.getpid()
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SERVER_SOCKET)
        # The engine's pid after the module: the nanny ignores its arguments; ps and cluster.memory() name it by it.
        send_request(conn, {"argv": ["-m", "ipyparallel.engine.nanny", str(os.getpid())], "cwd": os.getcwd(),
                            "watch": False, "env": dict(os.environ) | {"PYTHONUNBUFFERED": "1"}},
                     [stdin_r, stdout_w, 2])
    finally:
        os.close(stdin_r)
        os.close(stdout_w)
    with os.fdopen(stdin_w, "wb") as pipe:
        pickle.dump(kwargs, pipe)
    reader = os.fdopen(stdout_r, "rb")
    url = reader.readline().decode().strip()
    if not url:
        conn.close()
        raise RuntimeError("nanny failed")
    return url, (conn, reader)


def fresh_process_state() -> None:
    """What differs between a forked child and a new process: the RNGs seeded (each engine used to draw its own
    seeds), the standard streams on the launcher's files, settings read from the environment at import (threads, the
    temp folder). Python's hash seed stays the server's: it is fixed when the interpreter starts."""
    import tempfile

    random.seed(os.urandom(32))
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        line = fd == 2 or unbuffered or os.isatty(fd)
        stream = open(fd, "r" if fd == 0 else "w", buffering=1 if line else -1, closefd=False,
                      errors="backslashreplace" if fd == 2 else None)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    tempfile.tempdir = None
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the server's environment when it loaded


def run(argv: list[str], cwd: str) -> int:
    """``python -m MODULE ARGS...`` or ``python SCRIPT ARGS...`` in this process."""
    import runpy

    if argv[:1] == ["-m"] and len(argv) >= 2:
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = cwd
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv and not argv[0].startswith("-"):
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
    else:
        raise SystemExit(f"shardlab fork server: cannot run python {' '.join(argv)}")
    return 0
