"""What every figure module shares: the colours of ranks, groups and categories, byte units and plain-number labels,
and figures kept out of pyplot's registry."""

from __future__ import annotations

import math

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
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


def _units(unit: str | None, largest_bytes: float) -> tuple[str, int]:
    """(unit, bytes per unit) of a memory figure: ``unit`` if given, else the largest unit in which the figure's largest
    value is at least 1, so that every label reads as a number from 1 to 1023 of one unit."""
    if unit is None:
        unit = next((u for u in reversed(_UNITS) if largest_bytes >= _UNITS[u]), "B")
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r}: choose one of {list(_UNITS)}, or None for the one that suits the figure.")
    return unit, _UNITS[unit]


def _plain(value: float) -> str:
    """Digits a reader takes in at a glance, never scientific notation ("1.317e+04"): three significant figures, all
    the digits of a whole number from 100 up, no trailing zeros."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}" if value else "0"
    text = f"{value:,.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _plain_ticks(axis) -> None:
    # matplotlib's default switches to an offset or to powers of ten on large or small values.
    axis.set_major_formatter(FuncFormatter(lambda value, _: _plain(value)))

