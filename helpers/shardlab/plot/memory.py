"""Bytes per rank and category: stacked bars, predicted against measured, and ratios over mesh sizes; the lessons'
memory figures built from what the ranks measured (``wrapper_memory``: notebook 05, ``loading_bars``: 12). Byte figures
share one unit per figure, picked to suit it (``_base._units``), and label in plain numbers (``_base._plain``)."""

from __future__ import annotations

import textwrap

import numpy as np
from matplotlib.patches import Patch

from ..report import largest_rank
from ._base import _category_colour, _figure_and_axes, _new_figure, _plain, _plain_ticks, _units


def _stacked(ax, x, stacks: list[dict], categories: list, scale: float, width: float, **style):
    """One stacked bar per position of ``x``, a segment per category (same colour for a category everywhere, a
    missing one stacked as 0); returns the bar containers, one per category, and the tops."""
    bottom = np.zeros(len(stacks))
    handles = []
    for i, category in enumerate(categories):
        values = np.array([stack.get(category, 0) for stack in stacks], dtype=float) / scale
        handles.append(ax.bar(x, values, width, bottom=bottom, color=_category_colour(i), edgecolor="white",
                              linewidth=0.5, label=category, **style))
        bottom += values
    return handles, bottom


def memory_bars(per_rank, ideal=None, unit=None, title=None, ax=None, capacity=None, capacity_label="GPU memory",
                peaks=None, peak_label="allocator peak (measured)", ideal_label="ideal"):
    """Stacked bars of bytes per category for each rank, with the total on top and an optional ideal marker.

    ``ideal``: {label: bytes}, a black mark across its bar, named ``ideal_label`` in the legend (the legend names every
    mark and colour: a title need not).
    ``capacity`` (bytes) draws a dashed line across the bars: what each device can hold. ``peaks``: {label: bytes}, a
    measured peak drawn as a red mark across its bar, its value above it. ``unit``: None picks the unit that suits the
    largest value (``_base._units``).
    """
    labels = list(per_rank)
    categories = list(dict.fromkeys(c for label in labels for c in per_rank[label]))  # first appearance
    ideal, peaks = ideal or {}, peaks or {}
    for name, marks in (("ideal", ideal), ("peaks", peaks)):
        if unknown := set(marks) - set(labels):
            raise ValueError(f"{name} has labels {sorted(unknown)} that are not in per_rank {labels}.")
    largest = max([*(sum(per_rank[label].values()) for label in labels), *ideal.values(), *peaks.values(),
                   capacity or 0], default=0)
    unit, scale = _units(unit, largest)

    fig, ax = _figure_and_axes(ax, (max(4.0, 0.9 * len(labels) + 2.8), 4.2))
    x = np.arange(len(labels))
    handles, bottom = _stacked(ax, x, [per_rank[label] for label in labels], categories, scale, 0.6)

    marks = np.array([ideal[label] / scale if label in ideal else np.nan for label in labels])
    has_mark = ~np.isnan(marks)
    mark_handles = []
    if has_mark.any():
        mark_handles.append(ax.hlines(marks[has_mark], x[has_mark] - 0.4, x[has_mark] + 0.4, colors="black",
                                      linewidth=2.5, label=ideal_label, zorder=3))
    peak_marks = np.array([peaks[label] / scale if label in peaks else np.nan for label in labels])
    if (has_peak := ~np.isnan(peak_marks)).any():
        mark_handles.append(ax.hlines(peak_marks[has_peak], x[has_peak] - 0.3, x[has_peak] + 0.3, colors="tab:red",
                                      linewidth=2.5, label=peak_label, zorder=4))
    near = 0.07 * largest / scale  # about a label's height
    for xi, total, mark, peak in zip(x, bottom, marks, peak_marks):
        if not np.isnan(peak):
            ax.annotate(_plain(peak), (xi, peak), xytext=(0, 2), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7, color="tab:red")
        # The total sits above the ideal mark too, so the mark never strikes through the number, and above a peak's
        # label when the two would meet.
        top = total if np.isnan(mark) else max(total, mark)
        close = not np.isnan(peak) and abs(peak - top) < 1.5 * near
        ax.annotate(_plain(total), (xi, max(top, peak) if close else top), xytext=(0, 12 if close else 4),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)

    if capacity is not None:
        mark_handles.append(ax.axhline(capacity / scale, color="tab:red", linestyle="--", linewidth=1.5, zorder=4,
                                       label=f"{capacity_label}: {_plain(capacity / scale)} {unit}"))
    ax.set_ylim(0, (largest / scale or 1) * 1.15)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 6 else 0)
    _plain_ticks(ax.yaxis)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title or "memory per rank, by category", fontsize=10)
    # Reversed, so the legend reads top to bottom like the stack.
    ax.legend(handles=handles[::-1] + mark_handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9,
              frameon=False)
    return fig


