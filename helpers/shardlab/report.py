"""Readable results: per-rank tables and a one-line-per-rank summary of a failed ``%%px`` cell.

No shardlab imports: every other layer may use it. Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tabulate import tabulate

_TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]+\.(cc|cpp|h):\d+\] ")


class Table:
    """Rows of dicts that render as HTML in a notebook and as plain text elsewhere.

    ``title``: lines printed above the text, each as a ``# `` comment; ``floatfmt``: how floats are written
    (e.g. ".4f"); ``tablefmt``: tabulate's text format ("plain": no rule under the header)."""

    def __init__(self, rows: list[dict], columns: list[str] | None = None, *, title: Sequence[str] = (),
                 floatfmt: str = "g", tablefmt: str = "simple"):
        self.rows = list(rows)
        self.columns = columns or (list(self.rows[0]) if self.rows else [])
        self.title, self.floatfmt, self.tablefmt = list(title), floatfmt, tablefmt

    def _cells(self):
        return [[row.get(c, "") for c in self.columns] for row in self.rows]

    def _repr_html_(self) -> str:
        return tabulate(self._cells(), headers=self.columns, tablefmt="html", floatfmt=self.floatfmt)

    def __str__(self) -> str:
        text = tabulate(self._cells(), headers=self.columns, tablefmt=self.tablefmt, floatfmt=self.floatfmt)
        return "\n".join([*(f"# {line}" for line in self.title), text])

    __repr__ = __str__


def summarize_rank_errors(errors: list[tuple[int, str, str]], ranks: list[int]) -> list[str]:
    """One line per failing rank, and which ranks a collective time-out was waiting for.

    ``errors`` holds (rank, exception name, message) for every rank that raised.
    """
    lines = []
    timed_out = []
    for rank, name, message in sorted(errors):
        first = next(iter((message or "").strip().splitlines()), "")
        first = _SOURCE_PREFIX.sub("", first)  # gloo prefixes its C++ file and line: noise for a learner
        lines.append(f"rank {rank}: {name}: {first[:200]}")
        if _TIMEOUT.search(f"{name} {message}"):
            timed_out.append(rank)
    if timed_out:
        absent = [r for r in ranks if r not in timed_out]
        if absent:
            lines.append(
                f"rank(s) {timed_out} timed out in a collective waiting for rank(s) {absent}, "
                "which never entered it (they raised first or skipped it)."
            )
        else:
            lines.append(f"every rank {timed_out} timed out: a collective nobody completed (mismatched calls?).")
    return lines


def rank_errors(error) -> list[tuple[int, str, str]]:
    """(rank, exception name, message) for every rank in an ipyparallel CompositeError."""
    original = getattr(error, "original_error", error)  # AlreadyDisplayedError wraps the composite one
    out = []
    for name, value, _tb, info in original.elist:
        rank = info.get("engine_id")
        if rank is None:  # a dead engine's error carries no engine id, only its message
            died = re.search(r"Engine (\d+) died", str(value))
            rank = int(died.group(1)) if died else -1
        out.append((rank, name, str(value)))
    return out
