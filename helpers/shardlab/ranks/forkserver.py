"""Engines that start from an already-imported parent: one fork server per cluster (or job) on this node.

Every rank used to import PyTorch, PhysicsNeMo and ipyparallel's engine on its own: seconds of CPU each, and hundreds
of MiB of memory each rank built again. The server (``python -m shardlab.ranks.forkserver SOCKET``) imports them once,
listens on a Unix socket in the cluster's owner-only profile folder, and forks one engine per request. The launcher
stays real: mpiexec (or torchrun) still starts every rank, as ``forkstub``, a small standard-library program that
hands the server its environment, working folder, arguments and stdin/stdout/stderr, and stands in for the engine
(signals, exit code). The forked engine takes exactly that environment and those files, so launcher detection
(lesson 01), ``DistributedManager`` and Slurm's variables see what a directly launched rank sees.

Fork safety. A fork copies one thread and every lock as it was: a parent with a second thread (an OpenMP or OpenBLAS
pool, a zmq context's I/O threads, CUDA's) hands its children locks that no thread will ever release, and a CUDA
context does not survive a fork at all. So the server never initialises CUDA, OpenMP's pool or a zmq context, and
checks it after its imports (``invariants``): if anything started a thread, it refuses every request and the ranks
start the usual way. A child that needs CUDA initialises it itself, after the fork. OpenBLAS (numpy's) starts its pool
when loaded: the server loads it with one thread (``OPENBLAS_NUM_THREADS=1``), so numpy's BLAS in a forked engine
runs on one thread.

Lifetime. A cluster's server is one of its processes (recorded, marked with its id): ``stop()`` and the warden stop
it with the rest; a job's (``for_job``) ends with the job, or with the process that runs ``run_job``. Its engines die
with it (``PR_SET_PDEATHSIG``, set in the forked child of a single-threaded parent), and it exits once its socket's
folder is gone. An engine dies with its stub: the engine's watcher thread sees the stub's end of the connection
close. What the child does after the fork is ``forkchild``'s; the fallback, today's start, is chosen by ``why_not``
for a whole cluster or job, and by each stub that finds no server to ask.

Slurm engines run on other nodes, where the kernel cannot start a process: there the first stub of the job step on
each node starts that node's server (``python -m shardlab.ranks.forkserver @NAME``, a name in the abstract namespace,
``forkstub.connect_on_this_node``). Nothing owns it, and Slurm may stop tracking it once that stub ends, so it ends by
itself: once every process it forked has ended (or when no stub asks within IDLE_S). It ignores SIGTERM, which Slurm
sends every process of a step it stops: the stubs hand it on to their engines, and the server ends after them.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from . import forkchild
from .forkstub import EACH_NODE, address, peer_uid

FORK_ENGINES = "SHARDLAB_FORK_ENGINES"  # "0": engines start the usual way (the opt-out)
# What an engine imports to start and to initialise its rank (measured: what a started engine had in sys.modules),
# then ShardTensor's handlers as a CPU rank registers them (``workarounds.register_shard_ops_on_cpu``; again is
# harmless).
PRELOAD = ("torch", "physicsnemo.distributed", "physicsnemo.domain_parallel", "physicsnemo.utils",
           "physicsnemo.domain_parallel.custom_ops", "torch.distributed.checkpoint", "ipyparallel.engine.app",
           "ipyparallel.engine.nanny", "ipyparallel.engine.kernel", "ipykernel.debugger", "IPython.core.completerlib",
           "IPython.core.oinspect", "IPython.extensions.storemagic", "tornado.queues", "tornado.platform.asyncio",
           "sqlite3", "bdb", "shardlab.ranks.launch", "shardlab.ranks.warm", "shardlab.ranks.beacon")
# While importing: OpenBLAS (numpy's) starts its pool when loaded, a thread before the fork; torch.cuda.is_available()
# (PhysicsNeMo's import asks) initialises the CUDA driver unless NVML answers, and a child of a parent with an
# initialised driver cannot use CUDA.
IMPORT_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
SOCKET_NAME = "fork.sock"
MAX_SOCKET_PATH = 100  # AF_UNIX paths stop at 107 bytes
MAX_REQUEST = 1 << 20
MAX_FILES = 4  # stdin, stdout, stderr and MPICH's PMI_FD
POLL_S = 0.2
IDLE_S = 60.0  # a node's server that no stub asked in this long ends


def socket_path(folder: str | os.PathLike) -> Path:
    return Path(folder, SOCKET_NAME)


def why_not(folder: str | os.PathLike, on_other_nodes: bool = False) -> str | None:
    """Why engines in ``folder``'s cluster cannot start from a fork server (None: they can): the fallback's reasons.
    ``on_other_nodes``: Slurm's, served by a server on each node, which needs no socket in ``folder``."""
    if os.environ.get(FORK_ENGINES, "1") == "0":
        return f"{FORK_ENGINES}=0"
    if not hasattr(socket, "send_fds") or not sys.platform.startswith("linux"):
        return "this system cannot pass files between processes as the fork server needs"
    if not on_other_nodes and len(str(socket_path(folder))) > MAX_SOCKET_PATH:
        return f"the path of its socket in {folder} is too long for a Unix socket"
    return None


