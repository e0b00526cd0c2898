"""The mesh as a grid of ranks, a field's shards, the halo rows a convolution exchanges, and a field tiled over
two domain axes with its halo strips."""

from __future__ import annotations

import numpy as np
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ..mesh import halo_bytes_tile, halo_plan, shard_bounds, tile_bounds
from ._base import _LABEL_BOX, _figure_and_axes, _group_colour, _new_figure, rank_colour

_GROUP_MEANING = {
    "domain": "ranks that shard one sample",
    "ddp": "same shard position, different samples",
}


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


def _tile_halo_pieces(tile, by_coords, halo):
    """(gid, sender, (x, y, w, h) in field coordinates) of the halo a tile receives: k//2 rows from its H
    neighbours, then k//2 columns of its W neighbours' H-padded tiles, whose ends (the corners) hold the diagonal
    rank's values, or the zero padding at the field's edge (not drawn)."""
    (i, j), (r0, r1), (c0, c1) = tile["coords"], tile["rows"], tile["cols"]
    rank, pieces = tile["rank"], []
    for di, y in ((-1, r0 - halo), (1, r1)):
        if (i + di, j) in by_coords:
            pieces.append((f"halo {rank}<-{by_coords[i + di, j]}", by_coords[i + di, j], (c0, y, c1 - c0, halo)))
    for dj, x in ((-1, c0 - halo), (1, c1)):
        if (i, j + dj) not in by_coords:
            continue
        via = by_coords[i, j + dj]
        pieces.append((f"halo {rank}<-{via}", via, (x, r0, halo, r1 - r0)))
        for di, y in ((-1, r0 - halo), (1, r1)):
            if (i + di, j + dj) in by_coords:
                sender = by_coords[i + di, j + dj]
                pieces.append((f"corner {rank}<-{sender} via {via}", sender, (x, y, halo, halo)))
    return pieces


def tile_map(height, width, tiles, kernel_size=3, ax=None):
    """The field tiled ``tiles`` = (along H, along W), the tiles drawn apart: each rank's tile in its colour, and
    around it the halo strips it receives for one convolution, hatched in the colour of the rank they come from."""
    bounds = tile_bounds(height, width, tiles)
    sends = halo_bytes_tile(height, width, 1, tiles, kernel_size, 1)  # also refuses tiles thinner than the halo
    halo = kernel_size // 2
    gap = max(2 * halo + 1, round(0.08 * max(height, width)))
    by_coords = {tile["coords"]: tile["rank"] for tile in bounds}
    fig, ax = _figure_and_axes(ax, (min(2.2 * tiles[1] + 2.5, 12.0), min(2.2 * tiles[0] + 1.8, 9.0)))
    for tile, sent in zip(bounds, sends):
        (i, j), (r0, r1), (c0, c1) = tile["coords"], tile["rows"], tile["cols"]
        dx, dy = j * gap, i * gap  # drawn apart: the halo strips sit in the gaps
        colour = rank_colour(tile["rank"])
        ax.add_patch(Rectangle((c0 + dx, r0 + dy), c1 - c0, r1 - r0, facecolor=(*colour[:3], 0.35), edgecolor=colour,
                               linewidth=2, gid=f"rank {tile['rank']}"))
        ax.text((c0 + c1) / 2 + dx, (r0 + r1) / 2 + dy, f"rank {tile['rank']} ({i}, {j})\n{r1 - r0}×{c1 - c0}\n"
                f"sends {sent} values/channel", ha="center", va="center", fontsize=8, bbox=_LABEL_BOX)
        for gid, sender, (x, y, w, h) in _tile_halo_pieces(tile, by_coords, halo):
            tint = rank_colour(sender)
            ax.add_patch(Rectangle((x + dx, y + dy), w, h, facecolor=(*tint[:3], 0.3), edgecolor=tint, hatch="////",
                                   linewidth=0.8, gid=gid))
    ax.set_xlim(-gap, width + tiles[1] * gap)
    ax.set_ylim(height + tiles[0] * gap, -gap)  # row 0 at the top, as the tensor is printed
    ax.set_aspect("equal" if 0.25 <= height / width <= 4 else "auto")
    # Ticks at the tiles' edges, labelled with the field's own indices: the gaps are not rows or columns.
    for axis, key, index in ((ax.xaxis, "cols", 1), (ax.yaxis, "rows", 0)):
        edges = {(tile[key][0] + tile["coords"][index] * gap): tile[key][0] for tile in bounds}
        edges |= {(tile[key][1] + tile["coords"][index] * gap): tile[key][1] for tile in bounds}
        axis.set_ticks(sorted(edges), [str(edges[at]) for at in sorted(edges)], fontsize=8)
    ax.set_xlabel("W (columns; tiles drawn apart)")
    ax.set_ylabel("H (rows)")
    ax.set_title(f"{height}×{width} field tiled {tiles[0]}×{tiles[1]}, {kernel_size}×{kernel_size} kernel: {halo} "
                 f"halo row{'' if halo == 1 else 's'}/column{'' if halo == 1 else 's'} per side", fontsize=10)
    handles = [Patch(facecolor="0.6", edgecolor="black", label="tile the rank owns"),
               Patch(facecolor="0.9", edgecolor="0.3", hatch="////",
                     label="halo received (sender's colour; corners come via the W neighbour)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=1, fontsize=8, frameon=False)
    return fig
