"""``sl.measure.audit.audit_model`` on real ranks: what it counts per module is what the model's shapes say it must be,
the rows add up to what the ranks really sent, Transolver audits clean, and each thing the audit looks for is found
where it is. One job of 4 CPU ranks: the ranks audit on pairs (N = 2, two pairs side by side) and all together (N = 4).

    .venv/bin/python -m pytest tests/multirank/test_audit.py -q -p no:randomly
"""

import pytest

from shardlab.ranks.launch import run_job

ON_RANKS = r'''
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
from physicsnemo.models.transolver import Transolver
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import shardlab as sl
from shardlab.measure.collectives import collective_recorder

sl.init_distributed(120)
world, me = dist.get_world_size(), dist.get_rank()
meshes = {2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pair", "domain"))["domain"],
          world: init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))}
TRANSOLVER = dict(functional_dim=1, out_dim=1, embedding_dim=2, n_layers=2, n_hidden=32, n_head=4, slice_num=8,
                  use_te=False)
POINTS = 200


def scatter(t, mesh, placement):
    return scatter_tensor(t, dist.get_global_rank(mesh.get_group(), 0), mesh, (placement,))


def seeded(make):
    torch.manual_seed(0)
    return make().double()


def gap(a, b):
    a = a.full_tensor() if isinstance(a, ShardTensor) else a
    return (a - b).abs().max().item()


def seen(result, **extra):
    return {"rows": result.rows, "totals": result.totals(), "findings": result.findings(), "clean": result.clean,
            "error": result.error, **extra}


def parameter_bytes(model):
    """Each module's own parameters' bytes: what all-reducing their gradients sends."""
    return {path: sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            for path, m in model.named_modules()}


def transolver(n):
    model = seeded(lambda: Transolver(**TRANSOLVER))
    g = torch.Generator().manual_seed(1)
    fx, pos = torch.randn(1, POINTS, 1, generator=g).double(), torch.rand(1, POINTS, 2, generator=g).double()
    inputs = [scatter(t, meshes[n], Shard(1)) for t in (fx, pos)]
    result = sl.measure.audit.audit_model(model, *inputs)
    sent = []  # everything the ranks sent, recorded apart from the audit's attribution
    with collective_recorder(sent.append, see_inside_subclasses=True):
        model(*inputs).square().mean().backward()
    model.zero_grad()
    return seen(result, gap=gap(result.output, model(fx, pos)), parameter_bytes=parameter_bytes(model),
                sent=[sum(e.bytes for e in sent), len(sent)])


def conv(n):
    model = seeded(lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 1, 3, padding=1)))
    field = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(2)).double()
    result = sl.measure.audit.audit_model(model, scatter(field, meshes[n], Shard(2)))
    return seen(result, gap=gap(result.output, model(field)), parameter_bytes=parameter_bytes(model))


def fno(n):
    model = sl.models.fno(channels=8, layers=2, modes=4).double()
    field = torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(3)).double()
    result = sl.measure.audit.audit_model(model, scatter(field, meshes[n], Shard(2)))
    return seen(result, gap=gap(result.output, model(field)))


class Gathers(nn.Module):
    """A module that hands back its sharded input whole: what a careless layer inside a model can do."""

    def forward(self, x):
        return x.redistribute(placements=(Replicate(),)) if isinstance(x, ShardTensor) else x


def gathers(n):
    model = seeded(lambda: nn.Sequential(nn.Linear(2, 4), Gathers(), nn.Linear(4, 1)))
    points = torch.randn(1, 32, 2, generator=torch.Generator().manual_seed(4)).double()
    result = sl.measure.audit.audit_model(model, scatter(points, meshes[n], Shard(1)))
    return seen(result, gap=gap(result.output, model(points)))


report = {"world": world}
for n in (2, world):
    report[f"transolver {n}"] = transolver(n)
report["conv 2"] = conv(2)
report["fno on H"] = fno(world)
report["gathers"] = gathers(2)
if me == 0:
    sl.ranks.launch.write_job_result(report)
sl.ranks.launch.shutdown_distributed()
'''


def row(audit, module):
    return next(r for r in audit["rows"] if r["module"] == module)


def ops(phase: dict) -> dict:
    return {op: tuple(counts) for op, counts in phase.items()}  # JSON made the (calls, bytes) pairs lists


SHAPES = dict(n_layers=2, n_hidden=32, n_head=4, slice_num=8, itemsize=8, batch=1)  # the job's Transolver


