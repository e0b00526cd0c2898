"""The capstone's dashboard: a held-out sample, the prediction and its error beside the training curves; a point
cloud drawn by value and by the rank that held each point, given whole or as each rank's part (notebook 13)."""

from __future__ import annotations

import numpy as np

from ._base import _LABEL_BOX, _new_figure, rank_colour


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

    _curves(fig.add_subplot(grid[1, :2]), fig.add_subplot(grid[1, 2]), losses, held_out, bound, checkpoint_at)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _curves(loss_ax, error_ax, losses, held_out, bound=None, checkpoint_at=None) -> None:
    """The training loss of every step and the held-out loss (left), the held-out relative L2 error (right)."""
    steps = sorted(held_out)
    loss_ax.semilogy(range(1, len(losses) + 1), losses, color="tab:blue", linewidth=1,
                     label="training loss (each step)")
    loss_ax.semilogy(steps, [held_out[s]["loss"] for s in steps], "o-", color="tab:orange",
                     label="held-out loss (never trained on)")
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


def training_curves(losses, held_out, bound=None, title=None):
    """The curves of ``training_dashboard`` alone, for a run whose samples are not fields (notebook 13's points)."""
    if not held_out or not losses:
        raise ValueError("losses and held_out must each hold at least one measurement.")
    fig = _new_figure(figsize=(11.0, 3.4))
    loss_ax, error_ax = fig.subplots(1, 2, width_ratios=(2, 1))
    _curves(loss_ax, error_ax, losses, held_out, bound)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def points_by_rank(coords, ranks, panels: dict | None = None, title: str | None = None):
    """A point cloud drawn on its coordinates: one panel per entry of ``panels`` ({title: a value per point},
    coloured by value on a shared scale), then the rank that held each point (``ranks``, one per point)."""
    coords, ranks = np.asarray(coords, dtype=float).reshape(-1, 2), np.asarray(ranks).reshape(-1)
    panels = {name: np.asarray(values, dtype=float).reshape(-1) for name, values in (panels or {}).items()}
    fig = _new_figure(figsize=(3.4 * (len(panels) + 1), 3.4))
    axes = fig.subplots(1, len(panels) + 1, squeeze=False)[0]
    size = max(2.0, 3000 / len(coords))
    if panels:
        low, high = min(v.min() for v in panels.values()), max(v.max() for v in panels.values())
        for ax, (name, values) in zip(axes, panels.items()):
            shown = ax.scatter(coords[:, 0], coords[:, 1], c=values, s=size, cmap="viridis", vmin=low, vmax=high)
            ax.set_title(name)
        fig.colorbar(shown, ax=axes[: len(panels)].tolist(), shrink=0.8)
    held = axes[-1]
    for rank in np.unique(ranks):
        mine = ranks == rank
        held.scatter(coords[mine, 0], coords[mine, 1], s=size, color=rank_colour(int(rank)),
                     label=f"rank {rank}: {mine.sum()}")
    held.set_title("held by")
    held.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=2)
    for ax in axes:
        ax.set_aspect("equal")
        ax.set(xlim=(0, 1), ylim=(0, 1), xticks=[], yticks=[])
    if title:
        fig.suptitle(title)
    return fig


def points_of_ranks(per_rank: list[dict], panels: dict | None = None, title: str | None = None):
    """``points_by_rank`` of a cloud pulled from the ranks: ``per_rank`` holds each rank's dict, its points'
    ``"coords"`` and a value per point under each key that ``panels`` ({panel title: key}) names."""
    coords = np.concatenate([np.asarray(mine["coords"], dtype=float).reshape(-1, 2) for mine in per_rank])
    ranks = np.concatenate([[r] * len(mine["coords"]) for r, mine in enumerate(per_rank)])
    values = {name: np.concatenate([np.asarray(mine[key]).reshape(-1) for mine in per_rank])
              for name, key in (panels or {}).items()}
    return points_by_rank(coords, ranks, values, title)
