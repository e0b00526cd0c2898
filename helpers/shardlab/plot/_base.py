"""What every figure module shares: the colours of ranks, groups and categories, byte units, and figures kept out of
pyplot's registry."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt

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


def _units(unit: str) -> int:
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r}: choose one of {list(_UNITS)}.")
    return _UNITS[unit]

