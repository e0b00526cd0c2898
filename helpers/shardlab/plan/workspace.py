"""What a CPU convolution holds inside its kernel, on this CPU: measured, not modelled.

``CPUWorkspace`` runs each convolution kernel of a plan on this CPU (at a smaller size, extrapolated, when it is large)
and keeps what it held above its outputs; ``CUDAWorkspace`` does the same on a visible GPU for cuDNN's workspace.
Why measured, and how the extrapolation and the GPU's measurement work: docs/planner.md#convolution-workspaces-measured.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_flatten

from ..measure.allocations import cpu_allocator_changes
from .records import CUDNN_PINNED

CONVOLUTION = torch.ops.aten.convolution.default
CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
RUN_POSITIONS = 4096  # a larger kernel is run at about this many output positions (the smallest of its runs)
MIN_EXTENT = 16  # nor shorter than this along any dim: oneDNN blocks rows and may take another path for very few


@contextlib.contextmanager
def pinned_cudnn():
    """Inside ``with``: cuDNN's convolution engines chosen as ``records.CUDNN_PINNED`` says (benchmark off,
    deterministic engines only), each setting restored on exit. The flags exist without a GPU (no effect on CPU)."""
    cudnn = torch.backends.cudnn
    saved = {name: getattr(cudnn, name) for name in CUDNN_PINNED}
    try:
        for name, value in CUDNN_PINNED.items():
            setattr(cudnn, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(cudnn, name, value)


def conv_output_shape(inp, weight, stride, padding, dilation) -> list[int]:
    return [(size + 2 * pad - dil * (k - 1) - 1) // st + 1
            for size, k, st, pad, dil in zip(inp.shape[2:], weight.shape[2:], stride, padding, dilation)]


@dataclass(frozen=True)
class Kernel:
    """One convolution as the dispatcher receives it: forward (``aten.convolution``) or backward."""

    backward: bool
    inp: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | list | None  # forward: the bias tensor; backward: the bias sizes
    grad_output: torch.Tensor | None
    rest: tuple  # stride, padding, dilation, transposed, output_padding, groups (, output_mask)

    @classmethod
    def of(cls, func, args) -> Kernel | None:
        if func is CONVOLUTION:
            return cls(False, args[0], args[1], args[2], None, tuple(args[3:9]))
        if func is CONVOLUTION_BACKWARD:
            return cls(True, args[1], args[2], args[3], args[0], tuple(args[4:11]))
        return None

    @property
    def spatial(self) -> tuple[int, ...]:
        return tuple(self.inp.shape[2:])

    @property
    def positions(self) -> int:
        """Output positions, over the batch."""
        return self.inp.shape[0] * math.prod(conv_output_shape(self.inp, self.weight, *self.rest[:3]))

    def key(self, threads: int) -> tuple:
        def sig(a):
            if isinstance(a, torch.Tensor):
                return tuple(a.shape), a.stride(), a.dtype
            return tuple(a) if isinstance(a, list) else a

        return (self.backward, sig(self.inp), sig(self.weight), sig(self.bias), sig(self.grad_output),
                tuple(map(sig, self.rest)), threads)

    def smallest_extents(self) -> tuple[int, ...]:
        """Per spatial dim, the smallest input extent with one output position."""
        _, padding, dilation = self.rest[:3]
        return tuple(max(1, d * (k - 1) + 1 - 2 * p) for k, p, d in zip(self.weight.shape[2:], padding, dilation))

    def backend(self) -> str:
        """The backend torch selects for these shapes on this CPU, asked with zero-stride stand-ins (no field-sized
        buffer is allocated; the choice reads shapes, dtype and device only)."""
        def stand_in(t):
            return torch.zeros((), dtype=t.dtype).expand(t.shape)

        bias_sizes = self.bias if self.backward else None
        bias = None if self.backward or self.bias is None else stand_in(self.bias)
        chosen = torch._C._select_conv_backend(stand_in(self.inp), stand_in(self.weight), bias, *self.rest[:6],
                                               bias_sizes)
        return chosen.name

    def resized(self, spatial: tuple[int, ...]) -> Kernel:
        """The same kernel on an input of these spatial extents (and the incoming gradient to match)."""
        inp = torch.empty((*self.inp.shape[:2], *spatial), dtype=self.inp.dtype, device="meta")
        grad = None
        if self.backward:
            out = conv_output_shape(inp, self.weight, *self.rest[:3])
            grad = torch.empty((*self.grad_output.shape[:2], *out), dtype=self.grad_output.dtype, device="meta")
        return replace(self, inp=inp, grad_output=grad)

    def _call(self):
        if self.backward:
            return CONVOLUTION_BACKWARD, (self.grad_output, self.inp, self.weight, self.bias, *self.rest)
        return CONVOLUTION, (self.inp, self.weight, self.bias, *self.rest)

    def held_on_cuda(self, materialize=None) -> int:
        """Bytes cuDNN held for the call above what it returns, on the current GPU, with cuDNN pinned: the engine is
        built on a first call, then the allocator's peak is read over a second (``materialize``: how a meta argument
        becomes a GPU tensor; a test passes its own)."""
        materialize = materialize or (lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                    device="cuda").normal_())
        func, args = self._call()
        args = [materialize(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pinned_cudnn():
            func(*args)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = func(*args)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
        returned = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return max(0, peak - returned)

    def held_inside(self, threads: int) -> int:
        """Bytes the kernel held at its most above what it returns, on this CPU with ``threads`` intra-op threads:
        run once (oneDNN makes and caches its primitive), then again under torch.profiler's memory events."""
        from torch.profiler import ProfilerActivity, profile

        def real(a):
            if not isinstance(a, torch.Tensor):
                return a
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).normal_()

        func, args = self._call()
        args = [real(a) for a in args]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            func(*args)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = func(*args)
        finally:
            torch.set_num_threads(before)
        del out
        live = peak = 0
        for _, nbytes in cpu_allocator_changes(prof):
            live += nbytes
            peak = max(peak, live)
        return max(0, peak - live)


