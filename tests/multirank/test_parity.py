"""``sl.parity`` on real ranks, at 2 and 4: Transolver and the series' U-Net match one process within 1e-10 relative in
float64, output and every parameter gradient, on even and uneven splits; the audit's bytes are what Transolver's
shapes say; the peak grows with the size; and a model that cannot run (lesson 13's FNO: rfft2 along the split dim)
keeps its row, with the op named, how to register a handler, and where its backward stops. One job per rank count.

    .venv/bin/python -m pytest tests/multirank/test_parity.py -q -p no:randomly
"""

import pytest

from shardlab import model_cases, parity


def transolver_forward_bytes(layers=2, heads=4, slices=8, width=32, itemsize=8):
    # Each block's attention all-reduces the slice weights' norm (B, H, S) and q, k, v of the slice tokens
    # (B, H, S, 3D) before attention among the slices (tests/multirank/test_audit.py derives it), B = 1.
    return layers * (heads * slices + heads * slices * 3 * (width // heads)) * itemsize


def matches(row, splits):
    assert row["problems"] == [], row["problems"]
    assert sorted(run["split"] for run in row["parity"]) == sorted(splits), row["parity"]
    for run in row["parity"]:
        assert "error" not in run, run
        assert run["output"] <= parity.TOLERANCE and run["gradient"] <= parity.TOLERANCE, run
        assert run["parameters"] > 0
    small, big = (row["memory"][size] for size in sorted(row["memory"], key=int))
    assert isinstance(small, int) and isinstance(big, int) and big > small, row["memory"]
    assert row["audit"]["findings"] == [] and row["audit"]["error"] is None, row["audit"]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_models_match_one_process_and_a_model_that_cannot_run_says_why(ranks, no_leftovers):
    cases = [model_cases.transolver, model_cases.unet] + ([model_cases.fno_unpadded] if ranks == 2 else [])
    refs = [model_cases.ref(case) for case in cases]
    rows = {row["case"]: row for row in parity.run(refs, ranks=ranks, timeout_s=400)}

    transolver = rows[model_cases.transolver.name]
    matches(transolver, ["even", "uneven"])
    assert transolver["ranks"] == ranks and transolver["strategy"] == "ddp"
    # the forward phase also holds the loss's sum over the split points: one float64 all-reduced
    assert transolver["audit"]["bytes"]["forward"] == transolver_forward_bytes() + 8
    assert transolver["audit"]["bytes"]["backward"] > 0  # weight gradients, summed over the points
    # avg_pool2d keeps parity only where every shard's rows stay even: no uneven split at 2 ranks, one at 4
    matches(rows[model_cases.unet.name], ["even"] if ranks == 2 else ["even", "uneven"])

    if ranks == 4:  # FSDP2 on a ddp axis of 2, the points split over a domain axis of 2
        [fsdp] = parity.run([model_cases.ref(model_cases.transolver_fsdp)], ranks=4, timeout_s=400, domain=2)
        assert fsdp["domain"] == 2 and fsdp["strategy"] == "fsdp_spatial"
        matches(fsdp, ["even", "uneven"])

    if ranks == 2:
        fno = rows[model_cases.fno_unpadded.name]
        assert all("shard_tensor.py" in run["error"] for run in fno["parity"]), fno["parity"]
        unpatched = fno["audit"]["unpatched"]
        assert unpatched and all("torch.fft.rfft2 has no ShardTensor handler" in line and
                                 "register_function_handler" in line for line in unpatched), unpatched
        assert "shard_tensor.py" in fno["audit"]["error"]
