"""Training layer: the wrapper choice is validated, and FSDP2 divides state bytes by the ddp size."""

import json
import subprocess
import sys

import pytest
import torch

from shardlab import train


def test_unknown_wrapper_names_the_choices_and_rules_out_fsdp1():
    with pytest.raises(ValueError, match=r"use one of \('none', 'ddp', 'fsdp2'\)\. FSDP1 and distribute_module"):
        train.wrap(torch.nn.Linear(2, 2), mesh=None, how="fsdp1")


def test_normalized_darcy_is_order_one():
    x, y = train.normalized_darcy(samples=4)
    assert x.shape == y.shape == (4, 1, 64, 64)
    assert abs(x.mean().item()) < 0.2 and 0.5 < x.std().item() < 1.5 and y.abs().max().item() == pytest.approx(1.0)


def test_one_process_reference_is_deterministic():
    from shardlab.models import conv_stack

    a = train.train_one_process(conv_stack(seed=0), steps=2, ddp_size=2)
    b = train.train_one_process(conv_stack(seed=0), steps=2, ddp_size=2)
    assert a == b and a[1] < a[0]


@pytest.mark.multirank
def test_state_memory_script_fsdp2_divides_by_ddp_size(tmp_path, no_leftovers):
    out = tmp_path / "state.json"
    proc = subprocess.run([sys.executable, "-m", "shardlab.measure", "state-memory", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["ddp_size"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[1]["FSDP2/DDP"] == pytest.approx(1.0)
    for ddp in (2, 4):
        assert abs(rows[ddp]["ratio/ideal"] - 1) <= 0.05, rows[ddp]  # within 5 % of 1/ddp for this model
