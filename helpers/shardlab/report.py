"""Readable results: tables of rows that render as HTML in a notebook and as stable text in a terminal, byte counts
as text, and the rows of the lessons' result tables, built from what the ranks measured (the lesson's cell keeps its
own calls and its checks; the bookkeeping of turning per-rank results into rows is here).

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


def fmt_bytes(n: float) -> str:
    """Bytes in the unit that reads best: ``1.50 GiB``, ``12.3 MiB``, ``640 B``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def wrapper_state_rows(memory: list[dict], ddp_size: int, peaks: list[dict] | None = None) -> list[dict]:
    """Notebook 05: per rank, the state bytes (everything but the activations) under DDP and under FSDP2 (its
    padding included), their ratio beside 1/ddp, and, given ``peaks``, each wrapper's measured peak during training.
    ``memory``: each rank's {"DDP"/"FSDP2": {category: bytes}}; ``peaks``: each rank's {wrapper: {"peak above
    start": bytes}}."""
    rows = []
    for r, setups in enumerate(memory):
        ddp, fsdp = (sum(v for k, v in setups[name].items() if k != "activations") for name in ("DDP", "FSDP2"))
        rows.append({"rank": r, "DDP state bytes": ddp, "FSDP2 state bytes (with padding)": fsdp,
                     "FSDP2 padding": setups["FSDP2"]["padding"], "FSDP2 / DDP": round(fsdp / ddp, 4),
                     "1 / ddp": round(1 / ddp_size, 4)}
                    | ({f"CUDA peak above start, {name} training": peaks[r][name]["peak above start"]
                        for name in ("DDP", "FSDP2")} if peaks else {}))
    return rows


def largest_rank(ranks: list[dict]) -> dict:
    """Of one load measured on every rank (``sl.measure.measure_loading``), the rank that held the most at its peak."""
    return max(ranks, key=lambda r: r["held after"] + (r["host peak"] or 0))


def loading_rows(loading: list[dict], fields: int) -> list[dict]:
    """Notebook 12: per domain size and way of loading, what the largest rank read, peaked at and held, beside 1/N of
    the ``fields`` bytes. ``loading``: each rank's {N: {way: measurement}} (``sl.measure.measure_loading``)."""
    rows = []
    for d, ways in loading[0].items():
        for way in ways:
            ranks = [per_rank[d][way] for per_rank in loading]
            top = largest_rank(ranks)
            rows.append({"N": d, "way": way,
                         "file bytes (largest rank)": fmt_bytes(max(r["file bytes"] or 0 for r in ranks)),
                         "host peak (largest rank)": fmt_bytes(max(r["host peak"] or 0 for r in ranks)),
                         "held after": fmt_bytes(top["held after"]), "1/N of the fields": fmt_bytes(fields // d),
                         "GPU peak": fmt_bytes(top["device peak"]) if top["device peak"] is not None else "-"})
    return rows


def inference_rows(inference: list[dict], reference: dict, whole_bytes: int) -> list[dict]:
    """Notebook 13: per rank, the points it predicted, the bytes of prediction it held beside the whole prediction's
    ``whole_bytes``, the collectives of its write and metric, and its allocator peak beside one process's
    (``reference``). ``inference``: each rank's measurement."""
    return [{"rank": r, "device": i["device"], "points": f"{i['first']}..{i['first'] + i['points']}",
             "prediction held": fmt_bytes(i["held"]), "whole prediction": fmt_bytes(whole_bytes),
             "collectives, write and metric": "; ".join(f"{op} {c['calls']}× {c['bytes']} B"
                                                        for op, c in i["collectives"].items()),
             "allocator peak": fmt_bytes(i["peak"]), "one process": fmt_bytes(reference["peak"]),
             "ratio": f"{i['peak'] / reference['peak']:.2f}"} for r, i in enumerate(inference)]


def scaling_rows(scaling: str, rows: list[dict], kind: str) -> list[dict]:
    """Notebook 14: one row per domain size N of a scaling run (``sl.measure.timeline.across_ranks``), its step time
    beside the ideal, the share of communication, and the share of it that ShardTensor's all-reduce took (``kind``: its
    name in the timeline, ``sl.measure.timeline.SHARD_ALL_REDUCE``)."""
    return [{"scaling": scaling, "N": r["N"], "rows per rank": r["rows per rank"],
             "ms per step": f"{1e3 * r['step_s']:.1f}", "ideal ms": f"{1e3 * r['ideal_s']:.1f}",
             "communication": f"{100 * r['communication']:.0f} %",
             "of it ShardTensor's all-reduce": f"{100 * r['kinds'][kind]:.0f} %"} for r in rows]
