"""Process records: which processes shardlab started, so that they, and only they, can be stopped.

On a shared node other people run MPI jobs, and the same user may have a learner's cluster
open while the tests run. So nothing here matches processes by name:

- every process a cluster or a launched job starts carries ``SHARDLAB_ORIGIN`` in its
  environment: the origin of the process that started it (a notebook kernel, a test session),
  inherited by everything that process starts in turn;
- each cluster writes a record (owner kernel, processes as pid + creation time, Slurm jobs,
  profile folder) into a registry folder that belongs to this user alone and is checked before
  it is trusted.

A cluster's warden (``warden``) stops it once its kernel died, and a later ``start_cluster`` what
a killed warden left; both ignore records they did not write, cancel only Slurm jobs named after
the recorded cluster, and delete only profile folders this package created (our name prefix, ours,
with the marker file written at creation).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ..workarounds import process_started

ORIGIN = "SHARDLAB_ORIGIN"


def user_id() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


_OWN_ORIGIN = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # used only when the environment names none


def origin() -> str:
    """This process's origin, read when asked: ``$SHARDLAB_ORIGIN`` (inherited from the process that started
    this one, or set by a test session), else one of this process's own."""
    return os.environ.get(ORIGIN) or _OWN_ORIGIN


def marked_environment() -> dict[str, str]:
    """The variable to add to the environment of every process shardlab starts."""
    return {ORIGIN: origin()}


def profile_prefix() -> str:
    """Name prefix of the profile folders clusters create in the system temp folder (one per user)."""
    return f"shardlab-{user_id()}-"


class UnsafeFolder(RuntimeError):
    """A folder shardlab would trust belongs to someone else or is open to others; the message says what to do."""


def check_owner_only(path: Path) -> None:
    """Refuse a folder that is not a plain folder of this user's, closed to others (UnsafeFolder says why)."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a plain folder: remove it, shardlab will recreate it.")
    if info.st_uid != user_id():
        raise UnsafeFolder(f"{path} belongs to user id {info.st_uid}, not to you ({user_id()}): shardlab will not "
                           "trust records there. Set SHARDLAB_REGISTRY to a folder of yours.")
    if info.st_mode & 0o077:
        raise UnsafeFolder(f"{path} is open to other users (mode {info.st_mode & 0o777:o}): run chmod 700 on it, or "
                           "remove it.")


def registry_name() -> str:
    """The name of this user's registry folder in the temp folder."""
    return f"shardlab-{user_id()}-registry"


def registry() -> Path:
    """This user's registry folder (``$SHARDLAB_REGISTRY``, else one per user in the temp folder), owner-only."""
    path = Path(os.environ.get("SHARDLAB_REGISTRY") or Path(tempfile.gettempdir()) / registry_name())
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_owner_only(path)
    return path


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


PROFILE_MARKER = ".shardlab-profile"  # written into every profile folder at creation: its own path


def created_profile_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a profile folder this package created: our name prefix, a plain folder of ours,
    holding the marker file (ours too) that names this very folder. Wherever it lives (the temp folder, or a
    shared folder every node of a job can read), nothing else is ever deleted."""
    path = Path(path)
    try:
        info, marker = path.lstat(), (path / PROFILE_MARKER).lstat()
        named = (path / PROFILE_MARKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return (path.is_absolute() and path.name.startswith(profile_prefix()) and stat.S_ISDIR(info.st_mode)
            and info.st_uid == user_id() and stat.S_ISREG(marker.st_mode) and marker.st_uid == user_id()
            and named == str(path))


def make_profile_dir(cluster_id: str, root: str | os.PathLike | None = None) -> str:
    """A new owner-only profile folder for one cluster (connection files hold its encryption keys), in the temp
    folder, or in ``root`` (e.g. a shared home or scratch folder that every node of a Slurm job can read)."""
    if root is not None:
        root = Path(root).expanduser().absolute()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{profile_prefix()}{cluster_id}-", dir=root))  # mkdtemp makes it 0700
    (path / PROFILE_MARKER).write_text(str(path))
    return str(path)


def slurm_jobs_named(name: str) -> list[str]:
    """Ids of this user's Slurm jobs called ``name`` still in the queue (none without Slurm)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return []
    try:
        out = subprocess.run([squeue, "-h", "-u", str(user_id()), "-n", name, "-o", "%i"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def cancel_slurm_jobs(job_ids: list[str], name: str, wait_s: float = 30.0) -> list[str]:
    """Cancel the recorded jobs that are still queued under ``name`` (a job id alone could be someone else's
    by now) and wait until they have left the queue; return those still there after ``wait_s``."""
    mine = [job for job in job_ids if job in slurm_jobs_named(name)]
    if not mine:
        return []
    subprocess.run([shutil.which("scancel") or "scancel", *mine], capture_output=True, timeout=30)
    deadline = time.monotonic() + wait_s
    while (left := [job for job in mine if job in slurm_jobs_named(name)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@dataclass
class Record:
    """One cluster's entry in the registry: who owns it, what it started, what it created."""

    cluster_id: str
    owner_pid: int
    owner_created: float
    profile_dir: str
    processes: list = field(default_factory=list)
    jobs: list = field(default_factory=list)  # Slurm job ids (engines submitted with sbatch)
    job_name: str = ""  # what those jobs are called: a job is cancelled only if its id still carries this name
    folder: str = ""  # where the record is kept: the registry, or a pool of warm clusters (shardlab.ranks.warm)

    @classmethod
    def for_this_kernel(cls, cluster_id: str, profile_dir: str, job_name: str = "", folder: str = "") -> Record:
        return cls(cluster_id, *identity(), profile_dir, job_name=job_name, folder=folder)

    @property
    def path(self) -> Path:
        return Path(self.folder or registry()) / f"{self.cluster_id}.json"

    def save(self) -> None:
        if self.folder and not Path(self.folder).is_dir():
            return  # a pool of warm clusters that was stopped took its records, and what they name, with it
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, self.path)  # never a half-written record

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def owner_alive(self) -> bool:
        return same_process(self.owner_pid, self.owner_created) is not None

    def clean_up(self, grace_s: float = 3.0) -> None:
        """Cancel the recorded Slurm jobs, stop the recorded processes, delete the profile folder if we created
        it, drop the record."""
        if self.jobs and self.job_name:
            cancel_slurm_jobs([str(job) for job in self.jobs], self.job_name)
        stop(alive([tuple(p) for p in self.processes]), grace_s)
        if created_profile_dir(self.profile_dir):
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self.remove()


def load_record(path: Path) -> Record | None:
    """The record at ``path``, if it is a plain file of this user's that holds one (else None: not ours)."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != user_id():
            return None
        return Record(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def records_in(folder: Path | None = None) -> list[Record]:
    """The records in ``folder`` (default: this user's registry); files that are not records we wrote are left
    alone."""
    return [r for r in map(load_record, sorted(Path(folder or registry()).glob("*.json"))) if r is not None]


def clean_stale_clusters(folder: Path | None = None) -> int:
    """Stop the clusters of this user's kernels that are gone (records in ``folder``, default: the registry);
    return how many were cleaned."""
    cleaned = 0
    for record in records_in(folder):
        if not record.owner_alive():
            record.clean_up()
            cleaned += 1
    return cleaned