def predicted_vs_measured(cases, unit=None, title=None, ax=None, peaks=None):
    """For each case (a configuration), its predicted and its measured bytes per category as two stacked bars side
    by side: predicted hatched on the left, measured solid on the right, each with its total on top.

    ``cases``: {case label: (predicted {category: bytes}, measured {category: bytes})}. ``peaks``: {case label:
    (predicted peak, measured peak)} in bytes, either None where there is none: drawn as a black mark across the
    bar it belongs to. ``unit``: None picks the unit that suits the largest value (``_base._units``).
    """
    labels = list(cases)
    malformed = [label for label in labels if not (isinstance(cases[label], (tuple, list)) and len(cases[label]) == 2)]
    if malformed:
        raise ValueError(f"cases {malformed}: give each case a pair (predicted, measured) of {{category: bytes}}.")
    peaks = peaks or {}
    unknown = set(peaks) - set(labels)
    if unknown:
        raise ValueError(f"peaks has labels {sorted(unknown)} that are not in cases {labels}.")
    categories = list(dict.fromkeys(c for label in labels for side in cases[label] for c in side))
    largest = max([*(sum(side.values()) for label in labels for side in cases[label]),
                   *(p for pair in peaks.values() for p in pair if p is not None)], default=0)
    unit, scale = _units(unit, largest)

    fig, ax = _figure_and_axes(ax, (max(5.0, 1.3 * len(labels) + 3.0), 4.4))
    centres = np.arange(len(labels), dtype=float)
    tops, marked, marks = [], [], []
    for side, (offset, style) in enumerate(((-0.21, {"hatch": "///", "alpha": 0.75}), (0.21, {}))):
        x = centres + offset
        handles, bottom = _stacked(ax, x, [cases[label][side] for label in labels], categories, scale, 0.38, **style)
        tops.append(bottom)
        for xi, total in zip(x, bottom):
            ax.annotate(_plain(total), (xi, total), xytext=(0, 3), textcoords="offset points", ha="center",
                        va="bottom", fontsize=7)
        for xi, label in zip(x, labels):
            peak = (peaks.get(label) or (None, None))[side]
            if peak is not None:
                marks.append(peak / scale)
                marked.append(ax.hlines(peak / scale, xi - 0.2, xi + 0.2, colors="black", linewidth=2.5, zorder=3,
                                        linestyles="solid" if side else (0, (2, 1)),
                                        label="allocator peak (measured)" if side else "peak (predicted)"))
    ax.set_ylim(0, (max([*np.concatenate(tops), *marks], default=0) or 1) * 1.15)
    ax.set_xticks(centres, [textwrap.fill(label, 16) for label in labels])  # long labels on lines of their own
    _plain_ticks(ax.yaxis)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title or "predicted (hatched, left) and measured (solid, right), by category", fontsize=10)
    sides = [Patch(facecolor="0.85", edgecolor="0.3", hatch="///", label="predicted"),
             Patch(facecolor="0.6", edgecolor="white", label="measured")]
    kinds = list({m.get_label(): m for m in marked}.values())
    ax.legend(handles=handles[::-1] + sides + kinds, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9,
              frameon=False)
    return fig


