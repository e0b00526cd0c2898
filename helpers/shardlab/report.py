"""Readable results: tables of rows that render as HTML in a notebook and as stable text in a terminal.

No shardlab imports: every other layer may use it. Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate


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
        # Cells as given: a leading indent says "of which" (bench's phases).
        text = tabulate(self._cells(), headers=self.columns, tablefmt=self.tablefmt, floatfmt=self.floatfmt,
                        preserve_whitespace=True)
        return "\n".join([*(f"# {line}" for line in self.title), text])

    __repr__ = __str__
