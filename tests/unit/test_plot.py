"""The plot layer on synthetic inputs: what each figure draws, checked through its artists."""

import matplotlib

matplotlib.use("Agg")

import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.collections import LineCollection

from shardlab import mesh, plot


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _boxes(ax, prefix):
    """Patches the plot layer tagged with a gid starting with prefix, by gid."""
    return {p.get_gid(): p for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_rank_colour_repeats_after_ten_ranks_and_is_distinct_within_them():
    assert plot.rank_colour(2) == plot.rank_colour(12) != plot.rank_colour(3)
    assert len({plot.rank_colour(r) for r in range(10)}) == 10


def test_rank_grid_one_labelled_box_per_rank_rows_share_colour():
    fig = plot.rank_grid([[0, 1], [2, 3]], colour_by="domain")
    ax = fig.axes[0]
    boxes = _boxes(ax, "rank ")
    assert sorted(boxes) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    texts = _texts(ax)
    for r, coord in enumerate(["(0, 0)", "(0, 1)", "(1, 0)", "(1, 1)"]):
        assert f"rank {r}" in texts and coord in texts
    colour = {r: boxes[f"rank {r}"].get_facecolor() for r in range(4)}
    assert colour[0] == colour[1] and colour[2] == colour[3]  # a domain group is one row
    assert colour[0] != colour[2]
    assert "domain group" in ax.get_title()
    assert ax.get_xlabel() == "domain →" and ax.get_ylabel() == "ddp ↓"


def test_rank_grid_ddp_colours_columns_and_row_0_is_on_top():
    fig = plot.rank_grid([[0, 1, 2], [3, 4, 5]], colour_by="ddp")
    ax = fig.axes[0]
    boxes = _boxes(ax, "rank ")
    colour = {r: boxes[f"rank {r}"].get_facecolor() for r in range(6)}
    assert colour[0] == colour[3] and colour[1] == colour[4] and colour[2] == colour[5]
    assert len({colour[0], colour[1], colour[2]}) == 3
    assert boxes["rank 0"].get_y() < boxes["rank 3"].get_y() and ax.yaxis_inverted()
    assert "ddp group" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "ddp group 0: ranks 0, 3"


def test_rank_grid_accepts_a_flat_list_and_a_given_axes():
    fig, ax = plt.subplots()
    assert plot.rank_grid([0, 1, 2, 3], ax=ax) is fig
    boxes = _boxes(ax, "rank ")
    assert len(boxes) == 4 and len({b.get_facecolor() for b in boxes.values()}) == 1
    with pytest.raises(ValueError, match="colour_by"):
        plot.rank_grid([0, 1], colour_by="tensor")


def test_halo_rows_draws_the_plan_in_sender_colours():
    fig = plot.halo_rows(16, 4, kernel_sizes=(3, 5))
    assert len(fig.axes) == 2
    titles = ["3×3 kernel: 1 halo row per side", "5×5 kernel: 2 halo rows per side"]
    assert [ax.get_title() for ax in fig.axes] == titles
    for ax, k in zip(fig.axes, (3, 5)):
        plan = mesh.halo_plan(16, 4, k)
        owned = _boxes(ax, "owned ")
        for p in plan:
            box = owned[f"owned {p['rank']}"]
            assert (box.get_y(), box.get_y() + box.get_height()) == p["owned"]
            assert box.get_facecolor() == plot.rank_colour(p["rank"])
        halos = _boxes(ax, "halo ")
        assert len(halos) == 2 * (4 - 1)  # one per interior side
        for p in plan[1:]:
            box = halos[f"halo {p['rank']}<-{p['rank'] - 1}"]
            assert (box.get_y(), box.get_y() + box.get_height()) == p["from_above"]
            assert box.get_hatch() and box.get_edgecolor() == plot.rank_colour(p["rank"] - 1)


def test_shard_map_one_patch_per_non_empty_shard():
    field = np.random.default_rng(0).standard_normal((65, 64))
    bounds = [(0, 0, 22), (1, 22, 44), (2, 44, 65)]
    shapes = {0: (22, 64), 1: (22, 64), 2: (21, 64)}
    fig = plot.shard_map(field, bounds, local_shapes=shapes)
    ax = fig.axes[0]
    boxes = _boxes(ax, "rank ")
    assert sorted(boxes) == ["rank 0", "rank 1", "rank 2"]
    for rank, start, stop in bounds:
        box = boxes[f"rank {rank}"]
        assert (box.get_y() + 0.5, box.get_y() + 0.5 + box.get_height()) == (start, stop)
        assert (box.get_x(), box.get_width()) == (-0.5, 64)
        assert box.get_edgecolor() == plot.rank_colour(rank)
    assert "rank 2 · local (21, 64)" in _texts(ax)
    assert ax.images[0].get_array().shape == (65, 64)


def test_shard_map_columns_and_an_empty_shard():
    field = np.zeros((8, 3))
    bounds = mesh.shard_bounds(3, 4)  # rank 3 gets no column
    fig = plot.shard_map(field, bounds, dim=1)
    ax = fig.axes[0]
    boxes = _boxes(ax, "rank ")
    assert sorted(boxes) == ["rank 0", "rank 1", "rank 2"]
    assert (boxes["rank 1"].get_x() + 0.5, boxes["rank 1"].get_width(), boxes["rank 1"].get_height()) == (1, 1, 8)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "rank 3: empty (columns 3:3)" in legend
    with pytest.raises(ValueError, match="rank 0"):
        plot.shard_map(field, [(0, 0, 9)], dim=1)


def test_memory_bars_stack_to_the_totals_with_ideal_marks():
    kib = 1024
    per_rank = {
        "rank 0": {"parameters": 1 * kib, "gradients": 1 * kib, "optimizer": 2 * kib, "activations": 4 * kib},
        "rank 1": {"parameters": 1 * kib, "gradients": 1 * kib, "optimizer": 2 * kib, "activations": 6 * kib},
        "rank 2": {"parameters": 1 * kib, "activations": 2 * kib, "buffers": 3 * kib},
    }
    fig = plot.memory_bars(per_rank, ideal={"rank 0": 8 * kib, "rank 1": 8 * kib, "rank 2": 8 * kib})
    ax = fig.axes[0]
    bars = ax.patches
    assert len(bars) == 3 * 5  # 3 labels × 5 categories (missing ones stacked as 0)
    totals = {}
    for bar in bars:
        x = round(bar.get_x() + bar.get_width() / 2)
        totals[x] = totals.get(x, 0) + bar.get_height()
    assert totals == {0: 8, 1: 10, 2: 6}  # in KiB
    # Same category, same colour on every bar; categories in order of first appearance.
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["buffers", "activations", "optimizer", "gradients", "parameters", "ideal"]
    assert bars[0].get_facecolor() == bars[1].get_facecolor() != bars[3].get_facecolor()
    marks = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(marks) == 1
    assert [seg[0][1] for seg in marks[0].get_segments()] == [8, 8, 8]
    assert ax.get_ylabel() == "bytes (KiB)"
    assert {"8", "10", "6"} <= set(_texts(ax))


def test_memory_bars_units_and_no_ideal():
    fig = plot.memory_bars({"a": {"x": 3 * 1024**2}}, unit="MiB")
    ax = fig.axes[0]
    assert ax.patches[0].get_height() == 3 and not ax.collections
    with pytest.raises(ValueError, match="unit"):
        plot.memory_bars({"a": {"x": 1}}, unit="kb")


def test_predicted_vs_measured_pairs_bars_per_case_predicted_hatched():
    kib = 1024
    cases = {
        "baseline": ({"params": 2 * kib, "activations": 6 * kib}, {"params": 2 * kib, "activations": 5 * kib}),
        "checkpointing": ({"params": 2 * kib, "activations": 1 * kib},
                          {"params": 2 * kib, "activations": 1 * kib, "buffers": 1 * kib}),
    }
    fig = plot.predicted_vs_measured(cases, peaks={"checkpointing": (4 * kib, None)})
    ax = fig.axes[0]
    tops, hatched = {}, {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 2)
        tops[x] = tops.get(x, 0) + bar.get_height()
        hatched[x] = bool(bar.get_hatch())
    # Two bars per case, centred around the case's tick: predicted left and hatched, measured right and solid.
    assert tops == {-0.21: 8, 0.21: 7, 0.79: 3, 1.21: 4}
    assert hatched == {-0.21: True, 0.21: False, 0.79: True, 1.21: False}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "checkpointing"]
    assert {"8", "7", "3", "4"} <= set(_texts(ax))
    # One colour per category on both sides; "buffers", measured only, still stacks (as 0 where absent).
    colours = {}
    for container in ax.containers:
        colours.setdefault(container.get_label(), set()).update(p.get_facecolor()[:3] for p in container.patches)
    assert sorted(colours) == ["activations", "buffers", "params"] and all(len(c) == 1 for c in colours.values())
    assert len(set.union(*colours.values())) == 3
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["buffers", "activations", "params", "predicted", "measured", "peak (predicted)"]
    (mark,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert mark.get_segments()[0][0][1] == 4  # the predicted peak, across the predicted bar of its case
    assert mark.get_segments()[0][0][0] == pytest.approx(0.59)
    assert mark.get_linestyle()[0][1] is not None  # dashed (an allocator's measured peak is drawn solid)
    both = plot.predicted_vs_measured(cases, peaks={"baseline": (9 * kib, 8 * kib)}).axes[0]
    styles = {c.get_label(): c.get_linestyle()[0][1] for c in both.collections}
    assert styles["peak (predicted)"] is not None and styles["allocator peak (measured)"] is None
    long = plot.predicted_vs_measured({"FSDP2 + param_dtype bf16": cases["baseline"]}).axes[0]
    assert [t.get_text() for t in long.get_xticklabels()] == ["FSDP2 +\nparam_dtype bf16"]


def test_predicted_vs_measured_refuses_malformed_cases():
    with pytest.raises(ValueError, match="pair"):
        plot.predicted_vs_measured({"a": {"params": 1}})
    with pytest.raises(ValueError, match="not in cases"):
        plot.predicted_vs_measured({"a": ({"x": 1}, {"x": 1})}, peaks={"b": (1, 1)})
    with pytest.raises(ValueError, match="unit"):
        plot.predicted_vs_measured({"a": ({"x": 1}, {"x": 1})}, unit="kb")


def test_ratio_curve_draws_measured_and_ideal():
    sizes, measured, ideal = [1, 2, 4], [1.0, 0.5312, 0.2884], [1.0, 0.5, 0.25]
    fig = plot.ratio_curve(sizes, measured, ideal)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"measured", "ideal"}
    assert list(lines["measured"].get_xdata()) == sizes and list(lines["measured"].get_ydata()) == measured
    assert list(lines["ideal"].get_ydata()) == ideal
    assert list(ax.get_xticks()) == sizes
    assert [t.get_text() for t in ax.texts] == ["1.000", "0.531", "0.288"]
    with pytest.raises(ValueError, match="length"):
        plot.ratio_curve([1, 2], [1.0], [1.0, 0.5])


