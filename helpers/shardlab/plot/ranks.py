"""Every rank's steps, side by side (notebook 14): a timeline with a row per rank, the time each rank spent on each
kind of use, step time against the number of ranks with its ideal line, and the allocator's total across a step.

Drawn from the plain dicts ``sl.measure.timeline.summarize`` returns on each rank (µs of the ranks' common clock).
"""

from __future__ import annotations

from ._base import _LABEL_BOX, _category_colour, _new_figure, _plain_ticks, _units, rank_colour

# The kinds of use, as sl.measure.timeline names them (plot may not import measure: they share a layer).
KINDS = ("halo exchange", "all-reduce, ShardTensor (domain)", "all-reduce, DDP (ddp)", "reduce-scatter / all-gather",
         "scatter / broadcast", "compute", "idle")
_COLOURS = {kind: _category_colour(i) for i, kind in enumerate(KINDS[:5])} | {"compute": (0.35, 0.35, 0.35, 1.0),
                                                                               "idle": (0.92, 0.92, 0.92, 1.0)}


def _start(summaries) -> float:
    return min(s["steps"][0][0] for s in summaries)


def timeline(summaries, title: str | None = None):
    """A row per rank, its profiled steps in time (ms from the first step's start on any rank), each moment coloured
    by what the rank did: a kind of collective in flight, compute, or idle. Step boundaries are thin black ticks."""
    summaries = sorted(summaries, key=lambda s: s["rank"])
    t0 = _start(summaries)
    fig = _new_figure(figsize=(10, 0.55 * len(summaries) + 1.6))
    ax = fig.add_subplot()
    for row, s in enumerate(summaries):
        for kind in KINDS:
            bars = [((a - t0) / 1e3, (b - a) / 1e3) for a, b in s["spans"].get(kind, [])]
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=_COLOURS[kind], gid=f"rank {s['rank']} {kind}")
        for a, b in s["steps"]:
            ax.vlines([(a - t0) / 1e3, (b - t0) / 1e3], row - 0.45, row + 0.45, colors="black", linewidth=1)
    ax.set_yticks(range(len(summaries)), [f"rank {s['rank']}" for s in summaries])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first step began")
    _plain_ticks(ax.xaxis)
    handles = [ax.barh(0, 0, color=_COLOURS[k], label=k) for k in KINDS]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    ax.set_title(title or f"{len(summaries)} ranks, {len(summaries[0]['steps'])} steps", fontsize=10)
    return fig


def time_by_rank(summaries, title: str | None = None):
    """Each rank's profiled steps as one stacked bar of seconds per kind of use: the rank the others wait for is
    the one with the most compute and the least time in collectives."""
    summaries = sorted(summaries, key=lambda s: s["rank"])
    fig = _new_figure(figsize=(8, 0.45 * len(summaries) + 1.6))
    ax = fig.add_subplot()
    for row, s in enumerate(summaries):
        left = 0.0
        for kind in KINDS:
            seconds = sum(b - a for a, b in s["spans"].get(kind, [])) / 1e6
            ax.barh(row, seconds, left=left, color=_COLOURS[kind], label=kind if row == 0 else None,
                    gid=f"rank {s['rank']} {kind}")
            left += seconds
    ax.set_yticks(range(len(summaries)), [f"rank {s['rank']}" for s in summaries])
    ax.invert_yaxis()
    ax.set_xlabel("seconds over the profiled steps")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize=8, frameon=False)
    ax.set_title(title or "where each rank's step time went", fontsize=10)
    return fig


def scaling(strong: list[dict], weak: list[dict], title: str | None = None):
    """Step time against the number of domain ranks N, measured, beside the ideal: strong scaling (one field, so
    ideal = t(1) / N) and weak scaling (the field grows with N, so ideal = t(1)). Rows: ``timeline.across_ranks``'s
    {"N", "step_s", "ideal_s", "communication"}."""
    fig = _new_figure(figsize=(10, 3.6))
    for i, (rows, name) in enumerate(((strong, "strong: one field"), (weak, "weak: the field grows with N"))):
        ax = fig.add_subplot(1, 2, i + 1)
        n = [r["N"] for r in rows]
        ax.plot(n, [1e3 * r["step_s"] for r in rows], "o-", color=rank_colour(0), label="measured")
        ax.plot(n, [1e3 * r["ideal_s"] for r in rows], "--", color="grey", label="ideal")
        for r in rows:
            ax.annotate(f"{round(100 * r['communication'])} % comm.", (r["N"], 1e3 * r["step_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 6), bbox=_LABEL_BOX)
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(k) for k in n])
        ax.set_xlabel("domain ranks N")
        ax.set_ylabel("ms per step")
        ax.set_ylim(0, 1.2e3 * max(r["step_s"] for r in rows))  # room for the labels above the highest point
        _plain_ticks(ax.yaxis)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def memory_over_step(summaries, title: str | None = None, unit: str | None = None):
    """The allocator's total on each rank across the profiled steps, the step's phases shaded (from rank 0's), and
    each rank's peak marked with the phase it fell in."""
    summaries = sorted(summaries, key=lambda s: s["rank"])
    if not any(s["memory"] for s in summaries):
        raise ValueError("no memory events: profile with sl.measure.timeline.profile_steps(..., memory=True)")
    t0 = _start(summaries)
    unit, per = _units(unit, max(b for s in summaries for _, b in s["memory"]))
    fig = _new_figure(figsize=(10, 3.8))
    ax = fig.add_subplot()
    for i, (name, a, b) in enumerate(summaries[0]["phases"]):
        ax.axvspan((a - t0) / 1e3, (b - t0) / 1e3, color=_category_colour(i % 8), alpha=0.18, lw=0)
        ax.text((a + b - 2 * t0) / 2e3, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=7, rotation=0 if (b - a) > 0.08 * (summaries[0]["steps"][-1][1] - t0) else 90)
    for s in summaries:
        times, values = zip(*s["memory"])
        ax.step([(t - t0) / 1e3 for t in times], [v / per for v in values], where="post", color=rank_colour(s["rank"]),
                linewidth=1, label=f"rank {s['rank']}")
        when, peak = max(s["memory"], key=lambda m: m[1])
        ax.plot([(when - t0) / 1e3], [peak / per], "v", color=rank_colour(s["rank"]), gid=f"peak rank {s['rank']}")
    ax.set_xlabel("ms since the first step began")
    ax.set_ylabel(f"allocated, {unit}")
    _plain_ticks(ax.yaxis)
    ax.legend(fontsize=8, ncol=min(len(summaries), 8), loc="lower right")
    ax.set_title(title or "the allocator's total across the step, per rank (▼: each rank's peak)", fontsize=10,
                 pad=18)
    return fig
