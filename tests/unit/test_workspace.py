"""The planner's CPU kernel workspaces (``plan.workspace``) hold on whatever CPU runs the suite: the backend is the
one torch selects here, and a workspace extrapolated from smaller runs equals the kernel run at its full size."""

import pytest
import torch

from shardlab.plan.workspace import CONVOLUTION, CONVOLUTION_BACKWARD, CPUWorkspace, Kernel


def kernel(channels: int, out_channels: int, spatial: tuple, dtype=torch.float32, backward: bool = False,
           kernel_size: int = 3) -> Kernel:
    """A 'same' convolution of a one-sample field, forward or backward, on the meta device."""
    dims = len(spatial)
    x = torch.empty((1, channels, *spatial), dtype=dtype, device="meta")
    w = torch.empty((out_channels, channels, *[kernel_size] * dims), dtype=dtype, device="meta")
    rest = ([1] * dims, [kernel_size // 2] * dims, [1] * dims, False, [0] * dims, 1)
    if not backward:
        b = torch.empty((out_channels,), dtype=dtype, device="meta")
        return Kernel.of(CONVOLUTION, (x, w, b, *rest))
    grad = torch.empty((1, out_channels, *spatial), dtype=dtype, device="meta")
    return Kernel.of(CONVOLUTION_BACKWARD, (grad, x, w, [out_channels], *rest, [True, True, True]))


@pytest.mark.parametrize("channels, spatial, dtype", [
    (16, (64, 64), torch.float32), (1, (128, 128), torch.float32), (1, (256, 256), torch.float32),
    (16, (16, 64), torch.float32), (16, (64, 64), torch.bfloat16), (8, (32, 32, 32), torch.float32),
    (16, (64, 64, 64), torch.float32), (4, (32, 32), torch.bfloat16)])
def test_the_backend_asked_with_stand_ins_is_the_one_real_tensors_get(channels, spatial, dtype):
    """Zero-stride stand-ins let the planner ask for a field of any size; torch must choose as for real tensors."""
    k = kernel(channels, 16, spatial, dtype)
    x = torch.randn(k.inp.shape).to(dtype)
    w = torch.randn(k.weight.shape).to(dtype)
    real = torch._C._select_conv_backend(x, w, None, *k.rest, None).name
    assert k.backend() == real and real in ("Mkldnn", "Slow2d", "Slow3d")


@pytest.mark.parametrize("channels, out_channels, spatial, dtype, backward", [
    (16, 16, (384, 384), torch.float32, False),
    (16, 16, (384, 384), torch.float32, True),
    (1, 16, (512, 512), torch.float32, True),  # small runs of this one would take the slow path: they must not
    (16, 1, (320, 320), torch.float32, True),
    (16, 16, (160, 160), torch.bfloat16, True),  # oneDNN where the CPU has bf16, torch's slow path elsewhere
    (16, 16, (40, 40, 160), torch.float32, True),  # oneDNN needs 40 x 40 planes here: only W is run smaller
    (8, 8, (40, 40, 40), torch.float32, True),  # the slow path (vol2col) at every size
])
def test_an_extrapolated_workspace_equals_the_kernel_run_at_full_size(channels, out_channels, spatial, dtype,
                                                                        backward):
    k = kernel(channels, out_channels, spatial, dtype, backward)
    measured = CPUWorkspace(threads=1).measure(k)
    runs = [k.resized(spatial) for spatial in measured.runs]
    assert len(runs) >= 2 and all(run.positions < k.positions for run in runs), measured
    assert all(run.backend() == k.backend() for run in runs)
    full = k.held_inside(threads=1)
    assert full > 0 and abs(measured.bytes - full) <= 0.02 * full + 4096, (measured, full, k.backend())


def test_a_kernel_is_measured_once_per_signature_and_reported():
    workspace = CPUWorkspace(threads=1)
    k = kernel(16, 16, (96, 96), backward=True)
    args = (k.grad_output, k.inp, k.weight, k.bias, *k.rest)
    first = workspace(CONVOLUTION_BACKWARD, args)
    assert workspace(CONVOLUTION_BACKWARD, args) == first > 0
    assert workspace(torch.ops.aten.mul.Tensor, (k.inp, k.inp)) == 0
    assert len(workspace.kernels) == 1 and k.backend() in workspace.summary()
