"""A live view of every rank while a ``%%px`` cell runs: what each is doing, and whom the waiting ones wait for.

A cell that hangs says nothing until a time-out fires; by then a learner has stared at ``[*]`` for seconds or
minutes. The kernel's main thread is blocked in the cell, but a thread of its own can still read the files the
ranks' ``beacon`` threads write, and ipywidgets sends a widget's new value from any thread: so ``RankPanel`` (what
``cluster.panel()`` returns) keeps updating in the browser while the cell runs. Turning the files into rows and the
wait sentence is plain functions (``rank_rows``, ``wait_sentences``), testable without ranks or widgets.

The ranks write only while the panel is shown (the ``watched`` marker in the status folder): displayed, or
``watch()``; ``stop()``, ``close()`` and the browser dropping its last view of the panel remove the marker.
"""

from __future__ import annotations

import html
import json
import os
import threading
import time
from pathlib import Path

import ipywidgets
import psutil

from ..measure import flight
from . import beacon

EVERY_S = 0.5  # the panel reads the ranks' files this often
SILENT_S = 3.0  # a rank whose last report is older is not answering
STALE_COLLECTIVE_S = 2.0  # a last collective read longer ago says how long
WAIT_SHOWN_AFTER_S = 1.0  # ranks waiting less than this are just early: in a training step they always are


def entered_from(record: dict) -> list[flight.Entered]:
    """The newest collective of each group, as a rank's report holds them."""
    return [flight.Entered(group=tuple(e["group"]), seq=e["seq"], op=e["op"], done=e["done"],
                           started_ns=e["started_ns"], pg=e.get("pg", "")) for e in record.get("newest", [])]


def state_of(record: dict | None, now: float, watching_since: float, gone: bool) -> str:
    if gone:
        return "not answering (its process is gone)"
    if record is None or record["written"] < watching_since:
        return "no report yet" if now - watching_since < SILENT_S else "not answering (no report)"
    silent = now - record["written"]
    return f"not answering ({silent:.0f} s without a report)" if silent > SILENT_S else record["state"]


def mebibytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def rank_rows(records: dict[int, dict | None], now: float, watching_since: float = 0.0,
              gone: frozenset[int] = frozenset()) -> list[dict]:
    """One row per rank of ``records`` (rank -> its last report, None if there is none): its state, seconds in
    the current cell (the last cell's, once it ended), the last collective it entered, its memory."""
    rows = []
    for rank, record in sorted(records.items()):
        state = state_of(record, now, watching_since, rank in gone)
        row = {"rank": rank, "state": state, "cell": "", "last collective": "", "memory": ""}
        if record is not None:
            started, ended = record["cell_started"], record["cell_ended"]
            if started is not None:
                row["cell"] = f"{(ended or now) - started:.1f} s" + (" (last cell)" if ended else "")
            if entered := entered_from(record):
                last = max(entered, key=lambda e: e.started_ns)
                age = now - record["flight_read_ns"] / 1e9  # a rank busy entering collectives is read less often
                as_of = f", {age:.0f} s ago" if age >= STALE_COLLECTIVE_S else ""
                row["last collective"] = f"{last.label()} ({'done' if last.done else 'in progress'}{as_of})"
            memory = [f"{mebibytes(record['rss'])} RSS"]
            if record.get("device_bytes") is not None:
                memory.append(f"{mebibytes(record['device_bytes'])} on {record['device']}")
            row["memory"] = ", ".join(memory)
        rows.append(row)
    return rows


def wait_sentences(records: dict[int, dict | None], now: float) -> list[str]:
    """Who waits for whom, from the ranks' reports: ``flight.waits`` with the time each rank's collectives were
    read, so a report read before the others entered a collective does not count as missing it. Waits younger
    than ``WAIT_SHOWN_AFTER_S`` are left out."""
    read = {r: rec for r, rec in records.items() if rec is not None}
    found = flight.waits({r: entered_from(rec) for r, rec in read.items()},
                         read_ns={r: rec["flight_read_ns"] for r, rec in read.items()})
    return [w.sentence() for w in found if now - w.entered.started_ns / 1e9 >= WAIT_SHOWN_AFTER_S]


def read_records(folder: Path, ranks: list[int]) -> dict[int, dict | None]:
    records = {}
    for rank in ranks:
        try:
            records[rank] = json.loads(beacon.record_path(folder, rank).read_text())
        except (OSError, ValueError):
            records[rank] = None
    return records


COLUMNS = ("rank", "state", "cell", "last collective", "memory")
COLOURS = {"running": "#1a7f37", "idle": "#57606a", "failed": "#cf222e"}  # any other state: orange
CELL_STYLE = "text-align:left;padding:0 1.5em 0 0"


def render(rows: list[dict], sentences: list[str]) -> str:
    """The rows as an HTML table, each state in its colour, and the wait sentences below it in red."""
    def cell(row: dict, column: str) -> str:
        text = html.escape(str(row[column]))
        if column == "state":
            text = f'<b style="color:{COLOURS.get(row[column], "#bc4c00")}">{text}</b>'
        return f'<td style="{CELL_STYLE}">{text}</td>'

    head = "".join(f'<th style="{CELL_STYLE}">{c}</th>' for c in COLUMNS)
    body = "".join(f"<tr>{''.join(cell(row, c) for c in COLUMNS)}</tr>" for row in rows)
    waits = "".join(f'<p style="color:#cf222e"><b>{html.escape(s)}</b></p>' for s in sentences)
    return f"<div><table><tr>{head}</tr>{body}</table>{waits}</div>"


class RankPanel(ipywidgets.HTML):
    """Every rank's state as a table, updated every ``EVERY_S`` by a thread of the kernel, also while a cell runs.

    ``processes``: rank -> (hostname, pid) of its engine, to tell a rank whose process is gone (on this node)."""

    def __init__(self, folder: str | os.PathLike, processes: dict[int, tuple[str, int]]):
        super().__init__(value="<i>rank panel: starts once shown</i>", _view_count=0)
        self.folder, self.processes = Path(folder), dict(processes)
        self.rows: list[dict] = []
        self.sentences: list[str] = []
        self.watching_since = 0.0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.observe(self._views_changed, "_view_count")

    def _repr_mimebundle_(self, **kwargs):
        self.watch()
        return super()._repr_mimebundle_(**kwargs)

    def _views_changed(self, change) -> None:
        """The browser counts its views of the panel (``_view_count``): back at 0, nobody sees it."""
        if change["new"] == 0 and (change["old"] or 0) > 0:
            self.stop()
        elif change["new"]:
            self.watch()

    def watch(self) -> None:
        """Ask the ranks to report, and keep the table updated."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.folder.mkdir(exist_ok=True)
        (self.folder / beacon.WATCHED).touch()
        self.watching_since = time.time()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="shardlab-rank-panel", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the updates; the ranks stop writing."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None
        (self.folder / beacon.WATCHED).unlink(missing_ok=True)

    def close(self) -> None:
        self.stop()
        super().close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def gone(self) -> frozenset[int]:
        here = os.uname().nodename
        return frozenset(r for r, (host, pid) in self.processes.items() if host == here and not psutil.pid_exists(pid))

    def refresh(self) -> None:
        now = time.time()
        records = read_records(self.folder, sorted(self.processes))
        self.rows = rank_rows(records, now, self.watching_since, self.gone())
        self.sentences = wait_sentences(records, now)
        self.value = render(self.rows, self.sentences)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.refresh()
            except Exception as error:  # a widget closed under us, a folder removed at stop: say it, go on
                self.sentences = [f"panel: {type(error).__name__}: {error}"]
            self._stopping.wait(EVERY_S)
