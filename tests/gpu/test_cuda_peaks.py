"""The allocator's peak on CUDA, measured as on CPU, and cuDNN pinned where the planner's peak is checked: with
torch.cuda's memory counters SIMULATED (a fake allocator the test drives), no GPU needed.

``AllocatorPeak`` (and ``DevicePeak``) report the bytes a block itself held at its most, above what was allocated
when it began, plus ``held_at_start``: tensors earlier cells left are not counted, on a GPU as on a CPU rank, and
both start by freeing what earlier work left. ``measure_rank`` runs with cuDNN's engine choice pinned and restored;
``LEFT_OUT`` says what is pinned and why cuDNN's and cuBLAS's workspaces are not in the plan."""

import contextlib
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardlab import plan
from shardlab.measure.memory import AllocatorPeak, DevicePeak
from shardlab.models import conv_stack
from shardlab.plan import records
from shardlab.train import Levers, training_step, use_checkpointing

MIB = 2**20


class FakeCudaAllocator:
    """torch.cuda's memory counters, driven by ``alloc(n)`` and ``free(n)``: ``memory_allocated``,
    ``max_memory_allocated`` since the last ``reset_peak_memory_stats`` (which, as the caching allocator's does, sets
    the peak to what is allocated now), and ``empty_cache`` calls counted."""

    def __init__(self, monkeypatch):
        self.allocated = self.peak = self.emptied = 0
        fake = {"memory_allocated": lambda device=None: self.allocated,
                "max_memory_allocated": lambda device=None: self.peak,
                "max_memory_reserved": lambda device=None: self.peak,
                "reset_peak_memory_stats": self._reset, "empty_cache": self._empty,
                "synchronize": lambda device=None: None, "is_available": lambda: True}
        for name, function in fake.items():
            monkeypatch.setattr(torch.cuda, name, function)

    def _reset(self, device=None):
        self.peak = self.allocated

    def _empty(self):
        self.emptied += 1

    def alloc(self, n: int) -> int:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        return n

    def free(self, n: int) -> None:
        self.allocated -= n


@pytest.fixture
def cuda(monkeypatch):
    return FakeCudaAllocator(monkeypatch)


def test_on_cuda_the_peak_leaves_out_what_earlier_cells_left(cuda):
    earlier, params, state, activations = 40 * MIB, 3 * MIB, 5 * MIB, 7 * MIB
    cuda.alloc(earlier)  # an earlier cell's tensors, still alive
    cuda.free(cuda.alloc(100 * MIB))  # and an earlier spike: reset on entry
    cuda.alloc(params)  # the model, allocated before the measurement begins
    with AllocatorPeak("cuda", held_at_start=params) as allocator:
        cuda.alloc(state)  # wrapping the model, the warm-up step's gradients and optimizer state
        with allocator.window():
            cuda.free(cuda.alloc(activations))
    assert allocator.peak == params + state + activations  # was earlier + params + state + activations

    with DevicePeak("cuda", held_at_start=params) as peak:
        cuda.free(cuda.alloc(activations))
    assert peak.measured and peak.peak_above_start == activations and peak.peak == params + activations
    assert peak.peak_allocated == earlier + params + state + activations  # the process's own figure, named so
    assert peak.as_row()["peak"] == params + activations
    assert DevicePeak("cpu", held_at_start=params).peak is None  # nothing to read on a CPU rank


class Tensors:
    """Allocations on the CPU (real tensors, which the profiler sees) or on the simulated GPU, by name."""

    def __init__(self, cuda: FakeCudaAllocator | None):
        self.cuda, self.held = cuda, {}

    def alloc(self, name: str, n: int) -> None:
        self.held[name] = torch.empty(n, dtype=torch.uint8) if self.cuda is None else self.cuda.alloc(n)

    def free(self, name: str) -> None:
        held = self.held.pop(name)
        if self.cuda is not None:
            self.cuda.free(held)