def test_memory_bars_draw_measured_peaks_beside_the_bars():
    mib = 1024**2
    fig = plot.memory_bars({"rank 0": {"state": 10 * mib, "activations": 3 * mib}, "rank 1": {"state": 10 * mib}},
                           peaks={"rank 0": 20 * mib, "rank 1": 12 * mib}, peak_label="CPU allocator's peak")
    ax = fig.axes[0]
    (mark,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert [seg[0][1] for seg in mark.get_segments()] == [20, 12]  # in MiB, the unit the figure picked
    assert {"13", "10", "20", "12"} <= set(_texts(ax))
    assert "CPU allocator's peak" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="peaks"):
        plot.memory_bars({"a": {"x": 1}}, peaks={"b": 1})


UNIT_BYTES = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
PLAIN_NUMBER = re.compile(r"^−?\d{1,3}(,\d{3})*(\.\d+)?$")  # matplotlib writes minus signs as U+2212


def _number_labels(ax) -> list[str]:
    """The y tick labels and the numbers written on the axes, as drawn."""
    ax.figure.canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert ticks and not ax.yaxis.get_offset_text().get_text()  # no "1e6" or "+1.3e4" above the axis
    return ticks + [t.get_text() for t in ax.texts]


@pytest.mark.parametrize("scale, unit, total, peak", [(1, "B", "1", "1.39"), (1024, "KiB", "1", "1.39"),
                                                      (13_170 * 1024, "MiB", "12.9", "17.9"),
                                                      (3 * 1024**3, "GiB", "3", "4.17")])
