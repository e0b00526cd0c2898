"""Bad mesh input explained before torch sees it (shapes, the batch rule); then the sharding arithmetic: shard
bounds and halo plans. Mistakes on real ranks: tests/multirank/test_mesh_bad_input_on_ranks.py."""

import pytest
import torch

from shardlab import mesh
from shardlab.mesh import MeshError, check_batch_per_domain_group, resolve_mesh_shape


@pytest.mark.parametrize(
    "world, ddp, domain, expected",
    [
        (8, -1, 2, (4, 2)),
        (8, 2, -1, (2, 4)),
        (8, -1, 1, (8, 1)),
        (8, 2, 4, (2, 4)),
        (1, 1, 1, (1, 1)),
        (1, -1, 1, (1, 1)),
    ],
)
def test_valid_shapes(world, ddp, domain, expected):
    assert resolve_mesh_shape(world, ddp, domain) == expected


def test_defaults_are_pure_data_parallel():
    assert resolve_mesh_shape(4) == (4, 1)


@pytest.mark.parametrize(
    "world, ddp, domain, match",
    [
        (8, -1, -1, "at most one axis can be inferred"),
        (8, -1, 3, r"domain=3 does not divide the world size 8: choose one of \[1, 2, 4, 8\], or start 9 ranks"),
        (6, 4, -1, r"ddp=4 does not divide the world size 6: choose one of \[1, 2, 3, 6\]"),
        (8, 2, 2, r"2 × 2 = 4, but the world size is 8\. Use ddp=-1 to infer it, with domain one of \[1, 2, 4, 8\]"),
        (8, 0, 1, "ddp=0: an axis size is a positive integer, or -1"),
        (8, -1, 0, "domain=0: an axis size is a positive integer"),
        (8, -2, 4, "ddp=-2: an axis size is a positive integer"),
        (8, 2, -3, "domain=-3: an axis size is a positive integer"),
    ],
)
def test_bad_shapes_say_what_to_change(world, ddp, domain, match):
    with pytest.raises(MeshError, match=match):
        resolve_mesh_shape(world, ddp, domain)


def test_batch_rule_allows_one_sample_per_domain_group():
    assert check_batch_per_domain_group(batch_size=1, domain_size=4) is None  # accepted: nothing raised
    assert check_batch_per_domain_group(batch_size=8, domain_size=1) is None  # no domain parallelism: any batch


def test_batch_rule_says_to_scale_on_ddp():
    with pytest.raises(MeshError, match=r"batch size 2 per domain group.*ddp axis"):
        check_batch_per_domain_group(batch_size=2, domain_size=2)


@pytest.mark.parametrize("height,n", [(64, 4), (65, 3), (66, 4), (10, 4), (7, 7), (3, 5), (0, 2), (1, 1), (512, 48)])
def test_shard_bounds_match_torch_chunk_as_scatter_tensor_splits(height, n):
    bounds = mesh.shard_bounds(height, n)
    parts = [len(part) for part in torch.chunk(torch.arange(height), n)] if height else []
    expected = parts + [0] * (n - len(parts))  # torch.chunk returns fewer chunks when rows run out
    assert [stop - start for _, start, stop in bounds] == expected
    assert [rank for rank, _, _ in bounds] == list(range(n))
    assert bounds[0][1] == 0 and bounds[-1][2] == height
    assert all(bounds[i][2] == bounds[i + 1][1] for i in range(n - 1))  # contiguous, no gaps


def test_shard_bounds_rejects_no_ranks():
    with pytest.raises(ValueError):
        mesh.shard_bounds(8, 0)


@pytest.mark.parametrize("height,n,k", [(16, 4, 3), (16, 4, 5), (65, 3, 5), (10, 3, 3)])
def test_halo_plan_takes_the_neighbours_adjacent_rows(height, n, k):
    plan = mesh.halo_plan(height, n, k)
    halo = k // 2
    assert [p["owned"] for p in plan] == [(s, e) for _, s, e in mesh.shard_bounds(height, n)]
    assert plan[0]["from_above"] is None and plan[-1]["from_below"] is None  # nothing beyond the global edges
    for above, below in zip(plan, plan[1:]):
        a_start, a_stop = above["owned"]
        b_start, b_stop = below["owned"]
        # The last k//2 rows of the rank above, and the first k//2 rows of the rank below.
        assert below["from_above"] == (a_stop - halo, a_stop)
        assert above["from_below"] == (b_start, b_start + halo)
        assert a_start <= a_stop - halo and b_start + halo <= b_stop


def test_halo_plan_edge_cases():
    assert all(p["from_above"] is None and p["from_below"] is None for p in mesh.halo_plan(16, 4, 1))
    assert mesh.halo_plan(16, 1, 5)[0] == {"rank": 0, "owned": (0, 16), "from_above": None, "from_below": None}
    with pytest.raises(ValueError, match="rank 0 owns only 1 of 4 rows: use at most 2 ranks"):
        mesh.halo_plan(4, 4, 5)
    with pytest.raises(ValueError, match="odd"):
        mesh.halo_plan(16, 4, 4)