def ratio_curve(sizes, measured, ideal, xlabel="domain ranks N", ylabel="bytes per rank / bytes on 1 rank", ax=None,
                ideal_label="ideal"):
    """Measured against ideal ratios over mesh sizes, each measured point labelled with its value."""
    if not len(sizes) == len(measured) == len(ideal):
        raise ValueError(f"sizes, measured and ideal differ in length: {len(sizes)}, {len(measured)}, {len(ideal)}.")
    fig, ax = _figure_and_axes(ax, (5.5, 4.0))
    ax.plot(sizes, ideal, "s--", color="black", markersize=5, label=ideal_label)
    ax.plot(sizes, measured, "o-", color="tab:purple", markersize=6, label="measured")
    for i, (size, value) in enumerate(zip(sizes, measured)):
        # Up and to the right, clear of a falling curve; the last point centred so it stays inside the axes.
        last = i == len(sizes) - 1
        ax.annotate(f"{value:.3f}", (size, value), xytext=(0, 8) if last else (5, 6), textcoords="offset points",
                    ha="center" if last else "left", fontsize=8)
    if len(sizes) and min(sizes) > 0 and max(sizes) / min(sizes) >= 8:
        ax.set_xscale("log", base=2)  # 1, 2, 4, 8, ... ranks: even spacing instead of a crowded left edge
        ax.minorticks_off()
    ax.set_xticks(list(sizes), [str(s) for s in sizes])
    _plain_ticks(ax.yaxis)
    top = max([*measured, *ideal], default=1)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return fig


def wrapper_memory(memory: list[dict], ddp_size: int, peaks: list[dict] | None = None, title: str | None = None):
    """Notebook 05's bars, a bar per rank and wrapper: the state (parameters, gradients, Adam state, FSDP2's padding)
    with a mark at DDP's bytes / ddp (DDP replicates, FSDP2 divides); the same with one sample's activations; and,
    given ``peaks``, the allocator's measured peak per GPU with the byte model marked. ``memory``: each rank's
    {"DDP"/"FSDP2": {category: bytes}}; ``peaks``: each rank's {wrapper: {"peak above start": bytes}}."""
    full = {f"{name}\nrank {r}": parts for r, setups in enumerate(memory) for name, parts in setups.items()}
    state = {label: {k: v for k, v in parts.items() if k != "activations"} for label, parts in full.items()}
    ideal = {f"{name}\nrank {r}": sum(state[f"DDP\nrank {r}"].values()) / (1 if name == "DDP" else ddp_size)
             for r, setups in enumerate(memory) for name in setups}
    fig = _new_figure(figsize=(min(14, max(7, 1.3 * len(state))), 10 if peaks else 7))
    axes = fig.subplots(3 if peaks else 2, 1, squeeze=False)[:, 0]
    memory_bars(state, ideal=ideal, unit="KiB", ax=axes[0],
                title="byte model: parameters + gradients + Adam state (+ FSDP2 padding); mark: DDP's / ddp")
    memory_bars(full, unit="KiB", ax=axes[1], title="byte model: ... and the activations of one sample")
    if peaks:
        measured = {f"{name}\nrank {r}": {"CUDA peak above start (measured)": p[name]["peak above start"]}
                    for r, p in enumerate(peaks) for name in memory[r]}
        memory_bars(measured, ideal={label: sum(parts.values()) for label, parts in full.items()}, unit="KiB",
                    ax=axes[2], title="measured on the GPUs: CUDA allocator peak during training, per GPU (mark: the "
                                      "byte model above)")
    if title:
        fig.suptitle(title, fontsize=11 if peaks else 9)
    return fig


def loading_bars(loading: list[dict], fields: int):
    """Notebook 12's bars: per domain size N and way of loading, what the largest rank held after loading one sample's
    ``fields`` bytes and how much more at the host's peak during the load, with a mark at 1/N of the fields.
    ``loading``: each rank's {N: {way: measurement}} (``sl.measure.measure_loading``)."""
    bars, ideal, peaks = {}, {}, {}
    for d, ways in loading[0].items():
        for way in ways:
            top, label = largest_rank([per_rank[d][way] for per_rank in loading]), f"N={d}\n{way}"
            bars[label] = {"held after": top["held after"],
                           "more at the peak": max(0, (top["host peak"] or top["held after"]) - top["held after"])}
            ideal[label] = fields // d
            if top["host peak"] is not None:
                peaks[label] = top["host peak"]
    return memory_bars(bars, ideal=ideal, peaks=peaks, ideal_label="1/N of the fields",
                       peak_label="host peak (measured)",
                       title="one sample's two fields loaded, the largest rank: held after, and the host peak during "
                             "the load")
