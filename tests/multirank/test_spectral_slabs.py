"""``sl.models.spectral_layers_on_slabs`` on real ranks: PhysicsNeMo's FNO on a field sharded along H, with rows that
split unevenly, computes what one process computes (forward and every gradient, float64), audits clean, and each
spectral layer all-gathers only its truncated columns (B·C·h_local·modes2 complex values), where the unpatched FNO
gathers the field and is found. One job of 4 CPU ranks: on pairs (N = 2) and all together (N = 4).

    .venv/bin/python -m pytest tests/multirank/test_spectral_slabs.py -q -p no:randomly
"""

import pytest

from shardlab.ranks.launch import run_job

FNO = dict(in_channels=1, out_channels=1, decoder_layers=1, decoder_layer_size=8, dimension=2, latent_channels=8,
           num_fno_layers=2, num_fno_modes=4, padding=0)
H, W, BATCH = 17, 16, 1  # 17 rows: 9 + 8 over a pair, 5 + 5 + 5 + 2 over four ranks

ON_RANKS = r'''
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import scatter_tensor
from physicsnemo.models.fno import FNO
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import shardlab as sl

FNO_KWARGS, H, W, BATCH = {fno!r}, {h}, {w}, {batch}
sl.init_distributed(120)
world, me = dist.get_world_size(), dist.get_rank()
meshes = {{2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("pair", "domain"))["domain"],
          world: init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))}}


def seeded():
    torch.manual_seed(0)
    return FNO(**FNO_KWARGS).double()


def audited(result):
    return {{"rows": result.rows, "findings": result.findings(), "clean": result.clean, "error": result.error}}


def on(n):
    mesh = meshes[n]
    field = torch.randn(BATCH, 1, H, W, generator=torch.Generator().manual_seed(3)).double()
    sharded = scatter_tensor(field, dist.get_global_rank(mesh.get_group(), 0), mesh, (Shard(2),))
    # the coordinate grid on slabs too (sl.workarounds.fno_on_slabs): upstream's, whole on every rank, is a finding
    plain, patched = seeded(), sl.workarounds.fno_on_slabs(sl.models.spectral_layers_on_slabs(seeded()))
    audit_model = sl.measure.audit.audit_model
    report = {{"h_local": sharded.to_local().shape[2], "unpatched": audited(audit_model(plain, sharded)),
               "patched": audited(audit_model(patched, sharded))}}
    # A sum, not a mean: ShardTensor's mean over 17 × 16 elements scales every gradient by 1/272 rounded to float32
    # (a relative 2^-28 off), which is not the layer's to fix.
    out = patched(sharded)
    out.square().sum().backward()
    reference = plain(field)
    reference.square().sum().backward()
    report["output gap"] = (out.full_tensor() - reference).abs().max().item()
    report["gradient gaps"] = {{name: (p.grad - q.grad).abs().max().item()  # a parameter no loss reaches: in neither
                               for (name, p), q in zip(patched.named_parameters(), plain.parameters())
                               if (p.grad, q.grad) != (None, None)}}
    report["plain tensor gap"] = (patched(field) - reference).abs().max().item()
    return report


report = {{n: on(n) for n in (2, world)}}
if me == 0:
    sl.ranks.launch.write_job_result(report)
sl.ranks.launch.shutdown_distributed()
'''

LAYERS = [f"spec_encoder.spconv_layers.{i}" for i in range(FNO["num_fno_layers"])]


def ops(audit, module, phase):
    row = next(r for r in audit["rows"] if r["module"] == module)
    return {op: tuple(counts) for op, counts in row[phase].items()}  # JSON made the (calls, bytes) pairs lists


@pytest.mark.multirank
def test_fno_spectral_layers_on_slabs_gather_only_their_modes(tmp_path, no_leftovers):
    script = tmp_path / "slabs.py"
    script.write_text(ON_RANKS.format(fno=FNO, h=H, w=W, batch=BATCH))
    result = run_job("torchrun", 4, script, timeout_s=300, device="cpu").result
    c, modes, complex_bytes, real_bytes = FNO["latent_channels"], FNO["num_fno_modes"], 16, 8
    weights_bytes = c * c * modes * modes * 2 * real_bytes  # weights1 (or weights2): (C, C, modes1, modes2, 2)
    for n in (2, 4):
        got = result[str(n)]
        h_local = got["h_local"]  # rank 0's rows, the first and largest chunk: what every rank pads its rows to
        assert h_local == -(-H // n), got["h_local"]
        # Each spectral layer hands the all-gather its rows' first modes2 W frequencies of every latent channel,
        # complex128; the unpatched layer's DTensor fallback gathers its rows of the whole (real) field.
        modes_bytes = BATCH * c * h_local * modes * complex_bytes
        field_bytes = BATCH * c * h_local * W * real_bytes
        for layer in LAYERS:
            assert ops(got["patched"], layer, "forward") == {"all_gather": (1, modes_bytes)}, n
            # Backward: each rank's gradient of every rank's rows goes back (an all-to-all), and the spectral weights'
            # gradients, each rank's rows' share, are summed.
            assert ops(got["patched"], layer, "backward") == {"all_to_all": (1, n * modes_bytes),
                                                              "all_reduce": (2, 2 * weights_bytes)}, n
            assert ops(got["unpatched"], layer, "forward") == {"all_gather": (1, field_bytes)}, n
            assert any(line.startswith(f"{layer}: torch.fft.rfft2") for line in got["unpatched"]["findings"])
        assert got["unpatched"]["error"] and not got["unpatched"]["clean"]  # the fix is what makes it clean
        assert got["patched"]["clean"] and got["patched"]["error"] is None, got["patched"]["findings"]
        assert got["output gap"] < 1e-12 and got["plain tensor gap"] == 0, n
        # the 14 of the FNO's 16 parameters that the loss reaches (the other two get no gradient, in either)
        assert len(got["gradient gaps"]) == 14 and max(got["gradient gaps"].values()) < 1e-12, got["gradient gaps"]
