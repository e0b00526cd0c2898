"""On real ranks, at 2 and 4: PhysicsNeMo's FNO at its defaults (padding 8, coordinate features) run on slabs
(``sl.workarounds.fno_on_slabs`` with ``sl.models.spectral_layers_on_slabs``) matches one process within 1e-10 relative
in float64 on even and uneven splits and audits clean, where the same FNO with upstream's grid is found building the
whole (B, 2, H, W) grid on every rank; DiT's positional table left replicated is found, named, with what to change,
and sharded on ``domain`` (fsdp_spatial) matches one process, each rank holding 1/N of it. One job per rank count.

    .venv/bin/python -m pytest tests/multirank/test_fno_grid_and_spatial.py -q -p no:randomly
"""

import pytest

from shardlab import model_cases, parity

CASES = (model_cases.fno, model_cases.fno_grid_whole, model_cases.dit_replicated, model_cases.dit_sharded)


def parity_holds(row, splits):
    assert row["problems"] == [], row["problems"]
    assert sorted(run["split"] for run in row["parity"]) == sorted(splits), row["parity"]
    for run in row["parity"]:
        assert "error" not in run, run
        assert max(run["output"], run["gradient"]) <= parity.TOLERANCE and run["parameters"] > 0, run


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_fno_defaults_on_slabs_and_dit_positional_table(ranks, no_leftovers):
    rows = {row["case"]: row for row in parity.run([model_cases.ref(c) for c in CASES], ranks=ranks, timeout_s=400)}

    fno = rows[model_cases.fno.name]
    parity_holds(fno, ["even", "uneven"])
    assert fno["audit"]["findings"] == [] and fno["audit"]["error"] is None, fno["audit"]

    whole = rows[model_cases.fno_grid_whole.name]
    parity_holds(whole, ["even"])  # right, but wasteful: every rank holds the whole grid
    size = model_cases.fno_grid_whole.sizes(ranks)[0]
    [grid] = whole["audit"]["findings"]
    # upstream's grid is float32: 4 bytes a value, (1, 2, H, W)
    assert grid.startswith(f"model.module.spec_encoder: a plain tensor (1, 2, {size}, {size}), "
                           f"{2 * size * size * 4:,} B on every rank") and "build only this rank's rows" in grid, grid

    replicated, sharded = rows[model_cases.dit_replicated.name], rows[model_cases.dit_sharded.name]
    table = "pos_embed"
    tokens, width = replicated["spatial"][table]["length"], 64
    assert tokens == (model_cases.dit.sizes(ranks)[0] // 4) ** 2
    parity_holds(replicated, ["even"])  # ShardTensor adds each rank's own rows of the promoted table: right values
    [named] = replicated["audit"]["findings"]
    assert f"{table} (1, {tokens}, {width}), {tokens * width * 8:,} B on every rank" in named, named
    assert named.endswith("shard it on domain as a DTensor, Shard(1) (sl.parity: strategy 'fsdp_spatial', "
                          "spatial={'pos_embed': 1}).")
    assert replicated["audit"]["held"] == {table: tokens * width * 8}

    parity_holds(sharded, ["even"])
    assert sharded["audit"]["findings"] == [] and sharded["spatial"][table]["split"]
    assert sharded["audit"]["held"] == {table: tokens * width * 8 // ranks}  # its rows only
    # the table's gradient is no longer all-reduced whole
    assert sharded["audit"]["bytes"]["backward"] < replicated["audit"]["bytes"]["backward"]
