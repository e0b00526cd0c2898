"""Ranks die with their kernel: one small process per cluster that stops it as soon as the process owning it is gone.

A kernel killed by the OOM killer, a crash or SIGKILL runs no ``atexit``: its controller, launcher and engines would
run on, parented to init, until the next ``start_cluster`` of the same user cleans up after it (``records``), which may
be never. So every fresh start also starts a warden (``python -m shardlab.ranks.warden RECORD``) in a session of its
own, which reads the cluster's record twice a second and, once the record's owner (pid and start time, so a recycled
pid is not taken for it) has gone, stops everything of that cluster: what the record lists, and every process of this
user marked with the cluster's id (``CLUSTER``), which a start cut short may not have recorded yet. It exits with
nothing to do once the record is gone (the cluster was stopped).

The owner is whoever the record names: the kernel that started the cluster, a parked cluster's keeper
(``warm.park``), then the kernel that claims it (``warm.claim``). A keeper whose cluster is claimed waits until the
record names the claimant before it exits (``handed_over``), so the warden never sees the cluster without a live owner.

Why not ``PR_SET_PDEATHSIG`` on the processes a start runs: it fires when the *thread* that forked them ends, and
in a notebook kernel ipyparallel starts the controller and mpiexec from a thread of its own
(``ipyparallel/_async.py``, ``AsyncFirst._in_thread``); a parked cluster outlives the kernel that started it; and the
engines are mpiexec's children, not ours. Nothing else is touched: the record is read only from this user's own
folder (``records.load_record``), and a process is stopped only if it is this user's and either recorded (pid and start
time) or marked with this cluster's id.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil

from . import folders, owned, records, subprocesses

CLUSTER = "SHARDLAB_CLUSTER"  # in the environment of every process of a cluster (and its warden): the cluster's id
POLL_S = 0.5
GRACE_S = 2.0  # SIGTERM, then SIGKILL: the owner's death plus this stays well inside the 10 s a cluster may outlive it
HANDOVER_S = 30.0  # how long a keeper whose cluster was claimed waits for the claimant to name itself the owner


def marked_environment(cluster_id: str) -> dict[str, str]:
    """What the environment of every process of cluster ``cluster_id`` gets."""
    return {CLUSTER: cluster_id}


def start(record: records.Record, environment: dict[str, str]) -> tuple[int, float]:
    """Start the warden of ``record``'s cluster (saved already) with ``environment`` (marked as the cluster's
    processes are); (pid, start time)."""
    return subprocesses.start_detached([sys.executable, "-m", "shardlab.ranks.warden", str(record.path)],
                                environment | marked_environment(record.cluster_id))


def marked_processes(cluster_id: str) -> list[psutil.Process]:
    """This user's live processes marked with ``cluster_id`` (the calling process excluded)."""
    me, out = os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if (proc.pid != me and proc.uids().real == folders.user_id() and proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get(CLUSTER) == cluster_id):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return out


def stop_cluster(record: records.Record) -> None:
    """Stop every process of ``record``'s cluster, recorded or marked, together; then what ``Record.clean_up``
    does (Slurm jobs cancelled, profile folder and record removed)."""
    found = {proc.pid: proc for proc in [*owned.alive(record.processes), *marked_processes(record.cluster_id)]}
    found.pop(os.getpid(), None)
    owned.stop(list(found.values()), GRACE_S)
    record.clean_up(grace_s=GRACE_S)


def owner_runs(record: records.Record) -> bool:
    """Whether the record's owner runs: a killed owner that its parent has not reaped yet (a zombie) does not."""
    return bool(owned.alive([(record.owner_pid, record.owner_created)]))


def watch(path: Path, poll_s: float = POLL_S) -> bool:
    """Wait while the record at ``path`` exists and its owner runs; stop the cluster once the owner is gone. True if
    it stopped the cluster, False if the record went first."""
    while (record := records.load_record(path)) is not None:
        if owner_runs(record):
            time.sleep(poll_s)
            continue
        again = records.load_record(path)  # the owner may have handed the cluster over meanwhile
        if again is None:
            return False
        if (again.owner_pid, again.owner_created) == (record.owner_pid, record.owner_created):
            stop_cluster(again)
            return True
    return False


def handed_over(record_path: Path, me: tuple[int, float], timeout_s: float = HANDOVER_S) -> bool:
    """For a keeper whose cluster was claimed: wait until the record at ``record_path`` names another owner than
    ``me`` (or is gone: the cluster was stopped); False if it still names ``me`` after ``timeout_s`` (a claimant
    that died first: the warden then stops the cluster)."""
    deadline = time.monotonic() + timeout_s
    while (record := records.load_record(record_path)) is not None and (record.owner_pid, record.owner_created) == me:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> int:
    # Its own session has no terminal; a hang-up or Ctrl-C meant for the kernel is not for the warden.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m shardlab.ranks.warden RECORD (started by start_cluster, not by hand)", file=sys.stderr)
        return 2
    watch(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
