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


def transolver(features: int = 1, coords: int = 2, out: int = 1, width: int = 32, layers: int = 2, heads: int = 4,
               slices: int = 8, seed: int = 0):
    """PhysicsNeMo's own ``Transolver`` for point clouds (``notebooks/13_physicsnemo_models.ipynb``): ``features``
    values and ``coords`` coordinates per point in, ``out`` values per point out; PyTorch layers (``use_te=False``:
    Transformer Engine is a GPU-only extra). The weights depend on ``seed`` alone, and the global random state is
    left as it was."""
    from physicsnemo.models.transolver import Transolver

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are created on the CPU
        return Transolver(functional_dim=features, out_dim=out, embedding_dim=coords, n_layers=layers, n_hidden=width,
                          n_head=heads, slice_num=slices, use_te=False)


def fno(channels: int = 8, layers: int = 2, modes: int = 4, seed: int = 0):
    """PhysicsNeMo's own 2-D ``FNO`` (``notebooks/13_physicsnemo_models.ipynb``), small: 1 channel in and out,
    ``channels`` latent channels, ``layers`` spectral layers keeping ``modes`` frequencies per axis, no padding. The
    weights depend on ``seed`` alone, and the global random state is left as it was."""
    from physicsnemo.models.fno import FNO

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: modules are created on the CPU
        return FNO(in_channels=1, out_channels=1, decoder_layers=1, decoder_layer_size=8, dimension=2,
                   latent_channels=channels, num_fno_layers=layers, num_fno_modes=modes, padding=0)


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


# FNO on a field sharded along H (``notebooks/10_beyond_halos.ipynb`` showed the all-to-all transpose an FFT along a
# sharded axis needs; this is the model-level fix for PhysicsNeMo's FNO, which ShardTensor otherwise gathers).
def spectral_layers_on_slabs(model):
    """Make every ``SpectralConv2d`` in ``model`` (PhysicsNeMo's FNO layer) keep a field sharded along H sharded:
    in place, and returns ``model``. A plain tensor, or any other sharding, goes through the layer as before.

    Why it can: ``torch.fft.rfft2`` has no ShardTensor handler, so DTensor all-gathers the whole field for each
    spectral layer (and the backward then fails inside PhysicsNeMo). An FFT along a sharded axis needs every rank's
    rows, but the layer keeps only ``modes2`` of the W frequencies and ``2·modes1`` of the H ones. So: rfft along W
    (not sharded: local), truncate to ``modes2`` columns *before* communicating, all-gather those few columns of every
    rank's rows (B·C_in·h_local·modes2 complex values per rank, where a transpose would move the whole field), FFT
    along H, multiply the kept modes by the layer's weights, inverse FFT along H, keep this rank's rows, irfft along
    W. The gather is differentiable: its backward hands each rank the gradients of its own rows, summed over the
    ranks; the spectral weights' gradients (each rank's rows' share) are all-reduced, as for a promoted weight.
    Uneven row counts (from the ShardTensor's sharding shapes) are padded to the largest for the gather, as gloo
    gathers equal blocks only: a rank with fewer rows sends the largest shard's bytes.
    """
    import types

    from physicsnemo.nn.module.spectral_layers import SpectralConv2d

    for module in model.modules():
        if isinstance(module, SpectralConv2d):
            module.forward = types.MethodType(_spectral_forward_on_slabs, module)
    return model


def _sharded_along_h(x) -> bool:
    from physicsnemo.domain_parallel import ShardTensor

    if not isinstance(x, ShardTensor) or x.device_mesh.ndim != 1:
        return False
    (placement,) = x.placements
    return placement.is_shard() and placement.dim % x.ndim == 2


def _gather_rows(block, rows, group):
    """Every rank's ``block`` (B, C, rows[rank], K), complex, concatenated along dim 2 in rank order, with autograd."""
    return torch.view_as_complex(_GatherRows.apply(torch.view_as_real(block), rows, group))


class _SumGradients(torch.autograd.Function):
    """The identity forward; backward, the gradient all-reduced (summed) over ``group``."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 2 of blocks whose row counts differ by rank: each padded to the largest (gloo gathers
    equal blocks only), gathered, trimmed. Backward: each rank gets its rows' gradients summed over the ranks, by one
    all-to-all of the padded pieces and a sum (gloo has no reduce-scatter; ``torch.distributed.nn``'s gloo fallback
    fails on a subgroup)."""

    @staticmethod
    def forward(ctx, block, rows, group):
        import torch.distributed as dist

        ctx.rows, ctx.group = rows, group
        padded = torch.nn.functional.pad(block, (0, 0, 0, 0, 0, max(rows) - block.size(2))).contiguous()
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:, :, :r] for part, r in zip(parts, rows)], dim=2)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        tallest = max(ctx.rows)
        pieces = torch.stack([torch.nn.functional.pad(piece, (0, 0, 0, 0, 0, tallest - piece.size(2)))
                              for piece in grad.split(ctx.rows, dim=2)])
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=ctx.group)
        return received.sum(0)[:, :, : ctx.rows[dist.get_rank(ctx.group)]], None, None


def _spectral_forward_on_slabs(layer, x):
    """``SpectralConv2d.forward`` for a field sharded along H over a 1-D mesh (see ``spectral_layers_on_slabs``)."""
    from physicsnemo.domain_parallel import ShardTensor

    if not _sharded_along_h(x):
        return type(layer).forward(layer, x)
    mesh, shapes = x.device_mesh, x._spec.sharding_shapes()[0]
    rows = [shape[2] for shape in shapes]
    me = mesh.get_local_rank()
    local = x.to_local()
    h, w = sum(rows), local.size(-1)
    # Along W, local; only the first modes2 frequencies are ever used.
    kept_columns = torch.fft.rfft(local, dim=-1)[..., : layer.modes2]
    columns = _gather_rows(kept_columns, rows, mesh.get_group())  # (B, C_in, H, modes2): every rank's rows
    x_ft = torch.fft.fft(columns, dim=-2)
    # As the layer does (its out_ft starts as cfloat zeros; adding the products promotes it as there).
    out_ft = torch.zeros(local.size(0), layer.out_channels, h, layer.modes2, dtype=torch.cfloat, device=local.device)
    # Every rank multiplies the whole spectrum but keeps only its rows of the result: its weight gradients are its
    # rows' share, summed over the ranks in the backward (what ShardTensor does for a weight it promotes).
    weights1, weights2 = (_SumGradients.apply(w, mesh.get_group()) for w in (layer.weights1, layer.weights2))
    m1 = layer.modes1
    out_ft = out_ft + torch.nn.functional.pad(
        layer.compl_mul2d(x_ft[:, :, :m1].contiguous(), weights1), (0, 0, 0, h - m1))
    out_ft = out_ft + torch.nn.functional.pad(
        layer.compl_mul2d(x_ft[:, :, -m1:].contiguous(), weights2), (0, 0, h - m1, 0))
    start = sum(rows[:me])
    mine = torch.fft.ifft(out_ft, dim=-2)[:, :, start : start + rows[me]]
    # The W frequencies above modes2 are zero, as the layer's; irfft pads them.
    out = torch.fft.irfft(mine, n=w, dim=-1)
    out_shapes = {0: [(*shape[:1], layer.out_channels, *shape[2:]) for shape in shapes]}
    return ShardTensor.from_local(out, mesh, x.placements, sharding_shapes=out_shapes)

