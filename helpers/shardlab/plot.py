"""Figures of meshes, shards, halos and memory, drawn from plain lists and arrays pulled back from the ranks.

Introduced in ``notebooks/02_device_mesh.ipynb``.
"""

from __future__ import annotations

import textwrap

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from .mesh import halo_plan, shard_bounds

_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_GROUP_MEANING = {
    "domain": "ranks that shard one sample",
    "ddp": "same shard position, different samples",
}
_LABEL_BOX = {"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0}


def rank_colour(rank: int) -> tuple:
    """The RGBA colour of a rank, the same in every figure (tab10, repeating after rank 9)."""
    return matplotlib.colormaps["tab10"](rank % 10)


def _group_colour(group: int) -> tuple:
    # Pastel, and not the rank palette, so a group is never mistaken for the rank of the same index.
    return matplotlib.colormaps["Pastel1"](group % 9)


def _category_colour(index: int) -> tuple:
    return matplotlib.colormaps["Set2"](index % 8)


def _new_figure(**kwargs):
    kwargs.setdefault("layout", "constrained")
    fig = plt.figure(**kwargs)
    # Out of pyplot's registry: a notebook shows the returned figure once, not twice, and none pile up.
    plt.close(fig)
    return fig


def _figure_and_axes(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = _new_figure(figsize=figsize)
    return fig, fig.add_subplot()


def rank_grid(mesh_ranks, axis_names=("ddp", "domain"), colour_by="domain", ax=None):
    """The mesh as a grid of boxes, one per rank with its coordinate, coloured by ddp or domain group."""
    grid = np.asarray(mesh_ranks, dtype=int)
    if grid.ndim == 1:
        grid = grid.reshape(1, -1)
    if grid.ndim != 2 or grid.size == 0:
        raise ValueError(f"mesh_ranks must be a non-empty 1-D or 2-D list of ranks, got shape {grid.shape}.")
    row_axis, col_axis = axis_names
    if colour_by not in axis_names:
        raise ValueError(f"colour_by={colour_by!r}: choose one of {tuple(axis_names)}.")
    n_rows, n_cols = grid.shape
    fig, ax = _figure_and_axes(ax, (1.6 * n_cols + 3.2, 1.1 * n_rows + 1.6))

    # A group along the column axis (domain) is one row; a group along the row axis (ddp) is one column.
    by_row = colour_by == col_axis
    legend = []
    for g in range(n_rows if by_row else n_cols):
        members = grid[g, :] if by_row else grid[:, g]
        legend.append(Patch(facecolor=_group_colour(g), edgecolor="black",
                            label=f"{colour_by} group {g}: ranks {', '.join(map(str, members))}"))
    for i in range(n_rows):
        for j in range(n_cols):
            rank = int(grid[i, j])
            box = Rectangle((j + 0.05, i + 0.05), 0.9, 0.9, facecolor=_group_colour(i if by_row else j),
                            edgecolor="black", linewidth=1.2, gid=f"rank {rank}")
            ax.add_patch(box)
            ax.text(j + 0.5, i + 0.42, f"rank {rank}", ha="center", va="center", fontsize=11, weight="bold")
            ax.text(j + 0.5, i + 0.68, f"({i}, {j})", ha="center", va="center", fontsize=9)

    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)  # row 0 at the top, as the mesh is printed
    ax.set_aspect("equal")
    ax.set_xticks(np.arange(n_cols) + 0.5, [str(j) for j in range(n_cols)])
    ax.set_yticks(np.arange(n_rows) + 0.5, [str(i) for i in range(n_rows)])
    ax.tick_params(length=0)
    ax.set_xlabel(f"{col_axis} →")
    ax.set_ylabel(f"{row_axis} ↓")
    for spine in ax.spines.values():
        spine.set_visible(False)
    meaning = _GROUP_MEANING.get(colour_by)
    ax.set_title(f"colour = {colour_by} group" + (f" ({meaning})" if meaning else ""), fontsize=10)
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=9, frameon=False)
    return fig


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def shard_map(field, bounds, dim=0, local_shapes=None, title=None, ax=None):
    """A 2-D field with each rank's slice along ``dim`` outlined and tinted in the rank's colour."""
    field = np.asarray(field)
    if field.ndim != 2:
        raise ValueError(f"field must be 2-D, got shape {field.shape}.")
    if dim not in (0, 1):
        raise ValueError(f"dim={dim!r}: use 0 (rows, H) or 1 (columns, W).")
    height, width = field.shape
    extent = field.shape[dim]
    for rank, start, stop in bounds:
        if not 0 <= start <= stop <= extent:
            raise ValueError(f"rank {rank}: bounds ({start}, {stop}) do not fit in 0..{extent} along dim {dim}.")

    panel = 5.0
    fig, ax = _figure_and_axes(ax, (panel + 1.4, min(max(panel * height / width, 3.0), 8.0) + 1.4))
    # A very flat or very tall field (a few rows of a tiny example) would shrink to a sliver at equal aspect.
    aspect = "equal" if 0.25 <= height / width <= 4 else "auto"
    image = ax.imshow(field, cmap="viridis", origin="upper", interpolation="nearest", aspect=aspect)
    fig.colorbar(image, ax=ax, shrink=0.8)

    axis_word = "rows" if dim == 0 else "columns"
    legend = []
    for rank, start, stop in bounds:
        colour = rank_colour(rank)
        if start == stop:
            # Nothing to draw, but an empty shard is a real state (more ranks than rows) worth seeing.
            legend.append(Patch(facecolor="none", edgecolor=colour, linestyle="--",
                                label=f"rank {rank}: empty ({axis_word} {start}:{stop})"))
            continue
        if dim == 0:
            xy, w, h = (-0.5, start - 0.5), width, stop - start
            where = {"x": 0.5, "y": (start + stop - 1) / 2, "ha": "left", "va": "center", "rotation": 0}
        else:
            xy, w, h = (start - 0.5, -0.5), stop - start, height
            where = {"x": (start + stop - 1) / 2, "y": 0.5, "ha": "center", "va": "top", "rotation": 90}
        # One patch per shard: a translucent fill with an opaque outline in the same colour.
        ax.add_patch(Rectangle(xy, w, h, facecolor=(*colour[:3], 0.25), edgecolor=colour, linewidth=2.5,
                               gid=f"rank {rank}"))
        label = f"rank {rank}"
        if local_shapes is not None and rank in local_shapes:
            label += f" · local {_shape_text(local_shapes[rank])}"
        ax.text(s=label, fontsize=8, bbox=_LABEL_BOX, **where)
        legend.append(Patch(facecolor=(*colour[:3], 0.25), edgecolor=colour, linewidth=2,
                            label=f"rank {rank}: {axis_word} {start}:{stop}"))

    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(height - 0.5, -0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # pixel indices, never 0.5
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("W (columns)")
    ax.set_ylabel("H (rows)")
    ax.set_title(title or f"{height}×{width} field over {len(bounds)} ranks, split along {'H' if dim == 0 else 'W'}",
                 fontsize=10)
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncols=len(legend) if len(legend) <= 3 else 2, fontsize=8, frameon=False)
    return fig


