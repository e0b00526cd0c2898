"""Small models for the series: sized so four CPU ranks train them in seconds.

Introduced in ``notebooks/04_domain_parallel_ops.ipynb``.
"""

from __future__ import annotations

import torch


def conv_stack(width: int = 16, layers: int = 3, kernel_size: int = 3, seed: int = 0, dims: int = 2):
    """Conv2d → GELU → … → Conv2d, 1 channel in and out, 'same' padding: a minimal field-to-field surrogate.
    ``dims=3`` gives the same stack of Conv3d, for a 3-D field.

    The weights depend on ``seed`` alone; the global random state is left as it was.
    """
    conv = {2: torch.nn.Conv2d, 3: torch.nn.Conv3d}.get(dims)
    if conv is None:
        raise ValueError(f"a {dims}-D field: the conv_stack model exists for 2-D and 3-D fields.")
    channels = [1] + [width] * (layers - 1) + [1]
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are created on the CPU
        blocks = []
        for i, (c_in, c_out) in enumerate(zip(channels, channels[1:])):
            blocks.append(conv(c_in, c_out, kernel_size, padding=kernel_size // 2))
            if i < layers - 1:
                blocks.append(torch.nn.GELU())
        return torch.nn.Sequential(*blocks)


class UNet(torch.nn.Module):
    """A small U-Net for a 2-D field, 1 channel in and out, of operations ShardTensor runs on a field sharded
    along H: 3×3 convolutions (halo exchange), ``avg_pool2d`` with stride = kernel (local, no halo), bilinear
    ``interpolate`` ×2 (halo exchange), GELU and channel concatenation (local).

    Each level halves the field; with ``levels=5`` a 64×64 field reaches 4×4, where a second convolution
    lets every output pixel see the whole field (the pressure of a Darcy field depends on all of its
    permeability). Each shard's rows must stay even at every level (pooling), and at least 2 at the bottom
    (bilinear interpolation takes a 2-row halo): 64 rows over 2 domain ranks reach 2 rows at the bottom with
    5 levels; over 4 ranks use ``levels=4``.
    """

    def __init__(self, width: int = 16, levels: int = 5, max_width: int = 64):
        super().__init__()
        if levels < 2:
            raise ValueError(f"levels={levels}: a U-Net needs at least 2 levels (one pooling).")
        widths = [min(width * 2**level, max_width) for level in range(levels)]
        conv = torch.nn.Conv2d
        self.down = torch.nn.ModuleList(conv(c_in, c_out, 3, padding=1) for c_in, c_out in zip([1, *widths], widths))
        self.bottom = conv(widths[-1], widths[-1], 3, padding=1)
        # Upward: the coarser level's features, upsampled, concatenated with this level's (the skip connection).
        self.up = torch.nn.ModuleList(conv(widths[level + 1] + widths[level], widths[level], 3, padding=1)
                                      for level in range(levels - 1))
        self.head = conv(widths[0], 1, 1)

    def forward(self, x):
        functional = torch.nn.functional
        skips = []
        for level, conv in enumerate(self.down):
            if level:
                x = functional.avg_pool2d(x, 2)
            x = functional.gelu(conv(x))
            skips.append(x)
        x = functional.gelu(self.bottom(x))
        for level in reversed(range(len(self.up))):
            x = functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            x = functional.gelu(self.up[level](torch.cat([x, skips[level]], dim=1)))
        return self.head(x)


def unet(width: int = 16, levels: int = 5, seed: int = 0) -> UNet:
    """The capstone's surrogate (``notebooks/07_capstone.ipynb``); the weights depend on ``seed`` alone, and the
    global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are created on the CPU
        return UNet(width=width, levels=levels)


# A stencil that ShardTensor has no handler for, as a user's own kernel would be: a custom op is opaque to
# PhysicsNeMo (it cannot see the slicing inside), so on a ShardTensor it reaches DTensor, which has no sharding
# strategy for it. Introduced in ``notebooks/10_beyond_halos.ipynb``, where the learner writes its shard patch.
@torch.library.custom_op("shardlab::diffuse", mutates_args=())
def diffuse(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """One explicit diffusion step on the last two dims: ``x + alpha`` × the 5-point Laplacian, zeros beyond the
    edges. Output row r reads input rows r-1, r, r+1: one halo row from each neighbour when sharded along H."""
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    neighbours = padded[..., :-2, 1:-1] + padded[..., 2:, 1:-1] + padded[..., 1:-1, :-2] + padded[..., 1:-1, 2:]
    return x + alpha * (neighbours - 4 * x)


@diffuse.register_fake
def _(x, alpha):
    return torch.empty_like(x)


def _diffuse_context(ctx, inputs, output):
    ctx.alpha = inputs[1]


# The stencil is symmetric with zero edges, so the step is its own adjoint: the gradient is one more step.
diffuse.register_autograd(lambda ctx, grad: (diffuse(grad, ctx.alpha), None), setup_context=_diffuse_context)

# The operator a shard patch is registered for, and called as: ``ShardTensor.register_function_handler(DIFFUSE, h)``.
DIFFUSE = torch.ops.shardlab.diffuse.default
