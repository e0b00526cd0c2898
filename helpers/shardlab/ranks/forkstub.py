"""What the launcher starts for each rank when a fork server runs (``forkserver``): a stub, standard library only, that
asks the server for an engine and stands in for it.

Run by path, not as a module (``python -I forkstub.py SOCKET -m MODULE ARGS...``): importing the ``shardlab`` package
would cost what the fork saves. It sends the server its whole environment (the launcher's variables: OMPI_*, PMIX_*,
PMI_*, SLURM_*), its working folder, the engine's arguments and its stdin, stdout and stderr (SCM_RIGHTS; and MPICH's
PMI_FD), so the engine writes where the launcher reads. Then it is the engine, as the launcher sees it:

- a signal the stub gets (SIGTERM, SIGINT, SIGHUP, ...) goes on to the engine (a pidfd: never to a recycled pid);
- it exits as the engine did: the same exit code, or killed by the same signal;
- a stub that is killed (SIGKILL) closes its end of the connection: the engine's watcher sees it and kills the engine.

On Slurm nodes (``SOCKET`` is ``@node``) no process of the kernel's node can start the server: the first stub of the
job step on each node starts that node's, and the others ask it (``connect_on_this_node``).

Where there is no server to ask (none listening, or it refused or died before forking), it says so in one line on
stderr and replaces itself with ``python ARGS...``: today's start (the fallback).
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM)
CONNECT_S = 10.0  # a server that listens accepts at once; its imports may take longer, the handshake waits for them
EACH_NODE = "@node"  # instead of SOCKET: this node's server for this Slurm job step (``node_server_name``)


def fall_back(why):
    """Become today's engine: ``python ARGS...`` in this process, with this environment."""
    print(f"shardlab: {why}: starting this rank's engine without the fork server.", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])


def address(where):
    """The socket address of ``where``: a path, or "@NAME", a name in Linux's abstract namespace (no file to leave
    behind; the name is gone with the process that bound it)."""
    return "\0" + where[1:] if where.startswith("@") else where


def node_server_name(environ=os.environ):
    """The abstract name of this node's server for this task's Slurm job step: one per user and step on each node
    (None outside a step)."""
    job, step = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", "")
    return f"@shardlab-fork-{os.getuid()}-{job}.{step}" if job and step else None


def peer_uid(conn):
    """The user id of the process at the other end of ``conn`` (SO_PEERCRED: pid, uid, gid)."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def connect_on_this_node(name):
    """A connection to this node's server at the abstract ``name``, started here when none listens yet: every stub of
    the step on this node may start one at the same moment; the first to bind the name serves, the others exit at
    once. An abstract name has no file permissions, so the server must be this user's (any user can bind a name)."""
    deadline, started = time.monotonic() + CONNECT_S, False
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(address(name))
            break
        except ConnectionRefusedError:  # nobody bound the name (yet)
            conn.close()
        if time.monotonic() > deadline:
            fall_back(f"no fork server came up on this node at {name}")
        if not started:  # its output discarded: what it has to say, it says to the stubs (a refusal)
            subprocess.Popen([sys.executable, "-m", "shardlab.ranks.forkserver", name], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started = True
        time.sleep(0.02)
    if peer_uid(conn) != os.getuid():
        fall_back(f"a process of another user listens at {name}")
    return conn


def connect(where):
    """A connection to the server at ``where`` (a path, or ``EACH_NODE``); falls back to today's start without one."""
    if where == EACH_NODE:
        if (name := node_server_name()) is None:
            fall_back("not a task of a Slurm job step, which the fork server on each node serves")
        conn = connect_on_this_node(name)
    else:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(CONNECT_S)
        try:
            conn.connect(where)
        except OSError as error:
            fall_back(f"no fork server at {where} ({error.strerror or error})")
    conn.settimeout(None)
    return conn


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
        print("usage: python forkstub.py SOCKET|@node -m MODULE ARGS... (started by the launcher, not by hand)",
              file=sys.stderr)
        return 2
    conn = connect(sys.argv[1])
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