def stub_command(folder: str | os.PathLike, on_other_nodes: bool = False) -> list[str]:
    """The program a launcher runs for each rank, before ``-m MODULE ARGS...``: asking the server in ``folder``, or,
    ``on_other_nodes`` (Slurm's), the one on the rank's node."""
    where = EACH_NODE if on_other_nodes else str(socket_path(folder))
    return [sys.executable, "-I", str(Path(__file__).with_name("forkstub.py")), where]


def start(folder: str | os.PathLike, environment: dict[str, str], owner: tuple[int, float] | None = None
          ) -> tuple[int, float]:
    """Start a fork server listening in ``folder`` with ``environment`` (the engines' own, marked as the cluster's
    processes are); (pid, start time). It listens at once and serves once its imports are done: a stub that asks
    meanwhile waits. ``owner`` (pid, start time): it exits when that process is gone (a cluster's warden does that
    for a cluster's server)."""
    from . import owned, subprocesses

    path = socket_path(folder)
    path.unlink(missing_ok=True)
    started = subprocesses.start_detached([sys.executable, "-m", "shardlab.ranks.forkserver", str(path),
                                    *map(str, owner or ())], environment)
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline and owned.alive([started]):
        time.sleep(0.01)  # it binds before anything else: milliseconds
    return started


@contextlib.contextmanager
def for_job(launcher: str, folder: str | os.PathLike, environment: dict[str, str]):
    """Around a job of ranks that ``launch.run_job`` starts with ``launcher`` (its log folder ``folder``, its
    ``environment``): a fork server while the job runs, owned by this process (Slurm's: one on each node, started
    there); yields what goes before the program on the launcher's command line (the stub), or [] where the job
    starts the usual way (the opt-out), said in one line."""
    from . import owned

    if (why := why_not(folder, on_other_nodes=launcher == "slurm")) is not None:
        print(f"shardlab: the job's ranks start without a fork server, each importing PyTorch itself: {why}.",
              file=sys.stderr)
        yield []
        return
    if launcher == "slurm":  # each node's server is started there, by the job's first stub on it
        yield stub_command(folder, on_other_nodes=True)[1:]
        return
    server = start(folder, environment, owner=owned.identity())
    try:  # torchrun runs its program as ``python -u PROGRAM``: the stub then runs without -I, still standard only
        yield stub_command(folder)[2:] if launcher == "torchrun" else stub_command(folder)[1:]
    finally:
        owned.stop(owned.alive([server]), 3.0)


def invariants() -> list[str]:
    """What would make a fork unsafe in this process now ([] when nothing): a thread besides this one, CUDA
    initialised, a zmq context."""
    problems = []
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        problems.append(f"{threads} threads")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("CUDA initialised")
    elif "libcuda.so" in Path("/proc/self/maps").read_text():
        problems.append("the CUDA driver loaded")
    zmq = sys.modules.get("zmq")
    if zmq is not None and getattr(zmq.Context, "_instance", None) is not None:
        problems.append("a zmq context")
    return problems