def halo_rows(height, n_ranks, kernel_sizes=(3, 5), ax=None):
    """One panel per kernel size: each rank's owned rows (solid) and the halo rows it receives (hatched)."""
    kernel_sizes = list(kernel_sizes)
    plans = [halo_plan(height, n_ranks, k) for k in kernel_sizes]
    if ax is None:
        fig = _new_figure(figsize=(len(kernel_sizes) * max(3.0, 0.8 * n_ranks + 1.4),
                                   min(max(3.5, 0.08 * height + 2.5), 9.0)))
        axes = list(np.atleast_1d(fig.subplots(1, len(kernel_sizes), sharey=True)))
    else:
        axes = list(np.atleast_1d(ax).ravel())
        if len(axes) != len(kernel_sizes):
            raise ValueError(f"got {len(axes)} axes for {len(kernel_sizes)} kernel sizes: pass one per kernel size.")
        fig = axes[0].figure

    edges = sorted({0, *(stop for _, _, stop in shard_bounds(height, n_ranks))})
    for panel, k, plan in zip(axes, kernel_sizes, plans):
        for row in plan:
            rank, (start, stop) = row["rank"], row["owned"]
            panel.add_patch(Rectangle((rank - 0.4, start), 0.8, stop - start, facecolor=rank_colour(rank),
                                      edgecolor="black", linewidth=0.8, gid=f"owned {rank}"))
            if stop > start:
                panel.text(rank, (start + stop) / 2, f"{start}:{stop}", ha="center", va="center", fontsize=8,
                           bbox=_LABEL_BOX)
            for key, sender in (("from_above", rank - 1), ("from_below", rank + 1)):
                if row[key] is None:
                    continue
                a, b = row[key]
                colour = rank_colour(sender)
                # The hatch takes the edge colour: the sender's colour marks where the rows come from.
                panel.add_patch(Rectangle((rank - 0.4, a), 0.8, b - a, facecolor=(*colour[:3], 0.3),
                                          edgecolor=colour, hatch="////", linewidth=1, gid=f"halo {rank}<-{sender}"))
        for edge in edges:
            panel.axhline(edge, color="grey", linewidth=0.6, linestyle=":", zorder=0)
        halo = k // 2
        panel.set_title(f"{k}×{k} kernel: {halo} halo row{'' if halo == 1 else 's'} per side", fontsize=10)
        panel.set_xlim(-0.6, n_ranks - 0.4)
        panel.set_ylim(height, 0)  # row 0 at the top, as the tensor is printed
        panel.set_xticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)], fontsize=8)
        panel.set_yticks(edges)
        panel.tick_params(axis="x", length=0)
    axes[0].set_ylabel("row of H (global index)")

    handles = [Patch(facecolor="0.6", edgecolor="black", label="rows the rank owns"),
               Patch(facecolor="0.9", edgecolor="0.3", hatch="////", label="halo rows received (sender's colour)")]
    if ax is None:
        fig.suptitle(f"H = {height} rows over {n_ranks} ranks", fontsize=11)
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    else:
        axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    return fig