def transolver_communicates_what_its_shapes_say(audit):
    b, h, s, itemsize = SHAPES["batch"], SHAPES["n_head"], SHAPES["slice_num"], SHAPES["itemsize"]
    d = SHAPES["n_hidden"] // h
    # Forward, in each block's attention: the slice weights' norm (B, H, S) is a sum over the points, all-reduced
    # before it divides; the slice tokens (B, H, S, D) are partial sums over each rank's points, projected to
    # q, k and v (B, H, S, 3D) and all-reduced by the redistribute to Replicate before attention among the slices.
    attention = (2, b * h * s * itemsize + b * h * s * 3 * d * itemsize)
    blocks = [f"blocks.{i}.Attn" for i in range(SHAPES["n_layers"])]
    assert {r["module"]: ops(r["forward"]) for r in audit["rows"] if r["forward"]} == dict.fromkeys(
        blocks, {"all_reduce": attention})
    # Backward: every Linear and LayerNorm sums its weight (and bias) gradient over the points, one all-reduce each;
    # the attention itself, its temperature's gradient and those of the replicated slice tokens (B, H, S, D) and
    # slice norm (B, H, S), each a sum over the points.
    own = audit["parameter_bytes"]
    for r in audit["rows"]:
        module = r["module"]
        if module in blocks:
            expected = (3, own[module] + b * h * s * (d + 1) * itemsize)
        elif module != "(loss)":
            expected = (1 if module.endswith("qkv_project") else 2, own[module])  # qkv_project has no bias
        else:
            expected = (1, itemsize)  # ShardTensor.backward makes the loss, a partial sum, whole first
        assert ops(r["backward"]) == {"all_reduce": expected}, r
    # Nothing counted twice or lost: the rows add up to the totals, and to what the ranks sent, recorded apart.
    for phase in ("forward", "backward"):
        summed = {}
        for r in audit["rows"]:
            for op, (calls, nbytes) in r[phase].items():
                summed[op] = (summed.get(op, (0, 0))[0] + calls, summed.get(op, (0, 0))[1] + nbytes)
        assert summed == ops(audit["totals"][phase])
    totals = [counts for phase in audit["totals"].values() for counts in phase.values()]
    assert [sum(c[1] for c in totals), sum(c[0] for c in totals)] == audit["sent"]
    assert audit["clean"] and audit["findings"] == [] and audit["error"] is None
    assert audit["gap"] < 1e-12


def convolutions_halos_and_weight_gradients_land_on_their_module(audit):
    own, width, itemsize = audit["parameter_bytes"], 16, 8
    # Rank 0 of the pair hands its one neighbour the row next to it, of every input channel (1, then 4), forward;
    # the second convolution's input needs a gradient, so its halo's gradient comes back, backward.
    assert ops(row(audit, "0")["forward"]) == {"all_to_all": (1, 1 * width * itemsize)}
    assert ops(row(audit, "2")["forward"]) == {"all_to_all": (1, 4 * width * itemsize)}
    assert ops(row(audit, "0")["backward"]) == {"all_reduce": (2, own["0"])}
    assert ops(row(audit, "2")["backward"]) == {"all_reduce": (2, own["2"]), "all_to_all": (1, 4 * width * itemsize)}
    assert audit["clean"] and audit["gap"] < 1e-12


def an_fft_along_the_sharded_axis_is_found(found, world):
    """(The fix, sl.models.spectral_layers_on_slabs, is tested in test_spectral_slabs.py.)"""
    for layer in ("spec_encoder.spconv_layers.0", "spec_encoder.spconv_layers.1"):
        spectral = row(found, layer)
        assert spectral["unpatched"] == ["torch.fft.rfft2"] and spectral["replicated outputs"], spectral
        assert spectral["whole"] == {}, spectral  # its weights meet channels split by the fallback: not the field
        # DTensor gathers the lifted field: each rank hands its own rows, 8 channels × 16/N rows × 16 columns.
        assert ops(spectral["forward"]) == {"all_gather": (1, 8 * (16 // world) * 16 * 8)}
        assert sum(line.startswith(layer) for line in found["findings"]) == 2  # the op, and the silent gather
    assert "shard_tensor.py" in found["error"] and found["findings"][-1].startswith("the backward raised")
    assert found["gap"] < 1e-12  # the gather is silent: the forward is still right
    # upstream's coordinate grid, built whole on every rank from the global shape: (1, 2, 16, 16) float32, named
    [grid] = [line for line in found["findings"] if line.startswith("spec_encoder: ")]
    assert grid.startswith("spec_encoder: a plain tensor (1, 2, 16, 16), 2,048 B on every rank met the field split "
                           "along dim 2"), grid
    assert [*row(found, "spec_encoder")["whole"]] == ["(1, 2, 16, 16)"]


def a_module_that_hands_back_its_input_whole_is_a_silent_gather(audit):
    assert [r["module"] for r in audit["rows"] if r["replicated outputs"]] == ["1"]  # not the Sequential around it
    assert len(audit["findings"]) == 1 and audit["findings"][0].startswith("1: "), audit["findings"]
    assert "silent gather" in audit["findings"][0]
    assert ops(row(audit, "1")["forward"]) == {"all_gather": (1, 16 * 4 * 8)}  # this rank's 16 points × 4 features
    assert audit["gap"] < 1e-12


@pytest.mark.multirank
def test_the_audit_counts_what_the_shapes_say_and_finds_what_it_looks_for(tmp_path, no_leftovers):
    script = tmp_path / "audit.py"
    script.write_text(ON_RANKS)
    audits = run_job("torchrun", 4, script, timeout_s=300, device="cpu").result
    checks = {
        "Transolver, N = 2": lambda: transolver_communicates_what_its_shapes_say(audits["transolver 2"]),
        "Transolver, N = 4": lambda: transolver_communicates_what_its_shapes_say(audits["transolver 4"]),
        "convolutions, N = 2": lambda: convolutions_halos_and_weight_gradients_land_on_their_module(audits["conv 2"]),
        "FNO": lambda: an_fft_along_the_sharded_axis_is_found(audits["fno on H"], audits["world"]),
        "a silent gather": lambda: a_module_that_hands_back_its_input_whole_is_a_silent_gather(audits["gathers"]),
    }
    wrong = []
    for what, check in checks.items():
        try:
            check()
        except AssertionError as error:
            wrong.append(f"{what}: {error}")
    assert not wrong, "\n".join(wrong)