def test_every_memory_figure_labels_plain_numbers_in_one_named_unit(scale, unit, total, peak):
    """The capstone's bars once read "1.317e+04" on a KiB axis: each figure picks one unit that suits its largest
    value and writes plain numbers in it, on the bars, the marks and the ticks."""
    per_rank = {f"rank {r}": {"state": 0.61 * scale, "activations": (0.39 + 0.07 * r) * scale} for r in range(3)}
    peaks = {label: 1.3 * sum(parts.values()) for label, parts in per_rank.items()}
    cases = {"DDP": (per_rank["rank 0"], per_rank["rank 1"]), "FSDP2": (per_rank["rank 1"], per_rank["rank 2"])}
    figures = [plot.memory_bars(per_rank, peaks=peaks),
               plot.memory_bars(per_rank, ideal=peaks, capacity=2 * UNIT_BYTES[unit]),
               plot.predicted_vs_measured(cases, peaks={"DDP": (peaks["rank 0"], peaks["rank 1"])})]
    for fig in figures:
        ax = fig.axes[0]
        assert ax.get_ylabel() == f"bytes ({unit})"
        labels = _number_labels(ax)
        assert all(PLAIN_NUMBER.match(label) for label in labels), labels
        assert total in labels  # rank 0's total, in that unit
    assert peak in _texts(figures[0].axes[0])  # rank 1's peak beside its mark: 1.3 x 1.07 x scale
    capacity = [t.get_text() for t in figures[1].axes[0].get_legend().get_texts() if "GPU memory" in t.get_text()]
    assert capacity == [f"GPU memory: 2 {unit}"]


