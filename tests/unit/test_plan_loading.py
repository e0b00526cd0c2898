"""The planner's loading mode: ``scatter`` (``scatter_tensor``, the whole field on every rank of a domain group) or
``slab`` (each rank reads only its own rows and wraps them with ``ShardTensor.from_local``), planned on the meta
device: what slab loading removes, the verdict that flips on the same GPUs, the messages and the command line.
Against a step measured on ranks: tests/multirank/test_plan_loading_measured.py."""

import json

import pytest

from shardlab import plan
from shardlab.models import conv_stack
from shardlab.plan import cli as plan_cli
from shardlab.plan.trace import blocks

FLOAT = 4  # bytes of a float32


@pytest.mark.parametrize("field, domain", [((1, 1, 128, 64), 2), ((1, 1, 66, 64), 4)])
def test_slab_loading_removes_the_whole_fields_and_nothing_else(field, domain):
    model = conv_stack(width=8, layers=3)
    scatter = plan.plan(model, field, domain=domain, loading="scatter")
    slab = plan.plan(model, field, domain=domain, loading="slab")
    assert scatter.loading == "scatter" and slab.loading == "slab"
    whole = blocks(field[2] * field[3] * FLOAT)  # one channel in, one out: input and target are the same size
    for s, r in zip(scatter.rows, slab.rows):
        assert s.transient == field[2] * field[3] * FLOAT and r.transient == 0
        assert (s.params, s.grads, s.optimizer, s.buffers, s.activations, s.halos, s.rows) == (
            r.params, r.grads, r.optimizer, r.buffers, r.activations, r.halos, r.rows)
        # A one-channel slice along H is a view of the broadcast field (docs/upstream.md), so under scatter both whole
        # fields sit under the step's peak; under slab, only the rank's own rows of each, in storage of their own.
        own = blocks(r.rows * field[3] * FLOAT)
        assert s.peak - r.peak == 2 * (whole - own), (s.rank, s.peak, r.peak)
    assert "slab loading" in slab.notes[-1] and "scatter loading" in scatter.notes[-1]
    assert plan.plan(model, field, domain=domain, loading="slab").as_json()["loading"] == "slab"


def test_on_one_rank_both_loadings_hold_the_whole_field():
    model = conv_stack(width=8, layers=3)
    one = [plan.plan(model, (1, 1, 64, 64), loading=mode).rows[0] for mode in plan.LOADINGS]
    assert one[0] == one[1] and one[0].transient == 0


# The flip the lesson shows: the series' surrogate on a 40960² fp32 field over 8 H100s (ddp=1, domain=8, DDP).
FLIP = {"model": dict(width=16, depth=3), "field": "40960x40960", "gpu": "H100", "domain": 8}


def flip_verdicts():
    model = plan.conv_model(2, **FLIP["model"])
    field, capacity = plan.parse_field(FLIP["field"]), plan.parse_size(FLIP["gpu"])
    answers = {}
    for loading in plan.LOADINGS:
        planner = plan.Planner(model, field, loading=loading)
        answers[loading] = plan.verdict(planner, planner.plan(domain=FLIP["domain"]), capacity)
    return answers


def test_a_40960_squared_field_on_8_h100s_does_not_fit_scattered_and_fits_by_slab():
    answers = flip_verdicts()
    scatter, slab = answers["scatter"], answers["slab"]
    print({k: (v.need, v.headroom, v.left, v.text) for k, v in answers.items()})
    assert not scatter.fits and slab.fits and scatter.capacity == slab.capacity
    assert scatter.smallest_domain > FLIP["domain"] and slab.smallest_domain is None
    assert scatter.text.startswith(f"does not fit: smallest domain size that fits is {scatter.smallest_domain} "
                                   "(scatter loading; ")
    assert 'loading="slab" (--loading slab)' in scatter.text and slab.text.endswith("GiB left (slab loading)")
    assert scatter.text.endswith(f"a rank needs {plan.fmt_bytes(slab.need)}: it fits)")
    # What flips it: the whole fields, 6.25 GiB each, less the eighth of them the rank reads itself.
    assert scatter.need - slab.need == 2 * (40960**2 * FLOAT - 40960**2 * FLOAT // 8)


def test_the_refusals_name_the_loading_and_the_full_field_one_suggests_slab():
    planner = plan.Planner(plan.conv_model(2), plan.parse_field("8192x8192"))
    tiny = plan.verdict(planner, planner.plan(domain=1), plan.parse_size("1GiB"))
    assert tiny.text.startswith("does not fit at any domain size (scatter loading)")
    assert "256 MiB is the full input field" in tiny.text
    assert 'Slab loading, loading="slab" (--loading slab)' in tiny.text
    slab = planner.with_loading("slab")
    assert slab.model is planner.model and slab.loading == "slab" and planner.loading == "scatter"
    refused = plan.verdict(slab, slab.plan(domain=1), plan.parse_size("1GiB"))
    assert refused.text.startswith("does not fit at any domain size (slab loading)")
    assert "full input field" not in refused.text and "scatter_tensor" not in refused.text
    # Slab loading needs fewer domain ranks than scatter for the same field and GPUs, never more.
    capacity = plan.parse_size("4GiB")
    assert 1 < slab.smallest_domain(capacity) < planner.smallest_domain(capacity)
    with pytest.raises(ValueError, match=r"planner.with_loading\('slab'\)"):
        plan.verdict(planner, slab.plan(domain=2), capacity)
    with pytest.raises(ValueError, match=r"loading='stream': choose one of \['scatter', 'slab'\]"):
        plan.Planner(plan.conv_model(2), (1, 1, 64, 64), loading="stream")


def test_command_line_plans_slab_loading(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--field", FLIP["field"], "--domain", str(FLIP["domain"]), "--gpu", FLIP["gpu"]]
    assert plan_cli.main([*args, "--loading", "slab", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "loading: slab (each rank reads its own rows" in printed and "(slab loading)" in printed
    report = json.loads(out.read_text())
    assert report["loading"] == "slab" and report["verdict"]["fits"] and report["verdict"]["loading"] == "slab"
    assert all(row["transient"] == 0 for row in report["rows"])
    assert plan_cli.main(args) == 0  # scatter, the default
    printed = capsys.readouterr().out
    assert "loading: scatter (scatter_tensor" in printed and "--loading slab" in printed and "does not fit" in printed
    with pytest.raises(SystemExit) as refused:
        plan_cli.main([*args, "--loading", "stream"])
    assert refused.value.code == 2 and "invalid choice: 'stream'" in capsys.readouterr().err
