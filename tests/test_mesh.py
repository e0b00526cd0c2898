"""Mesh rules: shapes, the batch rule and 1-D checks are explained before torch sees them."""

import pytest

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
    check_batch_per_domain_group(batch_size=1, domain_size=4)
    check_batch_per_domain_group(batch_size=8, domain_size=1)  # no domain parallelism: any batch


def test_batch_rule_says_to_scale_on_ddp():
    with pytest.raises(MeshError, match=r"batch size 2 per domain group.*ddp axis"):
        check_batch_per_domain_group(batch_size=2, domain_size=2)

