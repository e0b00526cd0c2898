"""The pool of warm clusters, on the host: ranks parked for the next notebook, claimed by it, stopped when unused.

A learner going from one notebook to the next should not wait for ranks again. With a pool (``SHARDLAB_WARM_POOL``,
which ``make lab`` and the test suite set; unset: off), a notebook's ``cluster.stop()`` *parks* its cluster, and the
next ``sl.start_cluster()`` of the same shape in the same pool *claims* it and resets every rank to what a fresh
start gives: an empty namespace, new process groups on a new port, no compiled graphs, the series' own ShardTensor
handlers only, the RNG of a new process, memory given back.

- A pool is an owner-only folder of one user (``run`` makes one around a command, e.g. JupyterLab, and stops what
  is in it when the command ends). It holds the parked clusters' records, profiles and a settings file: how long a
  parked cluster waits, and the origin its processes are marked with (``owned``).
- A parked cluster has a small keeper process (``python -m shardlab.ranks.warm keep``) that owns it: once the idle time
  is up, the keeper stops it and exits. Claiming is an atomic rename of the parked marker, so one kernel wins.
- One parked cluster per pool: parking another stops the older one, so a learner holds at most one idle cluster.
- A kernel never claims the cluster it parked itself: ``stop()`` then ``start_cluster()`` in one notebook asks for
  new ranks (notebook 07 restarts from a checkpoint on really fresh processes).
- Only mpiexec engines are parked: a Slurm job would hold its nodes idle.
- Parking gives back what a waiting rank need not hold (``rankstate.park_rank``, run on the ranks, as is the reset,
  ``rankstate.reset_rank``): its namespace, process groups (NCCL's buffers), cached GPU blocks. Its CUDA context
  stays, so a start on CUDA first stops the parked clusters on CUDA (``stop_parked_on_cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import folders, owned, records, subprocesses, warden

POOL = "SHARDLAB_WARM_POOL"
SETTINGS = "pool-settings"
PARKED = ".parked"
DEFAULT_IDLE_S = 900.0  # a parked cluster waits this long for the next notebook (make lab's default)
RESET_TIMEOUT_S = 60.0  # a reset that takes longer means ranks that are not well: start fresh instead


class Pool:
    """One user's pool of parked clusters: a folder of records, profiles and parked markers."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        folders.check_owner_only(self.folder)  # another user's pool is never trusted, nor one open to others
        settings = json.loads((self.folder / SETTINGS).read_text())
        self.origin, self.idle_s = settings["origin"], float(settings["idle_s"])

    @classmethod
    def create(cls, origin: str, idle_s: float = DEFAULT_IDLE_S) -> Pool:
        folder = Path(tempfile.mkdtemp(prefix=f"{folders.profile_prefix()}warm-"))  # owner-only
        (folder / SETTINGS).write_text(json.dumps({"origin": origin, "idle_s": idle_s}))
        return cls(folder)

    @classmethod
    def from_environment(cls) -> Pool | None:
        """The pool ``$SHARDLAB_WARM_POOL`` names (None when unset, or when its folder is gone: keeping warm is off)."""
        folder = os.environ.get(POOL)
        if not folder or not Path(folder, SETTINGS).exists():
            return None
        return cls(folder)

    def marked_environment(self) -> dict[str, str]:
        """What a pool's processes carry instead of the starting kernel's origin: they outlive that kernel."""
        return {owned.ORIGIN: self.origin}

    def parked(self) -> list[Parked]:
        return [p for p in map(Parked.load, sorted(self.folder.glob(f"*{PARKED}"))) if p is not None]

    def clean_up(self) -> int:
        """Stop what nobody owns any more: clusters of kernels that died, parked clusters whose keeper is gone or
        whose idle time is up. Returns how many."""
        cleaned = 0
        for parked in self.parked():
            if not parked.keeper_alive() or time.time() > parked.deadline:
                if (claimed := parked.claim()) is not None:
                    claimed.clean_up()
                    cleaned += 1
        return cleaned + records.clean_stale_clusters(self.folder)

    def stop(self) -> tuple[int, int]:
        """Stop every cluster of the pool, parked or not, and remove its folder (``make lab`` at exit, a test
        session at its end): (ranks that were parked, clusters that were not: a kernel that never stopped its own)."""
        claimed = [(parked.shape["n"], record) for parked in self.parked() if (record := parked.claim()) is not None]
        for _, record in claimed:
            record.clean_up()
        for record in (in_use := records.records_in(self.folder)):
            record.clean_up(grace_s=1.0)
        shutil.rmtree(self.folder, ignore_errors=True)
        return sum(n for n, _ in claimed), len(in_use)