def test_byte_figures_keep_a_unit_they_are_given_and_label_it_plainly():
    fig = plot.memory_bars({"r": {"a": 13_486 * 1024}}, unit="KiB", capacity=40_000 * 1024)
    labels = _number_labels(fig.axes[0])
    assert fig.axes[0].get_ylabel() == "bytes (KiB)" and "13,486" in labels
    assert all(PLAIN_NUMBER.match(label) for label in labels), labels
    big = plot.memory_bars({"r": {"a": 3e7}}, unit="B")  # where matplotlib would have written 1e7 above the axis
    assert all(PLAIN_NUMBER.match(label) for label in _number_labels(big.axes[0]))


def test_ratio_curve_labels_plain_ratios():
    fig = plot.ratio_curve([1, 2, 4, 8], [1.0, 0.5312, 0.2884, 0.00012], [1.0, 0.5, 0.25, 0.125])
    ax = fig.axes[0]
    labels = _number_labels(ax)
    assert all(PLAIN_NUMBER.match(label) for label in labels), labels
    assert "/" in ax.get_ylabel()  # a ratio of bytes, named as one


def test_figures_render_and_use_the_given_axes():
    fig, axes = plt.subplots(1, 2)
    assert plot.halo_rows(8, 2, kernel_sizes=(3, 5), ax=axes) is fig
    assert plot.memory_bars({"r": {"a": 1}}, ax=axes[0]) is fig
    assert plot.predicted_vs_measured({"c": ({"a": 1}, {"a": 1})}, ax=axes[0]) is fig
    for f in (fig, plot.rank_grid([[0, 1], [2, 3]]), plot.shard_map(np.ones((4, 4)), mesh.shard_bounds(4, 2))):
        f.canvas.draw()  # the whole artist tree renders under Agg
    assert axes[0].patches and axes[1].patches  # both panels drew into the given axes


def _dashboard(**kwargs):
    yy, xx = np.mgrid[0:64, 0:64] / 63
    truth = np.sin(np.pi * yy) * np.sin(np.pi * xx)
    prediction = truth + 0.01 * np.cos(9 * xx)
    losses = [0.5 / (step + 1) for step in range(10)]
    held_out = {step: {"loss": 0.6 / (step + 1), "relative L2": 1.2 / (step + 1)} for step in (0, 5, 10)}
    return truth, prediction, plot.training_dashboard(truth, prediction, losses, held_out, **kwargs)


