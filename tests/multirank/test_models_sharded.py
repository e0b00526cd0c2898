"""The capstone's U-Net: a surrogate that sees the whole field, made of operations ShardTensor shards, and that gives
on a field sharded along H over 2 and 4 CPU ranks what it gives on the whole field in one process (on 4 ranks with
one level less: 64 rows leave each rank 1 row at the bottom of 5 levels, less than interpolation's halo).
In one process: tests/unit/test_models.py."""

import json
import subprocess

import pytest

from shardlab.ranks.launch import clean_environment, torchrun_command

DOMAIN_PARALLEL = """
import json
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import scatter_tensor
from torch.distributed.tensor import Shard
import shardlab as sl

sl.init_distributed(120)
mesh = sl.build_mesh(ddp=1, domain=-1)
x, y = sl.data.normalized_darcy(samples=1)
levels = 5 if dist.get_world_size() == 2 else 4  # at least 2 rows per rank at the bottom level
whole, sharded = sl.models.unet(seed=0, levels=levels), sl.models.unet(seed=0, levels=levels)
xs = scatter_tensor(x, 0, mesh["domain"], (Shard(2),), requires_grad=True)
out = sharded(xs)
((out - scatter_tensor(y, 0, mesh["domain"], (Shard(2),))) ** 2).mean().backward()
xw = x.clone().requires_grad_()
reference = whole(xw)
((reference - y) ** 2).mean().backward()
result = {
    "placements": str(tuple(out.placements)),
    "local rows": out.to_local().shape[2],
    "forward": (out.full_tensor() - reference).abs().max().item(),
    "input gradient": (xs.grad.full_tensor() - xw.grad).abs().max().item(),
    "weight gradients": max((p.grad - q.grad).abs().max().item()
                            for p, q in zip(sharded.parameters(), whole.parameters())),
}
if dist.get_rank() == 0:
    print("RESULT", json.dumps(result))
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_unet_on_a_field_sharded_along_h_matches_one_process(ranks, tmp_path, no_leftovers):
    script = tmp_path / "domain_parallel.py"
    script.write_text(DOMAIN_PARALLEL)
    proc = subprocess.run(torchrun_command(ranks, str(script), log_dir=tmp_path / "torchrun-logs"), capture_output=True,
                          text=True, timeout=300, env=clean_environment(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["placements"] == "(Shard(dim=2),)" and result["local rows"] == 64 // ranks
    for what in ("forward", "input gradient", "weight gradients"):
        assert result[what] <= 1e-5, (what, result)


RELATIVE_ERROR = """
import json
import torch
import torch.distributed as dist
import shardlab as sl

sl.init_distributed(120)
domain = sl.build_mesh(ddp=1, domain=-1)["domain"]
cloud = sl.points.darcy_points(0, 8 * dist.get_world_size() + 1, dtype=torch.float64)  # splits unevenly
model = sl.models.transolver(width=16, layers=1, heads=2, slices=4, seed=0).double().eval()
sharded = cloud.shard(domain)
with torch.no_grad():
    out = sl.points.predict(model, sharded)
    with sl.measure.collective_bytes() as watched:
        error = sl.points.relative_error(out, sharded.target)
    alone = sl.points.relative_error(model(cloud.features, cloud.coords), cloud.target)
if dist.get_rank() == 0:
    print("RESULT", json.dumps({"error": error, "alone": alone, "collectives": watched.ops}))
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
def test_the_relative_error_of_a_sharded_prediction_gathers_nothing(tmp_path, no_leftovers):
    """Notebook 13's metric: two sums over each rank's own points, each made whole by an all-reduce of one float64,
    equal to one process's error; no all-gather of the prediction or the target."""
    script = tmp_path / "relative_error.py"
    script.write_text(RELATIVE_ERROR)
    proc = subprocess.run(torchrun_command(2, str(script), log_dir=tmp_path / "torchrun-logs"), capture_output=True,
                          text=True, timeout=300, env=clean_environment(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["collectives"] == {"all_reduce": {"calls": 2, "bytes": 16}}, result
    assert result["error"] == pytest.approx(result["alone"], rel=1e-12) and result["alone"] > 0, result