def _units(unit: str) -> int:
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r}: choose one of {list(_UNITS)}.")
    return _UNITS[unit]


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


def memory_bars(per_rank, ideal=None, unit="KiB", title=None, ax=None, capacity=None, capacity_label="GPU memory"):
    """Stacked bars of bytes per category for each rank, with the total on top and an optional ideal marker.

    ``capacity`` (bytes) draws a dashed line across the bars: what each device can hold.
    """
    scale = _units(unit)
    labels = list(per_rank)
    categories = list(dict.fromkeys(c for label in labels for c in per_rank[label]))  # first appearance
    ideal = ideal or {}
    unknown = set(ideal) - set(labels)
    if unknown:
        raise ValueError(f"ideal has labels {sorted(unknown)} that are not in per_rank {labels}.")

    fig, ax = _figure_and_axes(ax, (max(4.0, 0.9 * len(labels) + 2.8), 4.2))
    x = np.arange(len(labels))
    handles, bottom = _stacked(ax, x, [per_rank[label] for label in labels], categories, scale, 0.6)

    marks = np.array([ideal[label] / scale if label in ideal else np.nan for label in labels])
    has_mark = ~np.isnan(marks)
    ideal_handles = []
    if has_mark.any():
        ideal_handles.append(ax.hlines(marks[has_mark], x[has_mark] - 0.4, x[has_mark] + 0.4, colors="black",
                                       linewidth=2.5, label="ideal", zorder=3))
    # The total sits above the ideal mark too, so the mark never strikes through the number.
    for xi, total, mark in zip(x, bottom, marks):
        top = total if np.isnan(mark) else max(total, mark)
        ax.annotate(f"{total:.4g}", (xi, top), xytext=(0, 4), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8)

    capacity_handles = []
    if capacity is not None:
        capacity_handles.append(ax.axhline(capacity / scale, color="tab:red", linestyle="--", linewidth=1.5, zorder=4,
                                           label=f"{capacity_label}: {capacity / scale:.4g} {unit}"))
    limits = [bottom, marks] + ([[capacity / scale]] if capacity is not None else [])
    peak = np.nanmax(np.concatenate(limits)) if len(labels) else 0
    ax.set_ylim(0, (peak or 1) * 1.15)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 6 else 0)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title or "memory per rank, by category", fontsize=10)
    # Reversed, so the legend reads top to bottom like the stack.
    ax.legend(handles=handles[::-1] + ideal_handles + capacity_handles, loc="upper left",
              bbox_to_anchor=(1.02, 1), fontsize=9, frameon=False)
    return fig


