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
