"""The planner counts cuDNN's convolution workspace on CUDA (issue 44), simulated on a machine without a GPU.

What is simulated, from torch 2.14.1's behaviour:

- cuDNN's convolution allocates the selected engine's workspace through the caching allocator for the call, and
  frees it when the call returns (``run_conv_plan``, ``aten/src/ATen/native/cudnn/Conv_v8.cpp`` at the 2.14.1 commit,
  ``records.TORCH_SOURCE``; the wheel ships no C++ source): so the allocator's peak over the call is its output plus
  the workspace, and what is allocated after it is the output alone.
- ``torch.cuda.memory_allocated`` and ``torch.cuda.max_memory_allocated`` read that allocator's ``allocated_bytes.all``
  current and peak (``torch/cuda/memory.py:525`` and ``:542`` as installed); ``reset_peak_memory_stats``
  (``torch/cuda/memory.py:381``) sets the peak to the current.
- ``torch.backends.cudnn.benchmark``/``deterministic`` are the flags the measurement pins
  (``torch/backends/cudnn/__init__.py:224``: ``deterministic`` is a ``ContextProp`` over ``torch._C``'s setting).

Only the allocator and the kernel's call are simulated; the planner's code that reads them is the real one.
"""

import pytest
import torch

from shardlab import plan
from shardlab.plan import workspace
from shardlab.plan.workspace import CUDAWorkspace, Kernel

WORKSPACE_PER_POSITION = 64  # the simulated engine's workspace: 64 bytes per output position (a field-sized buffer)


class FakeAllocator:
    """The CUDA caching allocator's ``allocated_bytes.all`` counters, current and peak."""

    def __init__(self):
        self.current = self.peak = 0
        self.seen_flags = []

    def allocate(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n


@pytest.fixture
def fake_cuda(monkeypatch):
    allocator = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocator.current)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: setattr(allocator, "peak", allocator.current))

    original = Kernel._call

    def call(self):
        """A cuDNN convolution as run_conv_plan makes it: output allocated, workspace allocated and freed."""
        func, args = original(self)

        def cudnn(*a):
            allocator.seen_flags.append((torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic))
            out = func(*a)
            returned = sum(t.untyped_storage().nbytes() for t in (out if isinstance(out, tuple) else (out,))
                           if isinstance(t, torch.Tensor))
            allocator.allocate(returned)
            allocator.allocate(WORKSPACE_PER_POSITION * self.positions)
            allocator.free(WORKSPACE_PER_POSITION * self.positions)
            return out
        return cudnn, args

    monkeypatch.setattr(Kernel, "_call", call)
    monkeypatch.setattr(workspace, "_MEASURED", {})
    return allocator


def cpu_tensor(t):
    return torch.randn(t.shape, dtype=t.dtype)


def small_kernel(spatial=(32, 32)):
    x = torch.empty((1, 4, *spatial), device="meta")
    w = torch.empty((8, 4, 3, 3), device="meta")
    return Kernel.of(workspace.CONVOLUTION, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))


def test_the_workspace_is_the_peak_above_the_output_with_cudnn_pinned(fake_cuda):
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    k = small_kernel()
    held = k.held_on_cuda(cpu_tensor)
    assert held == WORKSPACE_PER_POSITION * k.positions  # not the output, which the call returns
    assert fake_cuda.seen_flags and all(flags == (False, True) for flags in fake_cuda.seen_flags)
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == before  # restored


def test_a_large_kernel_is_run_smaller_and_extrapolated(fake_cuda):
    k = small_kernel((512, 512))
    measured = CUDAWorkspace(cpu_tensor).measure(k)
    assert len(measured.runs) > 1 and max(max(r) for r in measured.runs) < 512
    assert measured.bytes == pytest.approx(WORKSPACE_PER_POSITION * k.positions, rel=0.01)


def test_a_plan_for_cuda_counts_it_only_where_a_gpu_is_visible(fake_cuda, monkeypatch):
    model, field = plan.conv_model(2, width=8, depth=2), (1, 1, 64, 64)
    monkeypatch.setattr(workspace.Kernel, "held_on_cuda",
                        lambda self, materialize=None: WORKSPACE_PER_POSITION * self.positions)
    monkeypatch.setattr(plan.planner, "gpu_visible", lambda: True)
    on_gpu = plan.Planner(model, field)  # device="cuda", a GPU visible (simulated)
    assert isinstance(on_gpu.workspace, CUDAWorkspace)
    with_workspace = on_gpu.plan(1, 2)
    monkeypatch.setattr(plan.planner, "gpu_visible", lambda: False)
    without = plan.Planner(model, field).plan(1, 2)
    biggest = WORKSPACE_PER_POSITION * 64 * 32  # a rank's convolution of 32 rows of 64 (halo rows add a few)
    for a, b in zip(with_workspace.rows, without.rows):
        assert 0 < a.peak - b.peak <= biggest * 1.2, (a.peak, b.peak)
    assert any(note.startswith("cuDNN:") for note in with_workspace.notes)
    assert not any(note.startswith("cuDNN:") for note in without.notes)
    cpu = plan.Planner(model, field, device="cpu").workspace
    assert type(cpu).__name__ == "CPUWorkspace"  # CPU ranks keep measuring this CPU's kernels, never cuDNN
