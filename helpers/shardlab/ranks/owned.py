"""Which processes shardlab started: marked with their origin, known by (pid, start time), and stopped.

On a shared node other people run MPI jobs, and the same user may have a learner's cluster open while the tests
run. So nothing here matches processes by name: every process a cluster or a launched job starts carries
``SHARDLAB_ORIGIN`` in its environment, the origin of the process that started it (a notebook kernel, a test
session), inherited by everything that process starts in turn; and a process recorded by pid is known by its start
time too (a recycled pid is not it). The clusters' records are ``records``; the folders they live in, ``folders``.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import psutil

from ..workarounds import process_started
from .folders import user_id

ORIGIN = "SHARDLAB_ORIGIN"


_OWN_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # used only when the environment names none


def origin() -> str:
    """This process's origin, read when asked: ``$SHARDLAB_ORIGIN`` (inherited from the process that started
    this one, or set by a test session), else one of this process's own."""
    return os.environ.get(ORIGIN) or _OWN_ORIGIN


def marked_environment() -> dict[str, str]:
    """The variable to add to the environment of every process shardlab starts."""
    return {ORIGIN: origin()}


def identity(pid: int | None = None) -> tuple[int, float]:
    """(pid, start time) of a process, default this one: a pid alone may name a later process. The start time is
    ``workarounds.process_started``'s, which a change of the wall clock does not move."""
    pid = os.getpid() if pid is None else pid
    return pid, process_started(pid)


def same_process(pid: int, created: float) -> psutil.Process | None:
    """The process recorded as (pid, creation time) if it still runs and is this user's; None otherwise
    (a recycled pid is not the process we recorded)."""
    try:
        proc = psutil.Process(pid)
        if abs(process_started(pid) - created) > 1e-3 or proc.uids().real != user_id():
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_tree(pid: int) -> list[tuple[int, float]]:
    """(pid, creation time) of a process and all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    out = []
    for p in procs:
        try:
            out.append(identity(p.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def running(pid: int) -> bool:
    """Whether process ``pid`` runs now, a zombie that only waits to be reaped excluded."""
    try:
        return bool(alive([identity(pid)]))
    except psutil.NoSuchProcess:
        return False


def alive(processes: list[tuple[int, float]]) -> list[psutil.Process]:
    """The recorded processes that still run (zombies, which only wait to be reaped, excluded)."""
    out = []
    for pid, created in processes:
        proc = same_process(pid, created)
        try:
            if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@contextlib.contextmanager
def own_origin(name: str):
    """Inside ``with``: everything this process starts inherits an origin of its own (this run's, ``name`` and the
    pid: yielded), whose processes are all stopped on the way out, whatever happened; then the origin it had."""
    inherited, own = os.environ.get(ORIGIN), f"{origin()}/{name}-{os.getpid()}"
    os.environ[ORIGIN] = own
    try:
        yield own
    finally:
        stop(leftover_processes(own))
        if inherited is None:
            del os.environ[ORIGIN]
        else:
            os.environ[ORIGIN] = inherited


def stop(procs: list[psutil.Process], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after ``grace_s``."""
    for proc in procs:
        try:
            proc.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for proc in left:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(left, timeout=grace_s)


def memory_rows(processes: list[tuple[int, float]], roles: dict[int, str]) -> list[dict]:
    """Memory of the recorded processes that still run, one row each, in MiB, named by ``roles`` (else
    "launcher (<name>)"). ``rss`` counts shared pages (libraries) in every process that maps them; ``pss`` splits
    them between those processes, so the ``pss`` column adds up to what they take together; ``uss`` is a
    process's alone."""
    rows = []
    for proc in alive([tuple(p) for p in processes]):
        try:
            info = proc.memory_full_info()
            rows.append({"process": roles.get(proc.pid, f"launcher ({proc.name()})"), "pid": proc.pid,
                         "rss_mib": info.rss / 2**20, "pss_mib": info.pss / 2**20, "uss_mib": info.uss / 2**20})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(rows, key=lambda r: r["process"])


def leftover_processes(of_origin: str | None = None) -> list[psutil.Process]:
    """This user's live processes that shardlab started from ``of_origin`` (default: this process's origin)
    or from an origin nested in it (``<origin>/...``, e.g. one test of a test session)."""
    want = of_origin or origin()
    me, out = os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if proc.pid == me or proc.uids().real != user_id() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            theirs = proc.environ().get(ORIGIN, "")
            if theirs == want or theirs.startswith(want + "/"):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out