def allocation_pattern(tensors: Tensors, device: str) -> int:
    """What a measured step does to memory: an earlier cell's tensors, the model (held from the start, part of which
    the step frees, as FSDP2 frees the full parameters it shards), state made before the window, and the window. The
    model is handed over as tensors on the CPU (the profiler cannot see a free of what it did not see allocated), as
    bytes on the simulated GPU (whose allocator sees every free)."""
    tensors.alloc("earlier cell", 6 * MIB)
    tensors.alloc("parameters", 2 * MIB)
    tensors.alloc("replaced parameters", MIB)
    if tensors.cuda is None:
        model = {"held": [tensors.held["parameters"], tensors.held["replaced parameters"]]}
    else:
        model = {"held_at_start": 3 * MIB}
    with AllocatorPeak(device, **model) as allocator:
        del model
        tensors.alloc("optimizer state", 4 * MIB)
        with allocator.window():
            tensors.free("replaced parameters")
            tensors.alloc("activations", 8 * MIB)
            tensors.alloc("gradient", 2 * MIB)
            tensors.free("activations")
            tensors.free("gradient")
    return allocator.peak


def test_cpu_and_cuda_report_the_same_quantity_for_the_same_allocations(cuda):
    expected = 3 * MIB + 4 * MIB - MIB + 8 * MIB + 2 * MIB  # held, state, freed, then the window's most
    on_cuda = allocation_pattern(Tensors(cuda), "cuda")  # max_memory_allocated, simulated
    assert on_cuda == expected  # was the process's max_memory_allocated: 6 MiB more
    on_cpu = allocation_pattern(Tensors(None), "cpu")  # torch.profiler's memory events
    assert abs(on_cpu - expected) <= 64 * 1024, on_cpu  # the profiler's own bookkeeping: a few bytes at most
    # Given as bytes, the model's freed 1 MiB stays counted: the profiler missed the free (2 + 1 + 4 + 8 MiB).
    assert abs(held_as_bytes_on_cpu() - 15 * MIB) <= 64 * 1024


def held_as_bytes_on_cpu() -> int:
    tensors = Tensors(None)
    tensors.alloc("parameters", 2 * MIB)
    tensors.alloc("replaced parameters", MIB)
    with AllocatorPeak("cpu", held_at_start=3 * MIB) as allocator:
        tensors.alloc("optimizer state", 4 * MIB)
        with allocator.window():
            tensors.free("replaced parameters")
            tensors.alloc("activations", 8 * MIB)
            tensors.free("activations")
    return allocator.peak


def test_each_measurement_first_frees_what_earlier_work_left(cuda):
    """Garbage from an earlier case (a reference cycle holding GPU memory) is collected on entry: counted in the
    starting bytes but freed inside the window, it would hide the window's own peak."""

    class Cycle:
        def __init__(self, n):
            self.n, self.me = cuda.alloc(n), self

        def __del__(self):
            cuda.free(self.n)

    for measure in (AllocatorPeak, DevicePeak):
        gc.disable()  # the cycle stays until someone collects it
        try:
            Cycle(20 * MIB)
            emptied = cuda.emptied
            with measure("cuda") as peak:
                with peak.window() if measure is AllocatorPeak else contextlib.nullcontext():
                    gc.collect()  # were it still there, here it would go
                    cuda.free(cuda.alloc(5 * MIB))
        finally:
            gc.enable()
        assert cuda.emptied == emptied + 1 and cuda.allocated == 0
        assert peak.peak == 5 * MIB


def test_measured_steps_run_with_cudnn_pinned_and_restore_it(monkeypatch):
    """``measure_rank`` (every case of ``measure_cases``, notebooks 09 and 11) runs with ``CUDNN_PINNED`` and gives
    back the settings it found, also when the step fails."""
    cudnn = torch.backends.cudnn
    for name in ("enabled", "benchmark", "deterministic"):
        monkeypatch.setattr(cudnn, name, getattr(cudnn, name))  # whatever this test sets is undone after it
    cudnn.benchmark, cudnn.deterministic = True, False  # what a user's notebook may have chosen
    seen = {}

    class Stop(Exception):
        pass

    class Measurement:  # stands in for AllocatorPeak: the step's measurement starts, sees the flags, stops
        def __init__(self, *args, **kwargs):
            seen.update({name: getattr(cudnn, name) for name in ("enabled", "benchmark", "deterministic")})
            raise Stop

    monkeypatch.setattr("shardlab.measure.memory.AllocatorPeak", Measurement)
    model = conv_stack(width=4, layers=2)
    samples = (torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8))
    with pytest.raises(Stop):
        plan.measure_rank(model, mesh=None, wrapper="none", samples=samples)
    assert seen == {"enabled": True, "benchmark": False, "deterministic": True}  # was what the user had chosen
    assert records.CUDNN_PINNED == seen  # what LEFT_OUT says is pinned
    assert (cudnn.benchmark, cudnn.deterministic) == (True, False)


