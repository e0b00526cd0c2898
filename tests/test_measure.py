"""Measure layer: saved-activation bytes are exact, and the activation-memory script's ratios
follow 1/N + halo on real ranks (bytes are deterministic; no timing is asserted)."""

import json
import subprocess
import sys

import pytest
import torch

from shardlab import measure
from shardlab.models import conv_stack


def test_saved_activations_counts_unique_tensors_and_skips_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with measure.SavedActivations(exclude=lin.parameters()) as saved:
        torch.relu(lin(x))
    # Linear saves its input (4x8); relu saves its output (4x8); the weight is excluded.
    assert saved.tensors == 2 and saved.bytes == 2 * 4 * 8 * 4


def test_saved_activations_of_conv_stack_scale_with_the_field():
    model = conv_stack(width=4, layers=2)
    sizes = {}
    for h in (16, 32):
        with measure.SavedActivations(exclude=model.parameters()) as saved:
            model(torch.randn(1, 1, h, 16))
        sizes[h] = saved.bytes
    assert sizes[32] == 2 * sizes[16]


@pytest.mark.parametrize("n, expected", [(1, 1.0), (2, 0.5 + 2 / 64), (4, 0.25 + 2 / 64)])
def test_ideal_ratio_is_one_over_n_plus_halo(n, expected):
    assert measure.ideal_activation_ratio(n, height=64, kernel_size=3) == pytest.approx(expected)


@pytest.mark.multirank
def test_activation_memory_script_on_four_ranks(tmp_path, no_leftovers):
    out = tmp_path / "act.json"
    proc = subprocess.run([sys.executable, "-m", "shardlab.measure", "activation-memory", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio/ideal" in proc.stdout  # the table header other runs are compared against
    rows = {r["N"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[1]["ratio"] == 1.0
    for n in (2, 4):
        assert abs(rows[n]["ratio/ideal"] - 1) <= 0.10, rows[n]
        assert rows[n]["ratio"] < rows[n // 2]["ratio"]
