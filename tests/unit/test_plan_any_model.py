"""The planner for any model (``sl.plan.Planner(case, size)``), without ranks: what it does with the ranks'
measurements (given here as a stored calibration), its layouts, its verdict and its messages. Whether the
measurements extrapolate to within 10 % of a real step is ``tests/multirank/test_plan_cases.py``."""

import json
import math

import pytest

from shardlab import model_cases, plan
from shardlab.plan import cli as plan_cli
from shardlab.plan.cases import METHOD, CasePlanner

PER_POINT, FIXED = 600, 400_000  # the synthetic step: bytes above the state per point of a rank, and the rest


def synthetic(case, ranks=2, kept_per_point=0):
    """A calibration as ``calibrate`` returns it, of a step whose excess over the state is FIXED + PER_POINT × points
    (at the sizes a real one measures)."""
    from shardlab.plan.inputs import calibration_sizes

    sizes = list(calibration_sizes(case, ranks))
    rows = []
    for size in sizes:
        at = CasePlanner(case, size, ranks=ranks, calibration={"sizes": sizes})
        state = at._state_for("ddp", 1, 0, ranks, plan.planner.NO_LEVERS)
        points = [at._elements(at.inputs, ranks, r) // 5 for r in range(ranks)]  # fx 3 + embedding 2 per point
        rows.append([{"peak": state.device_bytes + FIXED + PER_POINT * p + kept_per_point * size,
                      "saved": PER_POINT // 2 * p, "kept": kept_per_point * size} for p in points])
    return {"case": case.name, "sizes": sizes, "device": "cpu", "ranks": rows}


def test_a_case_is_planned_at_ten_million_points_from_two_measured_sizes():
    planner = plan.Planner(model_cases.transolver, 10**7, calibration=synthetic(model_cases.transolver))
    assert isinstance(planner, CasePlanner)  # the same class users call for conv models
    result = planner.plan(ddp=1, domain=8)
    model = model_cases.transolver.model(8)
    params = sum(p.numel() for p in model.parameters()) * 4
    steps = 4 * len(list(model.parameters()))  # Adam's float32 step count per parameter
    for row in result.rows:
        assert row.method == METHOD and result.method == METHOD
        assert row.params == params and row.grads == params and row.optimizer == 2 * params + steps
        points = 10**7 // 8
        assert row.activations == PER_POINT // 2 * points
        # the excess over the state, read off the line at this rank's points: nothing of the target was allocated
        state = planner._state_for("ddp", 1, 0, 8, plan.planner.NO_LEVERS)
        assert row.peak == state.device_bytes + FIXED + PER_POINT * points
    assert "method" in str(result.table()) and METHOD in str(result.table())
    assert result.as_json()["method"] == METHOD and any("measured" in note for note in result.notes)


def test_layouts_change_the_state_and_the_points_per_rank():
    planner = plan.Planner(model_cases.transolver, 10**6, calibration=synthetic(model_cases.transolver))
    one, four = planner.largest(1, 1), planner.largest(1, 4)
    assert four.activations == pytest.approx(one.activations / 4, rel=1e-6)
    ddp, fsdp = planner.largest(4, 2, "ddp"), planner.largest(4, 2, "fsdp2")
    assert fsdp.params < ddp.params and fsdp.optimizer < ddp.optimizer and ddp.buffers == ddp.grads
    assert planner.with_loading("slab").largest(1, 4).transient == 0 < four.transient


def test_slab_loading_drops_the_whole_input_a_shard_kept():
    scatter = plan.Planner(model_cases.transolver, 10**6,
                           calibration=synthetic(model_cases.transolver, kept_per_point=20))
    slab = scatter.with_loading("slab")
    assert scatter.largest(1, 4).peak - slab.largest(1, 4).peak > 0


def test_spatial_parameters_are_split_on_domain_under_fsdp2():
    """DiT's pos_embed follows the field: spatial + FSDP2 holds 1/domain of it per rank, DDP all of it."""
    planner = CasePlanner(model_cases.dit, 64, calibration={"sizes": [16, 32]})
    whole = next(p for n, p in planner.named if n.endswith("pos_embed"))
    planner._wrapper, planner._domain = "fsdp2", 4
    assert planner._spatial_shape("tokenizer.pos_embed", whole.shape)[1] == whole.shape[1] // 4
    planner._wrapper = "ddp"
    assert planner._spatial_shape("tokenizer.pos_embed", whole.shape) == whole.shape


def test_the_verdict_names_the_smallest_domain_that_fits():
    planner = plan.Planner(model_cases.transolver, 3 * 10**6, calibration=synthetic(model_cases.transolver))
    need_one = planner.largest(1, 1).total
    capacity = need_one // 4 + plan.GiB  # a quarter of one rank's need, and the headroom's fixed GiB
    v = plan.verdict(planner, planner.plan(1, 1), capacity)
    assert not v.fits and v.smallest_domain and f"smallest domain size that fits is {v.smallest_domain}" in v.text
    assert planner.fits(capacity, 1, v.smallest_domain) and not planner.fits(capacity, 1, v.smallest_domain - 1)


def test_a_target_that_fits_no_layout_says_the_smallest_that_would():
    planner = plan.Planner(model_cases.transolver, 10**5, calibration=synthetic(model_cases.transolver))
    v = plan.verdict(planner, planner.plan(1, 2), 10**6)
    line = v.text
    assert not v.fits and "\n" not in line and "the smallest layout that would" in line
    smallest = planner.max_domain()
    assert f"{smallest} domain ranks on GPUs of" in line


def test_a_module_that_is_not_a_field_model_is_sent_to_its_case():
    from shardlab import models

    with pytest.raises(ValueError, match=r"sl.plan.Planner\(sl.model_cases.transolver"):
        plan.Planner(models.transolver(), (1, 1, 64, 64))


def test_a_model_that_cannot_run_says_where_it_stopped():
    measured = {"case": "FLARE", "sizes": [256, 512], "device": "cpu", "ranks": [],
                "error": "NotImplementedError: Could not run 'aten::_scaled_dot_product_efficient_attention'"}
    planner = plan.Planner(model_cases.flare, 10**6, calibration=measured)
    with pytest.raises(ValueError, match="cannot be planned from measurements.*efficient_attention"):
        planner.plan(1, 2)


def test_checkpointing_a_case_is_refused_with_what_to_do():
    planner = plan.Planner(model_cases.transolver, 10**6, calibration=synthetic(model_cases.transolver))
    with pytest.raises(ValueError, match="its own checkpointing"):
        planner.plan(1, 2, levers=plan.planner.Levers(checkpoint=True))


def test_command_line_plans_a_case_from_a_stored_calibration(tmp_path, capsys):
    stored = tmp_path / "calibration.json"
    stored.write_text(json.dumps(synthetic(model_cases.transolver)))
    code = plan_cli.main(["--case", "shardlab.model_cases:transolver", "--size", "10000000", "--domain", "8",
                      "--gpu", "H100", "--calibration", str(stored)])
    out = capsys.readouterr().out
    assert code == 0 and METHOD in out and "verdict on" in out
    assert plan_cli.main(["--case", "shardlab.model_cases:nothing", "--size", "10"]) == 2
    assert "give a parity case as module:name" in capsys.readouterr().err
    assert plan_cli.main(["--case", "shardlab.model_cases:transolver", "--calibration", str(stored)]) == 2
    assert "--case needs --size" in capsys.readouterr().err


def test_the_target_is_never_allocated():
    """A 10⁷-point case at float32 is 191 MiB of inputs: built on the meta device only."""
    planner = CasePlanner(model_cases.transolver, 10**7, calibration=synthetic(model_cases.transolver))
    assert planner.inputs["fx"][0] == (1, 10**7, 3)
    assert all(p.device.type == "meta" for p in planner.params)
    assert math.prod(planner.inputs["fx"][0]) == 3 * 10**7 and planner.full_fields()[0] == 5 * 10**7 * 4
