"""What the launcher starts for each rank when a fork server runs (``forkserver``): a stub, standard library only, that
asks the server for an engine and stands in for it.

Run by path, not as a module (``python -I forkstub.py SOCKET -m MODULE ARGS...``): importing the ``shardlab`` package
would cost what the fork saves. It sends the server its whole environment (the launcher's variables: OMPI_*, PMIX_*,
PMI_*, SLURM_*), its working folder, the engine's arguments and its stdin, stdout and stderr (SCM_RIGHTS; and MPICH's
PMI_FD), so the engine writes where the launcher reads. Then it is the engine, as the launcher sees it:

- a signal the stub gets (SIGTERM, SIGINT, SIGHUP, ...) goes on to the engine (a pidfd: never to a recycled pid);
- it exits as the engine did: the same exit code, or killed by the same signal;
- a stub that is killed (SIGKILL) closes its end of the connection: the engine's watcher sees it and kills the engine.

Where there is no server to ask (none listening, or it refused or died before forking), it says so in one line on
stderr and replaces itself with ``python ARGS...``: today's start (the fallback).
"""

import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)
CONNECT_S = 10.0  # a server that listens accepts at once; its imports may take longer, the handshake waits for them


def fall_back(why):
    """Become today's engine: ``python ARGS...`` in this process, with this environment."""
    print(f"shardlab: {why}: starting this rank's engine without the fork server.", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def send_request(conn, request, files):
    """Hand the server one request (``argv``, ``cwd``, ``env``, ...) and the files ``files`` (SCM_RIGHTS): its length
    as 4 bytes, then its JSON, as ``forkserver.answer`` reads it."""
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], files)


def read_line(conn):
    """One line from the server, without its newline ("" at EOF: the server and the engine are both gone)."""
    out = b""
    while not out.endswith(b"\n"):
        try:
            chunk = conn.recv(1)
        except InterruptedError:
            continue
        except OSError:
            return ""
        if not chunk:
            return ""
        out += chunk
    return out.decode().strip()


def main():
    if len(sys.argv) < 3:
        print("usage: python forkstub.py SOCKET -m MODULE ARGS... (started by the launcher, not by hand)",
              file=sys.stderr)
        return 2
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_S)
    try:
        conn.connect(sys.argv[1])
    except OSError as error:
        fall_back(f"no fork server at {sys.argv[1]} ({error.strerror or error})")
    conn.settimeout(None)
    # Besides stdin, stdout and stderr, a connection the launcher handed its rank by number: MPICH's PMI_FD.
    pmi = os.environ.get("PMI_FD", "")
    files = [0, 1, 2, *([int(pmi)] if pmi.isdigit() and int(pmi) > 2 and is_open(int(pmi)) else [])]
    try:
        send_request(conn, {"argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ), "fds": files}, files)
    except OSError as error:
        fall_back(f"the fork server did not take the request ({error})")
    answer = read_line(conn)
    if not answer.startswith("pid "):
        fall_back(f"the fork server {'refused: ' + answer if answer else 'ended before forking'}")
    pid = int(answer.split()[1])
    try:
        handle = os.pidfd_open(pid)
        send = lambda sig: signal.pidfd_send_signal(handle, sig)  # noqa: E731
    except (AttributeError, OSError):  # a kernel before 5.3: the pid, which the server does not reap before it says
        send = lambda sig: os.kill(pid, sig)  # noqa: E731

    def forward(sig, _frame):
        try:
            send(sig)
        except OSError:  # the engine has just ended: its status is on the way
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = read_line(conn)  # "exit N" or "signal N", once the server reaped the engine
    kind, _, number = status.partition(" ")
    if kind == "signal" and number.isdigit():
        sig = int(number)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)  # killed as the engine was: the launcher reads the same
        return 128 + sig
    if kind == "exit" and number.isdigit():
        return int(number)
    print("shardlab: the fork server ended before it could say how this rank's engine ended.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