def shape_of(n: int, device: str, engines: str, mpi: str, controller_ip: str, shared_dir) -> dict:
    """What a parked cluster must match to be claimed: everything fixed when its engines started."""
    return {"n": n, "device": device, "engines": engines, "mpi": mpi, "controller_ip": controller_ip,
            "shared_dir": str(shared_dir or ""), "python": sys.executable,
            "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "") if device == "cuda" else ""}


@dataclass
class Parked:
    """A parked cluster's marker: which record, what shape, who parked it, until when it waits, its keeper."""

    path: str
    cluster_id: str
    shape: dict
    parked_by: list  # (pid, creation time) of the kernel that parked it
    deadline: float
    keeper: list  # (pid, creation time); [] until the keeper runs

    @classmethod
    def load(cls, path: Path) -> Parked | None:
        try:
            return cls(**json.loads(path.read_text()) | {"path": str(path)})
        except (OSError, ValueError, TypeError):
            return None

    def save(self) -> None:
        tmp = Path(self.path).with_suffix(".parked-tmp")  # not the record's .tmp
        tmp.write_text(json.dumps({k: v for k, v in asdict(self).items() if k != "path"}))
        os.replace(tmp, self.path)

    def keeper_alive(self) -> bool:
        return bool(self.keeper) and owned.same_process(*self.keeper) is not None

    def record(self) -> records.Record | None:
        return records.load_record(Path(self.path).with_name(f"{self.cluster_id}.json"))

    def claim(self) -> records.Record | None:
        """Take the parked cluster out of the pool (an atomic rename: of two claimants, one wins); its record, or
        None if someone else took it first. The keeper exits once the record names another owner (``warden``)."""
        taken = Path(self.path).with_suffix(f".claimed-{os.getpid()}")
        try:
            os.rename(self.path, taken)
        except FileNotFoundError:
            return None
        taken.unlink()
        return self.record()


def claim(pool: Pool, shape: dict) -> records.Record | None:
    """A parked cluster of ``shape`` that another kernel parked, taken out of the pool, with this kernel as its
    owner; None if there is none. Expired or orphaned parked clusters are stopped on the way."""
    pool.clean_up()
    me = list(owned.identity())
    for parked in pool.parked():
        if parked.shape != shape or parked.parked_by == me:
            continue
        if (record := parked.claim()) is not None:
            record.owner_pid, record.owner_created = me
            record.save()
            return record
    return None


def evict_own(pool: Pool, shape: dict) -> None:
    """Stop the parked clusters of ``shape`` that this kernel parked: a fresh start of the same shape from it means
    their ranks will not be used again."""
    me = list(owned.identity())
    for parked in pool.parked():
        if parked.shape == shape and parked.parked_by == me and (record := parked.claim()) is not None:
            record.clean_up(grace_s=1.0)


def park(pool: Pool, record: records.Record, shape: dict) -> None:
    """Hand a cluster, idle and healthy, to a keeper of its own; the older parked clusters of the pool stop."""
    for older in pool.parked():
        if (claimed := older.claim()) is not None:
            claimed.clean_up(grace_s=1.0)
    parked = Parked(str(pool.folder / f"{record.cluster_id}{PARKED}"), record.cluster_id, shape,
                    list(owned.identity()), time.time() + pool.idle_s, [])
    parked.save()
    keeper_id = list(subprocesses.start_detached([sys.executable, "-m", "shardlab.ranks.warm", "keep", parked.path],
                                          os.environ | pool.marked_environment()))
    record.owner_pid, record.owner_created = keeper_id
    record.save()
    parked.keeper = keeper_id
    if Path(parked.path).exists():
        parked.save()


def stop_parked_on_cuda(pool: Pool) -> list[str]:
    """Stop every parked cluster of ``pool`` whose ranks run on CUDA, whatever its shape; their ids. A parked rank
    keeps its CUDA context on its GPU (``park_rank``): new CUDA engines would share the GPUs with ranks that wait for
    nobody. Any CUDA shape counts: which physical GPUs two CUDA_VISIBLE_DEVICES strings name (indices, UUIDs, MIG
    slices) cannot be told reliably from here."""
    stopped = []
    for parked in pool.parked():
        if parked.shape.get("device") == "cuda" and (record := parked.claim()) is not None:
            record.clean_up(grace_s=1.0)
            stopped.append(parked.cluster_id)
    return stopped


def keep(marker: Path, poll_s: float = 0.5) -> None:
    """The keeper, owner of its parked cluster: stops it when its idle time is up; exits once a kernel claimed it."""
    while (parked := Parked.load(marker)) is not None:
        if time.time() > parked.deadline:
            if (record := parked.claim()) is not None:
                record.clean_up(grace_s=1.0)
            return
        time.sleep(poll_s)
    warden.handed_over(marker.with_name(marker.name.removesuffix(PARKED) + ".json"), owned.identity())  # not ownerless


def kernel_environment() -> dict[str, str]:
    """What a claimed rank takes from the claiming kernel: its temp folder, so that files go where it expects."""
    return {"TMPDIR": tempfile.gettempdir()}


# -- command line ---------------------------------------------------------------------------------------------------


def run(command: list[str], idle_s: float) -> int:
    """Run ``command`` (JupyterLab) with a pool of its own, then stop whatever is in the pool and say on the
    terminal what was stopped (``stopped_message``). ``idle_s`` 0: no pool, keeping warm is off."""
    if idle_s <= 0:
        return subprocess.call(command)
    pool = Pool.create(f"{owned.origin()}/warm", idle_s)
    child = subprocess.Popen(command, env=os.environ | {POOL: str(pool.folder)})
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches JupyterLab, which asks and exits; then we clean
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    try:
        return child.wait()
    finally:
        print(stopped_message(command, child.poll(), *pool.stop()), file=sys.stderr, flush=True)


def stopped_message(command: list[str], code: int | None, ranks: int, in_use: int) -> str:
    """What the terminal says once ``command`` exited with ``code`` and its pool stopped (``Pool.stop``)."""
    what = "JupyterLab" if [Path(command[0]).name, *command[1:2]] == ["jupyter", "lab"] else Path(command[0]).name
    ended = f"{what} stopped" if code in (0, -signal.SIGINT, -signal.SIGTERM) else f"{what} exited with code {code}"
    stopped = [f"{ranks} warm rank{'s' * (ranks != 1)}"] * bool(ranks) + [f"{in_use} running cluster(s)"] * bool(in_use)
    return f"shardlab: {ended}; " + (f"stopped {' and '.join(stopped)}." if stopped else "no warm ranks were waiting.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.ranks.warm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run_parser = sub.add_parser("run", help="run a command (JupyterLab) with a pool of warm clusters of its own")
    run_parser.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S,
                            help="how long a parked cluster waits for the next notebook (0: keeping warm is off)")
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("keep", help=argparse.SUPPRESS).add_argument("marker")
    args = parser.parse_args(argv)
    if args.what == "keep":
        keep(Path(args.marker))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    return run(command, args.idle_s)


if __name__ == "__main__":
    sys.exit(main())
