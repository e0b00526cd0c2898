"""Mesh mistakes on real ranks are refused on every rank: a contradicting global_shape, a source outside the mesh,
duplicate axis names, sync on the wrong mesh or too late. Shapes and shard arithmetic without ranks:
tests/unit/test_mesh.py."""

import pytest

from shardlab.ranks.launch import run_job

ON_RANKS = r"""
import torch, torch.distributed as dist
import shardlab as sl
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import sync_module_over_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
sl.init_distributed(30)
mesh = sl.build_mesh(ddp=1, domain=2)
x = torch.randn(1, 1, 8, 8)
cases = {
    "global_shape": lambda: sl.mesh.scatter(x, 0, mesh["domain"], (Shard(2),), global_shape=(1, 1, 6, 8),
                                            dtype=x.dtype),
    "source outside mesh": lambda: sl.mesh.scatter(x, 5, mesh["domain"], (Shard(2),)),
    "duplicate axis names": lambda: DistributedManager().initialize_mesh((1, 2), ("domain", "domain")),
    "sync on a 2-D mesh": lambda: sync_module_over_mesh(torch.nn.Linear(2, 2), mesh),
    "sync after fully_shard": lambda: sync_module_over_mesh(fully_shard(torch.nn.Linear(4, 4), mesh=mesh["domain"]),
                                                            mesh["domain"]),
}
seen = {}
for name, case in cases.items():
    try:
        case()
        seen[name] = "no error"
    except Exception as error:
        seen[name] = f"{type(error).__name__}: {error}"
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, seen)
if dist.get_rank() == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
"""

EXPECTED = {
    "global_shape": "MeshError: global_shape (1, 1, 6, 8) does not match the tensor's shape (1, 1, 8, 8)",
    "source outside mesh": "MeshError: source rank 5 is not in this mesh (ranks [0, 1])",
    "duplicate axis names": "RuntimeError: Mesh dimension names must be unique",
    "sync on a 2-D mesh": "ValueError: sync_module_over_mesh expects a 1-D mesh, got 2-D. Pass the axis explicitly",
    "sync after fully_shard": "RuntimeError: sync_module_over_mesh must run before fully_shard",
}


@pytest.mark.multirank
def test_bad_input_on_ranks_is_refused_on_every_rank(tmp_path, no_leftovers):
    script = tmp_path / "cases.py"
    script.write_text(ON_RANKS)
    rows = run_job("torchrun", 2, script, timeout_s=300).result
    for rank, seen in enumerate(rows):
        for name, start in EXPECTED.items():
            assert seen[name].startswith(start), f"rank {rank}, {name}: {seen[name]}"