def test_training_dashboard_shows_the_held_out_sample_and_the_curves():
    truth, prediction, fig = _dashboard(row_split=32, checkpoint_at=8, bound=0.25, title="run")
    fields = [ax for ax in fig.axes if ax.images and ax.get_title()]
    assert [ax.get_title().split(" (")[0] for ax in fields] == ["pressure, truth", "pressure, prediction",
                                                                 "prediction − truth"]
    np.testing.assert_array_equal(fields[0].images[0].get_array(), truth)
    np.testing.assert_array_equal(fields[2].images[0].get_array(), prediction - truth)
    # truth and prediction on one colour scale, the error on a symmetric one
    assert fields[0].images[0].get_clim() == fields[1].images[0].get_clim() == (truth.min(), truth.max())
    low, high = fields[2].images[0].get_clim()
    assert -low == high > 0
    expected = np.linalg.norm(prediction - truth) / np.linalg.norm(truth)
    assert f"relative L2 {expected:.3f}" in fields[2].get_title()
    assert all(any(line.get_gid() == "row split" for line in ax.get_lines()) for ax in fields)

    loss_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "mean squared error")
    curves = {line.get_label(): line for line in loss_ax.get_lines() if not line.get_label().startswith("_")}
    assert list(curves["training loss (each step)"].get_xdata()) == list(range(1, 11))
    assert list(curves["held-out loss (never trained on)"].get_xdata()) == [0, 5, 10]
    error_ax = next(ax for ax in fig.axes if ax.get_ylabel() == "relative L2 error")
    held = next(line for line in error_ax.get_lines() if list(line.get_xdata()) == [0, 5, 10])
    assert list(held.get_ydata()) == [1.2 / (step + 1) for step in (0, 5, 10)]
    assert any(list(line.get_ydata()) == [0.25, 0.25] for line in error_ax.get_lines())  # the bound
    assert all(any(line.get_gid() == "checkpoint" for line in ax.get_lines()) for ax in (loss_ax, error_ax))


def test_training_dashboard_colour_bars_sit_beside_their_panels():
    _, _, fig = _dashboard()
    fig.canvas.draw()
    fields = [ax for ax in fig.axes if ax.images]
    assert len(fields) == 3
    for panel in fields:
        box = panel.get_window_extent()
        (bar,) = [child.get_window_extent() for child in panel.child_axes]  # the colour bar, one per panel
        gap = (bar.x0 - box.x1) / fig.bbox.width
        assert 0 <= gap < 0.02, gap  # right of the panel, touching distance
        assert bar.y0 == pytest.approx(box.y0, abs=1) and bar.y1 == pytest.approx(box.y1, abs=1)  # as tall


def test_training_dashboard_refuses_fields_of_other_shapes():
    with pytest.raises(ValueError, match="one shape"):
        plot.training_dashboard(np.zeros((4, 4)), np.zeros((4, 5)), [1.0], {0: {"loss": 1.0, "relative L2": 1.0}})


def test_the_lessons_memory_figures_draw_every_rank_and_way():
    memory = [{"DDP": {"parameters": 400, "padding": 0, "activations": 100},
               "FSDP2": {"parameters": 200, "padding": 24, "activations": 100}}] * 2
    state, full = plot.wrapper_memory(memory, 2, title="two ranks").axes[:2]
    assert [t.get_text() for t in state.get_xticklabels()] == ["DDP\nrank 0", "FSDP2\nrank 0", "DDP\nrank 1",
                                                               "FSDP2\nrank 1"]
    marks = [seg for c in state.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert sorted({round(seg[0][1] * 1024) for seg in marks}) == [200, 400]  # KiB: DDP's state, and DDP's / ddp
    peaks = [{"DDP": {"peak above start": 600}, "FSDP2": {"peak above start": 400}}] * 2
    assert len(plot.wrapper_memory(memory, 2, peaks).axes) == 3  # the measured peaks beside the byte model
    measured = {"held after": 50, "host peak": 80, "file bytes": 50, "device peak": None}
    loading = plot.loading_bars([{2: {"slab": measured, "scatter_tensor": measured}}] * 2, 100).axes[0]
    assert [t.get_text() for t in loading.get_xticklabels()] == ["N=2\nslab", "N=2\nscatter_tensor"]


def test_points_of_ranks_joins_each_ranks_points_in_rank_order():
    per_rank = [{"coords": np.full((3, 2), 0.25), "value": np.zeros(3)},
                {"coords": np.full((2, 2), 0.75), "value": np.ones(2)}]
    fig = plot.points_of_ranks(per_rank, {"value": "value"}, title="two ranks")
    held = fig.axes[1]
    assert [t.get_text() for t in held.get_legend().get_texts()] == ["rank 0: 3", "rank 1: 2"]
    assert fig.axes[0].collections[0].get_array().tolist() == [0, 0, 0, 1, 1]