def preload() -> list[str]:
    """Import PRELOAD with IMPORT_ENVIRONMENT, then give the variables back; what is unsafe afterwards."""
    saved = {name: os.environ.get(name) for name in IMPORT_ENVIRONMENT}
    os.environ.update(IMPORT_ENVIRONMENT)
    try:
        for name in PRELOAD:
            __import__(name)
        from shardlab import workarounds

        workarounds.register_shard_ops_on_cpu()
    except Exception as error:  # a server that cannot import serves nobody: the ranks start the usual way
        return [f"importing {name} failed ({type(error).__name__}: {error})"]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return invariants()


def serve(where: str, owner: tuple[int, float] | None = None) -> None:
    """Listen at ``where``, import, then fork an engine per request until the socket's folder is gone (or ``owner``,
    (pid, start time), is). ``where`` "@NAME": a node's server (Slurm's), which serves until every engine it forked
    has ended; where another process bound NAME first, it returns at once."""
    on_node = where.startswith("@")
    for sig in (signal.SIGINT, signal.SIGHUP, *([signal.SIGTERM] if on_node else [])):
        signal.signal(sig, signal.SIG_IGN)  # its own session: a Ctrl-C or hang-up meant for the kernel is not for it
    gc.disable()  # collections between the imports and the fork would only dirty pages the children share
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(address(where))  # a path: owner-only, in an owner-only folder
    except OSError as error:
        if on_node and error.errno == errno.EADDRINUSE:  # another stub's server was first
            return
        raise
    finally:
        os.umask(old)
    listener.listen(256)
    from . import owned

    me, path = os.getpid(), None if on_node else Path(where)
    forkchild.SERVER_SOCKET = address(where)
    refused = preload()
    gc.freeze()  # what the imports built stays out of the children's collections: their pages stay shared
    engines: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    served, idle_until = False, time.monotonic() + IDLE_S

    def serving() -> bool:
        if on_node:
            return bool(engines) if served else time.monotonic() < idle_until
        return path.parent.is_dir() and (owner is None or owned.same_process(*owner) is not None)

    try:
        while serving():
            for _ in selector.select(POLL_S):
                conn, _ = listener.accept()
                if peer_uid(conn) != os.getuid():  # an abstract name has no permissions: only its user's stubs
                    conn.close()
                    continue
                pid, served = answer(conn, refused, [listener, *engines.values()], selector), True
                if pid is None:
                    conn.close()
                else:
                    engines[pid] = conn
            reap(engines)
    finally:
        if os.getpid() == me and path is not None:
            path.unlink(missing_ok=True)


def reap(engines: dict[int, socket.socket]) -> None:
    """Tell the stub of each engine that ended how it ended."""
    while engines:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = engines.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        said = f"signal {-code}" if code < 0 else f"exit {code}"
        try:
            conn.sendall(f"{said}\n".encode())
        except OSError:  # its stub is gone
            pass
        conn.close()


def answer(conn: socket.socket, refused: list[str], inherited: list[socket.socket], selector) -> int | None:
    """Read one stub's request on ``conn`` and fork its engine; the engine's pid (None: refused)."""
    conn.settimeout(10)
    try:
        head, fds, _, _ = socket.recv_fds(conn, 4, MAX_FILES)
        size = struct.unpack("!I", head)[0] if len(head) == 4 else MAX_REQUEST + 1
        if size > MAX_REQUEST or not 3 <= len(fds) <= MAX_FILES:
            raise ValueError("a malformed request")
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("a request cut short")
            body += chunk
        request = json.loads(body)
        if len(request.get("fds", [0, 1, 2])) != len(fds):
            raise ValueError("a request whose files do not match")
    except (OSError, ValueError, struct.error) as error:
        for fd in fds if "fds" in locals() else []:
            os.close(fd)
        print(f"shardlab fork server: {error}", file=sys.stderr)
        return None
    conn.settimeout(None)
    if refused:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{', '.join(refused)} in the fork server\n".encode())
        return None
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        selector.close()
        for each in inherited:
            each.close()  # the listener and the other engines' connections are the server's, not this engine's
        forkchild.become_engine(conn, request, fds, server)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    return pid


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 3):
        print("usage: python -m shardlab.ranks.forkserver SOCKET|@NAME [OWNER_PID OWNER_START] (started by "
              "start_cluster, run_job and the stubs on Slurm nodes, not by hand)", file=sys.stderr)
        return 2
    serve(args[0], (int(args[1]), float(args[2])) if len(args) == 3 else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
