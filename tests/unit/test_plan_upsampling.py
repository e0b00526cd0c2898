"""The planner on a model whose output is a multiple of its input (an upsampling model: ``physicsnemo.models.srrn``
doubles each spatial dim), without ranks: the target, each rank's target rows and the activations after the
upsampling scale with the output; a model that shrinks the field is refused with what the planner handles; and the
port, given a target such a model fits on no layout of, says the smallest that would. Against a step measured on
ranks: tests/multirank/test_plan_cases.py."""

import sys
import textwrap

import pytest
import torch

from shardlab import plan, port
from shardlab.plan.trace import trace_rank


def upsampler(scale: int = 2, width: int = 4):
    """A convolution, a sub-pixel upsampling by ``scale`` (PixelShuffle) and a convolution at the output's size."""
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Conv2d(1, width * scale**2, 3, padding=1), torch.nn.PixelShuffle(scale),
                                   torch.nn.Conv2d(width, 1, 3, padding=1))


def test_the_target_is_the_output_k_times_the_field_along_each_dim():
    planner = plan.Planner(upsampler(2), (1, 1, 64, 48))
    assert planner.target_shape == (1, 1, 128, 96)
    field, target = planner.full_fields()
    assert (field, target) == (64 * 48 * 4, 128 * 96 * 4)
    # scatter loading: the larger of the two whole fields is in flight on every rank of the domain group
    assert {r.transient for r in planner.plan(1, 2).rows} == {target}


def test_each_rank_holds_k_times_its_input_rows_of_the_target():
    """The batch a rank's step starts from: its input rows and k times as many target rows, where torch.chunk of the
    2N rows would cut otherwise (5 rows over 2 ranks: 3 and 2 input rows, so 6 and 4 target rows, not 5 and 5)."""
    sizes = []

    class Recorder(torch.nn.Module):
        def forward(self, x):
            sizes.append(x.shape[2])
            return x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)

    targets = []
    from shardlab.plan import trace

    step = trace.training_step

    def watched(model, optimizer, batch, *args, **kwargs):
        def seen():
            x, y = batch()
            targets.append(y.shape[2])
            return x, y
        return step(model, optimizer, seen, *args, **kwargs)

    trace.training_step = watched
    try:
        model = torch.nn.Sequential(Recorder(), torch.nn.Conv2d(1, 1, 1)).to("meta")
        for loading in ("scatter", "slab"):
            for position in (0, 1):
                trace_rank(model, (1, 1, 5, 4), (1, 1, 10, 8), torch.float32, 2, 2, position, loading=loading)
    finally:
        trace.training_step = step
    assert sizes == [3, 2, 3, 2] and targets == [6, 4, 6, 4]


def test_activations_after_the_upsampling_scale_with_the_output():
    """Doubling the field's rows doubles what a rank saves; the same model that upsamples by 4 saves more than by 2
    at the same input (its last convolution runs on 16 times the field, not 4)."""
    def saved(scale, rows, domain=1):
        return plan.Planner(upsampler(scale, width=2), (1, 1, rows, 32)).plan(1, domain).largest().activations

    assert saved(2, 128) == pytest.approx(2 * saved(2, 64), rel=0.02)
    assert saved(4, 64) > 3 * saved(2, 64)
    # split over 2 ranks: about half each, plus the halo rows (at the output's size after the upsampling)
    assert 0.5 < saved(2, 128, domain=2) / saved(2, 128) < 0.6


def test_a_model_that_shrinks_the_field_is_refused_with_what_the_planner_handles():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3, padding=1), torch.nn.AvgPool2d(2))
    with pytest.raises(ValueError, match=r"maps \(1, 1, 64, 64\) to \(1, 1, 32, 32\).*keeps each spatial size or "
                                         r"multiplies it"):
        plan.Planner(model, (1, 1, 64, 64))


def test_a_target_an_upsampling_model_fits_on_no_layout_of_says_the_smallest_that_would(tmp_path, monkeypatch,
                                                                                        capsys):
    """Refused before any rank starts (the meta replay plans first), nothing written; the domain it names is the
    smallest the planner fits: the one below it does not."""
    (tmp_path / "upsampling.py").write_text(textwrap.dedent("""
        import torch

        def build():
            return torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.PixelShuffle(2),
                                       torch.nn.Conv2d(4, 1, 3, padding=1))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    try:
        code = port.main(["upsampling:build", "--input", "input=1x1xNxN", "--shard", "input:2", "--field",
                          "16384x16384", "--gpus", "2", "--gpu", "8GiB", "--out", str(out)])
        from upsampling import build
    finally:
        sys.modules.pop("upsampling", None)
    line = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in line and "fits on no layout of 2 GPUs of 8.0 GiB" in line, line
    smallest = int(line.split("smallest that would is a domain of ")[1].split()[0])
    planner = plan.Planner(build(), (1, 1, 16384, 16384))
    below = max(d for d in planner.valid_domains() if d < smallest)
    assert planner.fits(8 * plan.GiB, 1, smallest) and not planner.fits(8 * plan.GiB, 1, below)
    assert not out.exists()