def run_extents(kernel: Kernel, positions: int, dims: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """Per spatial dim, the input extents to run ``kernel`` at so that the smallest run has about ``positions``
    output positions, shrinking only ``dims``: two extents (the second twice the first) where the kernel has more
    than twice as many, else its own. None when no dim would be run smaller."""
    factor = (positions / kernel.positions) ** (1 / len(dims))
    extents = []
    for dim, (size, least) in enumerate(zip(kernel.spatial, kernel.smallest_extents())):
        low = max(least, MIN_EXTENT, round(size * factor))
        extents.append((low, 2 * low) if dim in dims and 2 * low < size else (size,))
    return extents if any(len(e) == 2 for e in extents) else None


def run_plans(kernel: Kernel):
    """The extents to try, smallest runs first; at each size, every dim shrunk first, then fewer of them (torch
    picks the backend from some dims only: a Conv3d's depth and height, not its width)."""
    positions, spatial = RUN_POSITIONS, range(len(kernel.spatial))
    while 2 * positions < kernel.positions:
        for count in range(len(kernel.spatial), 0, -1):
            for dims in itertools.combinations(spatial, count):
                extents = run_extents(kernel, positions, dims)
                if extents is not None:
                    yield extents
        positions *= 2


def extrapolate(extents: list[tuple[int, ...]], values: dict[tuple, int], spatial: tuple[int, ...]) -> float:
    """The multilinear function through ``values`` (one per combination of ``extents``) at ``spatial``."""
    total = 0.0
    for corner, value in values.items():
        weight = 1.0
        for at, pair, x in zip(corner, extents, spatial):
            if len(pair) == 2:
                t = (x - pair[0]) / (pair[1] - pair[0])
                weight *= t if at == pair[1] else 1 - t
        total += weight * value
    return total


@dataclass
class Measured:
    """A kernel's workspace and how it was found: run at its own size, or extrapolated from smaller runs."""

    backend: str
    bytes: int
    runs: list[tuple[int, ...]]  # the input extents it was run at


_MEASURED: dict[tuple, Measured] = {}  # per process: kernels already measured, by shapes, dtypes and threads


class CPUWorkspace:
    """``workspace(func, args)`` for ``trace.LiveBytes``: the bytes a CPU convolution holds inside the kernel on this
    CPU with ``threads`` intra-op threads (default: this process's), measured once per kernel signature."""

    label = "CPU kernels"

    def __init__(self, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self.kernels: dict[tuple, Measured] = {}  # what this planner's traces ran, for its report

    def __call__(self, func, args) -> int:
        kernel = Kernel.of(func, args)
        if kernel is None:
            return 0
        key = kernel.key(self.threads)
        if key not in _MEASURED:
            _MEASURED[key] = self.measure(kernel)
        self.kernels[key] = _MEASURED[key]
        return _MEASURED[key].bytes

    def measure(self, kernel: Kernel) -> Measured:
        backend = kernel.backend()
        for extents in ([] if kernel.rest[3] else run_plans(kernel)):  # transposed kernels: run at their size
            runs = [kernel.resized(corner) for corner in itertools.product(*extents)]
            if all(run.backend() == backend for run in runs):  # torch picks by size: every run must take this path
                values = {run.spatial: run.held_inside(self.threads) for run in runs}
                estimate = extrapolate(extents, values, kernel.spatial)
                return Measured(backend, max(0, round(estimate)), list(values))
        return Measured(backend, kernel.held_inside(self.threads), [kernel.spatial])

    def summary(self) -> str:
        """One line: which kernels this CPU ran for the plan, and how their workspaces were found."""
        if not self.kernels:
            return "no convolution: no kernel workspace"
        backends = sorted({m.backend for m in self.kernels.values()})
        scaled = sum(len(m.runs) > 1 for m in self.kernels.values())
        return (f"{len(self.kernels)} convolution kernel(s) run on this CPU ({', '.join(backends)}; "
                f"{torch.backends.cpu.get_cpu_capability()}, {self.threads} thread(s)), {scaled} of them at smaller "
                "sizes and extrapolated")


class CUDAWorkspace(CPUWorkspace):
    """``workspace(func, args)`` on CUDA: the workspace of the engine cuDNN selects for each convolution, measured on
    this machine's current GPU (see the module's docstring), at a smaller size and extrapolated when it is large."""

    label = "cuDNN"

    def __init__(self, materialize=None):
        super().__init__(threads=1)
        self.materialize = materialize

    def __call__(self, func, args) -> int:
        kernel = Kernel.of(func, args)
        if kernel is None:
            return 0
        key = ("cuda", *kernel.key(0))
        if key not in _MEASURED:
            _MEASURED[key] = self.measure(kernel)
        self.kernels[key] = _MEASURED[key]
        return _MEASURED[key].bytes

    def measure(self, kernel: Kernel) -> Measured:
        for extents in ([] if kernel.rest[3] else run_plans(kernel)):
            runs = [kernel.resized(corner) for corner in itertools.product(*extents)]
            values = {run.spatial: run.held_on_cuda(self.materialize) for run in runs}
            return Measured("cudnn", max(0, round(extrapolate(extents, values, kernel.spatial))), list(values))
        return Measured("cudnn", kernel.held_on_cuda(self.materialize), [kernel.spatial])

    def summary(self) -> str:
        if not self.kernels:
            return "no convolution: no cuDNN workspace"
        scaled = sum(len(m.runs) > 1 for m in self.kernels.values())
        return (f"{len(self.kernels)} cuDNN convolution(s) run on this GPU with benchmark off and deterministic "
                f"engines, their workspaces measured ({scaled} at smaller sizes and extrapolated)")
