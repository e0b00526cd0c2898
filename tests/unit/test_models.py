"""The capstone's U-Net in one process: a field to a field of the same shape, weights that depend on the seed alone,
every output pixel seeing the whole field; and ``diffuse``, one five-point stencil step and its gradient. Sharded
along H on ranks: tests/multirank/test_models_sharded.py."""


import pytest
import torch

from shardlab import models


def test_unet_maps_a_field_to_a_field_of_the_same_shape_and_its_weights_depend_on_the_seed_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b, c = models.unet(seed=0), models.unet(seed=0), models.unet(seed=1)
    assert torch.equal(torch.get_rng_state(), state)  # the global random state is left as it was
    x = torch.randn(2, 1, 64, 64)
    assert a(x).shape == x.shape
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_every_output_pixel_sees_the_whole_field():
    """The pressure at one corner depends on the permeability at the opposite corner: the gradient of the corner's
    output reaches every input pixel. The three-layer conv_stack sees only a 7 × 7 neighbourhood."""
    x = torch.randn(1, 1, 64, 64, requires_grad=True)
    models.unet(seed=0)(x)[0, 0, 0, 0].backward()
    assert (x.grad[0, 0] != 0).all()
    x.grad = None
    models.conv_stack(seed=0)(x)[0, 0, 0, 0].backward()
    assert (x.grad[0, 0] != 0).sum().item() == 4 * 4  # rows and columns 0..3 of the corner, nothing further


def test_unet_needs_a_pooling_level():
    with pytest.raises(ValueError, match="at least 2 levels"):
        models.UNet(levels=1)



def test_diffuse_is_one_step_of_the_five_point_stencil_with_zeros_beyond_the_edges():
    x = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    expected = x.clone()
    for i in range(5):
        for j in range(4):
            neighbours = ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1))
            near = [x[..., a, b] for a, b in neighbours if 0 <= a < 5 and 0 <= b < 4]
            expected[..., i, j] = x[..., i, j] + 0.2 * (sum(near) - 4 * x[..., i, j])
    assert torch.allclose(models.DIFFUSE(x, 0.2), expected)


def test_diffuse_has_the_gradient_of_the_stencil():
    x = torch.randn(1, 1, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: models.DIFFUSE(t, 0.3), (x,))
