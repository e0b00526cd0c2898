"""Each rank reports what it is doing to a file the notebook's kernel can read while a ``%%px`` cell blocks it.

While a cell runs, the kernel's main thread waits on the engines and cannot ask them anything: ipyparallel answers
only once the cell is done. So every rank keeps a daemon thread that writes its own state (running, idle or failed,
since when, the last collective it entered, its memory) to ``<status folder>/rank-<r>.json``, which the kernel's
``panel`` reads. The folder sits in the cluster's profile folder, which the cluster removes when it stops.

Costs nothing while nobody looks: the thread writes only while the panel's ``watched`` marker exists in the folder,
and otherwise only checks for it once a second. Reading torch's Flight Recorder is the one expensive part (it
holds the GIL, about 50 ms for 2000 entries, in proportion for the ``flight.BUFFER_ENTRIES`` kept, and every rank of
a collective waits for the slowest), so a rank reads it again only when a group's collective count moved or a
collective it saw was still in progress: within a second once the rank stops entering new collectives (it waits, is
stuck or idle: what the panel is for), but only every ``FLIGHT_BUSY_EVERY_S`` while it enters them one after the
other (a training loop, where the last one is stale the moment it is read anyway).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import psutil

from ..measure import flight

STATUS = "rank-status"  # the folder, inside the cluster's profile folder
WATCHED = "watched"  # present while a panel shows the ranks
BEAT_S = 0.5  # a watched rank writes this often
LOOK_S = 1.0  # an unwatched rank looks for the marker this often
FLIGHT_EVERY_S = 1.0  # the Flight Recorder of a rank that stopped entering collectives is read at most this often,
FLIGHT_BUSY_EVERY_S = 10.0  # of a rank busy entering them, this often,
FLIGHT_SHARE = 0.02  # and never for more than this share of the rank's time


def status_folder(profile_dir: str | os.PathLike) -> Path:
    return Path(profile_dir) / STATUS


def record_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.json"


def engine_status_folder() -> Path | None:
    """On an engine: the status folder in the profile folder it was started with (None outside an engine)."""
    from ipyparallel.engine.app import IPEngine

    return status_folder(IPEngine.instance().profile_dir.location) if IPEngine.initialized() else None


def write_json_atomically(path: Path, data: dict) -> None:
    """A reader sees the old file or the new one, never half of one."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def group_counts() -> tuple | None:
    """How many collectives each process group of this rank has numbered: when it has not moved, the collectives
    the Flight Recorder holds have not either. None when a backend cannot say."""
    import torch.distributed.distributed_c10d as c10d

    try:
        return tuple(sorted((pg.group_name, pg._get_sequence_number_for_group())
                            for pg in list(c10d._world.pg_group_ranks)))
    except (RuntimeError, AttributeError):
        return None


def accelerator_bytes(device: str) -> int | None:
    """Bytes torch has allocated on ``device`` when it is this process's accelerator (None on a host-only rank)."""
    import torch

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or torch.device(device).type != accelerator.type:
        return None
    return torch.accelerator.memory_allocated(torch.device(device).index or 0)


class Beacon:
    """One rank's reporter: IPython's cell events give its state (a cell that raised leaves it "failed"), a daemon
    thread writes it while watched."""

    def __init__(self, folder: Path, rank: int, device: str):
        self.folder, self.rank, self.device = folder, rank, device
        self.state, self.cell_started, self.cell_ended = "idle", None, None
        self._newest: list[flight.Entered] = []  # the newest collective of each group, as last read
        self._flight_read_ns, self._counts, self._beat_counts = 0, None, None  # counts at the last read; last beat
        self._last_flight, self._flight_cost = 0.0, 0.0  # when the Flight Recorder was last read, and how long it took
        self._wake, self._stopping = threading.Event(), threading.Event()
        self.thread: threading.Thread | None = None

    def cell_started_now(self) -> None:
        self.state, self.cell_started, self.cell_ended = "running", time.time(), None

    def cell_finished(self) -> None:
        from IPython import get_ipython

        failed = not get_ipython().last_execution_succeeded
        self.state, self.cell_ended = ("failed" if failed else "idle"), time.time()

    def _read_flight(self) -> None:
        """Read the Flight Recorder again if it may hold something new; else only move the time the record is
        known to be current to now (what ``flight.waits`` compares with the others' collectives)."""
        now_ns, counts = time.time_ns(), group_counts()
        moving, self._beat_counts = counts is None or counts != self._beat_counts, counts
        if counts is not None and counts == self._counts and all(e.done for e in self._newest):
            self._flight_read_ns = now_ns
            return
        every_s = max(FLIGHT_BUSY_EVERY_S if moving else FLIGHT_EVERY_S, self._flight_cost / FLIGHT_SHARE)
        if time.monotonic() < self._last_flight + every_s:
            return
        t0 = time.monotonic()
        newest: dict[tuple, flight.Entered] = {}
        for e in flight.entered():  # since this rank last joined a process group
            if (e.pg, e.group) not in newest or e.seq > newest[(e.pg, e.group)].seq:
                newest[(e.pg, e.group)] = e
        self._newest, self._counts, self._flight_read_ns = list(newest.values()), counts, now_ns
        self._last_flight, self._flight_cost = t0, time.monotonic() - t0

    def report(self) -> dict:
        self._read_flight()
        return {"rank": self.rank, "pid": os.getpid(), "state": self.state, "cell_started": self.cell_started,
                "cell_ended": self.cell_ended, "written": time.time(), "flight_read_ns": self._flight_read_ns,
                "newest": [dataclasses.asdict(e) | {"sizes": []} for e in self._newest],
                "rss": psutil.Process().memory_info().rss, "device": self.device,
                "device_bytes": accelerator_bytes(self.device)}

    def start_thread(self) -> None:
        """The thread that writes while watched, unless it runs already."""
        if self.thread is None or not self.thread.is_alive():
            self._stopping.clear()
            self.thread = threading.Thread(target=self._run, name="shardlab-beacon", daemon=True)
            self.thread.start()
        self._wake.set()

    def stop(self) -> None:
        """End the thread (the cell events stay: ``start`` brings the thread back); what a measurement of the beacon's
        cost compares with (scripts/panel_overhead.py)."""
        self._stopping.set()
        self._wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            watched = (self.folder / WATCHED).exists()
            if watched:
                try:
                    write_json_atomically(record_path(self.folder, self.rank), self.report())
                except Exception:  # a groups table changing under us, a folder being removed: next beat
                    self._last_flight = 0.0
            self._wake.wait(BEAT_S if watched else LOOK_S)
            self._wake.clear()


_BEACON: Beacon | None = None  # this process's, kept across a warm rank's resets


def start(folder: Path, rank: int, device: str) -> Beacon:
    """Start this rank's beacon, or point the running one at ``folder`` and this start's collectives (a warm rank
    reset for the next notebook: its cell events are registered once, its thread started once)."""
    global _BEACON
    from IPython import get_ipython

    folder.mkdir(exist_ok=True)
    if _BEACON is None:
        _BEACON = Beacon(folder, rank, device)
        if (shell := get_ipython()) is not None:
            # Not pre_run_cell / post_run_cell: ipyparallel's view.execute runs its cells silent, which skips them.
            shell.events.register("pre_execute", _BEACON.cell_started_now)
            shell.events.register("post_execute", _BEACON.cell_finished)
    else:
        _BEACON.folder, _BEACON.rank, _BEACON.device = folder, rank, device
        _BEACON._counts, _BEACON._newest, _BEACON._last_flight = None, [], 0.0
    _BEACON.start_thread()
    return _BEACON
