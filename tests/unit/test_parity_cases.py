"""``sl.parity`` without ranks: a bad case gets one line that says what to change (inputs the model does not take, a
split dim that is not spatial, an op ShardTensor has no handler for), the error arithmetic, and docs/models.md is
what ``make models`` writes for today's registry (every model has its rows; the stamp matches). The harness on ranks:
tests/multirank/test_parity.py."""

import re
from pathlib import Path

import pytest
import torch

from shardlab import measure, model_cases, parity
from shardlab.measure.audit import Audit
from shardlab.tools import models as models_tool

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


class PointModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.register_buffer("pos_embed", torch.zeros(1, 8, 2))

    def forward(self, fx, embedding=None):
        return self.linear(fx)


def case(**changes):
    base = dict(name="toy", build=PointModel, inputs=lambda n: {"fx": torch.randn(2, n, 3)}, shard={"fx": 1})
    return parity.Case(**(base | changes))


def test_a_good_case_has_no_problems():
    assert parity.problems(case()) == []
    assert parity.problems(case(strategy="fsdp_spatial", spatial={"pos_embed": 1})) == []


def test_an_input_the_model_does_not_take_is_named_with_what_it_takes():
    [line] = parity.problems(case(inputs=lambda n: {"fx": torch.randn(1, n, 3), "coords": torch.randn(1, n, 2)}))
    assert line == ("toy: PointModel.forward takes (fx, embedding), not 'coords': rename it in Case.inputs to the "
                    "argument it is, or drop it.")


def test_a_split_dim_that_does_not_follow_the_size_is_refused_with_the_dim_that_does():
    [batch] = parity.problems(case(shard={"fx": 0}))
    assert "dim 0 of 'fx' is 2 long at size 256 and at 512" in batch and batch.endswith(
        "split dim 1, the one that grows with the size.")
    [channels] = parity.problems(case(shard={"fx": 2}))
    assert "dim 2 of 'fx' is 3 long" in channels and "(a batch or channel dim)" in channels
    [missing] = parity.problems(case(shard={"x": 1}))
    assert "shard names 'x', which Case.inputs does not give (it gives fx)" in missing


def test_a_strategy_or_spatial_name_that_does_not_exist_is_named():
    lines = parity.problems(case(strategy="fsdp", spatial={"rope_cos": 0}))
    assert lines == ["toy: strategy 'fsdp': use one of ddp, fsdp_spatial.",
                     "toy: spatial names 'rope_cos', which PointModel has no parameter or buffer of: name one of those "
                     "whose shape follows the field."]


def test_an_unpatched_op_is_named_with_how_to_register_a_handler():
    rows = [{"module": "spec.0", "forward": {}, "backward": {}, "unpatched": ["torch.fft.rfft2", "aten.roll.default"],
             "unpatched moves": {"torch.fft.rfft2": ["all_gather"], "aten.roll.default": ["all_to_all"]},
             "replicated outputs": True, "promoted": 0, "note": ""}]
    fft, roll = parity.unpatched_lines(Audit(rows))
    assert fft.startswith("spec.0: torch.fft.rfft2 has no ShardTensor handler (DTensor's fallback moved the sharded "
                          "data: all_gather)") and "ShardTensor.register_function_handler(op, handler)" in fft
    assert "ShardTensor.register_dispatch_handler(op, handler)" in roll
    # the line numbers quoted are where the installed PhysicsNeMo defines them
    source = Path(__import__("physicsnemo.domain_parallel.shard_tensor", fromlist=["x"]).__file__).read_text()
    for how in parity.HANDLERS.values():
        name, line = re.search(r"ShardTensor\.(\w+)\(.*:(\d+)\)", how).groups()
        assert f"def {name}(" in source.splitlines()[int(line) - 1], how


def test_relative_error_is_against_the_reference_with_a_floor_for_zero_gradients():
    want = torch.tensor([2.0, -4.0], dtype=torch.float64)
    assert measure.relative_error(want + torch.tensor([0.0, 1e-3], dtype=torch.float64), want) == pytest.approx(2.5e-4)
    assert measure.relative_error(torch.tensor([1e-17]), torch.tensor([0.0]), floor=1e-6) == pytest.approx(1e-11)
    assert measure.relative_error(torch.zeros(3), torch.zeros(2)) == float("inf")


def test_every_registered_model_builds_and_its_case_is_well_formed():
    assert len(model_cases.CASES) == 8
    for each in model_cases.CASES:
        assert parity.problems(each) == [], each.name
        assert parity.load(model_cases.ref(each)) is each


def test_docs_models_md_is_what_make_models_writes_for_this_registry():
    page = PAGE.read_text()
    assert re.search(models_tool.STAMP_LINE, page).group(1) == models_tool.stamp(), (
        "the registry, the harness or a version changed since docs/models.md was written: run `make models`")
    rows = re.findall(r"^\| (.+?) \| (\d)(?: \(\w+\))? \|", page, re.M)
    assert sorted(rows) == sorted((each.name, str(n)) for each in model_cases.CASES + model_cases.SPATIAL
                                  for n in models_tool.RANKS)