def test_what_is_left_out_says_what_is_pinned_and_where_the_workspaces_go():
    by_what = {item["what"]: item for item in plan.LEFT_OUT}
    conv = by_what["cuDNN convolution workspaces"]
    assert all(f"{name}={value}" in conv["typical"] for name, value in records.CUDNN_PINNED.items())
    assert "max_memory_allocated" in conv["typical"] and "Conv_v8.cpp" in conv["source"]
    blas = by_what["cuBLAS workspaces"]
    assert "CUBLAS_WORKSPACE_CONFIG" in blas["typical"] and "CublasHandlePool.cpp" in blas["source"]
    for item in (conv, blas):  # inside the allocator's peak, but no bytes of headroom of their own
        assert item["bytes"] == 0 and item["source"].startswith(records.TORCH_SOURCE)


BLAS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
        "_addmm_activation"}


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_the_peak_cases_conv_stacks_call_no_cublas():
    """What ``LEFT_OUT`` says of cuBLAS's workspace: a training step of each peak case's model (forward, loss,
    backward, Adam), with its checkpointing and autocast, dispatches no matrix product. aten's ops are the same on
    every device: what runs below them (cuDNN on a GPU) is chosen per device."""
    seen = set()
    for case in plan.peak_cases(4):
        shape = [1, 1, *[min(size, 16) for size in case["field"][2:]]]
        model = conv_stack(**plan.validate.conv_stack_kwargs(case["model"]), dims=len(shape) - 2)
        levers = plan.validate.case_levers(case)
        if levers.checkpoint:
            model = use_checkpointing(model)
        step_levers = Levers(checkpoint=levers.checkpoint, autocast=levers.autocast)
        optimizer = torch.optim.Adam(model.parameters())
        x, y = torch.randn(shape), torch.randn(shape)
        with OpNames() as ops:
            for _ in range(2):  # the second step has gradients and Adam's state
                training_step(model, optimizer, lambda x=x, y=y: (x, y), levers=step_levers)
        seen |= ops.names
    assert "convolution" in seen and "convolution_backward" in seen
    assert not seen & BLAS, seen & BLAS


def test_peak_cases_scale_only_the_activation_heavy_configurations():
    """At ``make gpu-check``'s 16x, the state-heavy cases keep the size at which their state weighs in the peak."""
    small, large = plan.peak_cases(2), plan.peak_cases(2, scale=16)
    state_share = {}
    for before, after in zip(small, large):
        heavy = "state-heavy" in before["name"]
        assert after["field"][2:] == [s * (1 if heavy else 16) for s in before["field"][2:]], after
        row = max(plan.predict_case(after, "cuda").rows, key=lambda r: r.peak)
        state_share[after["name"]] = ((row.params + row.grads + row.optimizer + row.buffers) / row.peak, heavy)
    heavy = [share for share, is_heavy in state_share.values() if is_heavy]
    light = [share for share, is_heavy in state_share.values() if not is_heavy]
    assert len(heavy) == 2 and min(heavy) > 0.1 > 0.01 > max(light), state_share


def tensor_at_an_address_the_reporter_remembers(size: int) -> torch.Tensor | None:
    """A tensor allocated with no profiler running where an earlier measurement's tensor was, whose size torch's CPU
    memory reporter still holds (it was freed between measurements); None if the allocator never reused the address.
    ``size`` is mapped on its own: freed and allocated again, it usually comes back at the same address."""
    for _ in range(10):
        with AllocatorPeak("cpu") as earlier, earlier.window():
            seen = torch.empty(size, dtype=torch.uint8)
        address = seen.data_ptr()
        del seen
        tensor = torch.empty(size, dtype=torch.uint8)
        if tensor.data_ptr() == address:
            return tensor
    return None


def test_a_held_tensor_at_an_address_an_earlier_profile_saw_is_subtracted_once():
    parameters = tensor_at_an_address_the_reporter_remembers(64 * MIB)
    if parameters is None:
        pytest.skip("this allocator never gave the same address twice: nothing to observe")
    with AllocatorPeak("cpu", held=[parameters]) as allocator, allocator.window():
        del parameters  # freed inside the step, as FSDP2 frees the full parameters it shards
        activations = torch.empty(70 * MIB, dtype=torch.uint8)
        del activations
    assert allocator.peak == 70 * MIB  # 64 MiB held, freed once, then 70 MiB: was 6 MiB (the 64 MiB freed twice)