def predicted_vs_measured(cases, unit="KiB", title=None, ax=None, peaks=None):
    """For each case (a configuration), its predicted and its measured bytes per category as two stacked bars side
    by side: predicted hatched on the left, measured solid on the right, each with its total on top.

    ``cases``: {case label: (predicted {category: bytes}, measured {category: bytes})}. ``peaks``: {case label:
    (predicted peak, measured peak)} in bytes, either None where there is none: drawn as a black mark across the
    bar it belongs to.
    """
    scale = _units(unit)
    labels = list(cases)
    malformed = [label for label in labels if not (isinstance(cases[label], (tuple, list)) and len(cases[label]) == 2)]
    if malformed:
        raise ValueError(f"cases {malformed}: give each case a pair (predicted, measured) of {{category: bytes}}.")
    peaks = peaks or {}
    unknown = set(peaks) - set(labels)
    if unknown:
        raise ValueError(f"peaks has labels {sorted(unknown)} that are not in cases {labels}.")
    categories = list(dict.fromkeys(c for label in labels for side in cases[label] for c in side))

    fig, ax = _figure_and_axes(ax, (max(5.0, 1.3 * len(labels) + 3.0), 4.4))
    centres = np.arange(len(labels), dtype=float)
    tops, marked, marks = [], [], []
    for side, (offset, style) in enumerate(((-0.21, {"hatch": "///", "alpha": 0.75}), (0.21, {}))):
        x = centres + offset
        handles, bottom = _stacked(ax, x, [cases[label][side] for label in labels], categories, scale, 0.38, **style)
        tops.append(bottom)
        for xi, total in zip(x, bottom):
            ax.annotate(f"{total:.4g}", (xi, total), xytext=(0, 3), textcoords="offset points", ha="center",
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
    top = max([*measured, *ideal], default=1)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return fig


def _field_panel(ax, field, title, row_split, **imshow):
    """A 2-D field with its colour bar right beside it (in the panel's own coordinates, so it stays there whatever
    the layout does to the panel), and the boundary between the two ranks' rows."""
    image = ax.imshow(field, origin="upper", interpolation="nearest", **imshow)
    ax.figure.colorbar(image, cax=ax.inset_axes([1.03, 0.0, 0.05, 1.0]))
    if row_split is not None:
        ax.axhline(row_split - 0.5, color="black", linestyle="--", linewidth=1.2, gid="row split")
        ax.text(1, row_split - 2, "rank 0 rows ↑", fontsize=7, va="bottom", bbox=_LABEL_BOX)
        ax.text(1, row_split + 1, "rank 1 rows ↓", fontsize=7, va="top", bbox=_LABEL_BOX)
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    return image


def training_dashboard(truth, prediction, losses, held_out, row_split=None, checkpoint_at=None, bound=None,
                       title=None):
    """A held-out sample's truth, prediction and error above the run's curves: the training loss of every step,
    and the held-out loss and relative L2 error where they were measured.

    ``losses``: the global loss of steps 1..N. ``held_out``: {step: {"loss": ..., "relative L2": ...}}, step 0
    the untrained model. ``row_split``: the first row of the second domain rank (a dashed line across the
    fields). ``checkpoint_at``: a vertical line after that step. ``bound``: a dashed line at that error.
    """
    truth, prediction = np.asarray(truth), np.asarray(prediction)
    if truth.ndim != 2 or truth.shape != prediction.shape:
        raise ValueError(f"truth and prediction must be 2-D fields of one shape, got {truth.shape} and "
                         f"{prediction.shape}.")
    if not held_out or not losses:
        raise ValueError("losses and held_out must each hold at least one measurement.")
    fig = _new_figure(figsize=(13.0, 7.8), layout=None)
    grid = fig.add_gridspec(2, 3, height_ratios=(1.0, 0.85), wspace=0.45, hspace=0.3, left=0.08, right=0.94,
                            top=0.9, bottom=0.08)
    scale = {"vmin": float(truth.min()), "vmax": float(truth.max()), "cmap": "viridis"}
    error = prediction - truth
    relative = np.linalg.norm(error) / np.linalg.norm(truth)
    reach = float(np.abs(error).max()) or 1.0
    _field_panel(fig.add_subplot(grid[0, 0]), truth, "pressure, truth", row_split, **scale)
    _field_panel(fig.add_subplot(grid[0, 1]), prediction, "pressure, prediction", row_split, **scale)
    _field_panel(fig.add_subplot(grid[0, 2]), error, f"prediction − truth (relative L2 {relative:.3f})",
                 row_split, cmap="RdBu_r", vmin=-reach, vmax=reach)

    steps = sorted(held_out)
    loss_ax = fig.add_subplot(grid[1, :2])
    loss_ax.semilogy(range(1, len(losses) + 1), losses, color="tab:blue", linewidth=1,
                     label="training loss (each step)")
    loss_ax.semilogy(steps, [held_out[s]["loss"] for s in steps], "o-", color="tab:orange",
                     label="held-out loss (never trained on)")
    error_ax = fig.add_subplot(grid[1, 2])
    error_ax.plot(steps, [held_out[s]["relative L2"] for s in steps], "o-", color="tab:orange")
    last = steps[-1]
    error_ax.annotate(f"{held_out[last]['relative L2']:.3f}", (last, held_out[last]["relative L2"]),
                      xytext=(-4, 8), textcoords="offset points", ha="right", fontsize=8)
    if bound is not None:
        error_ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label=f"asserted bound {bound}")
        error_ax.legend(fontsize=8, frameon=False)
    for ax in (loss_ax, error_ax):
        if checkpoint_at is not None:
            ax.axvline(checkpoint_at + 0.5, color="grey", linewidth=0.8, gid="checkpoint")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    loss_ax.set_ylabel("mean squared error")
    loss_ax.legend(fontsize=8)
    loss_ax.set_title("loss" + (" (grey line: checkpoint and restart)" if checkpoint_at is not None else ""),
                      fontsize=10)
    error_ax.set_ylim(0, max(held_out[s]["relative L2"] for s in steps) * 1.1)
    error_ax.set_ylabel("relative L2 error")
    error_ax.set_title("held-out error", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
