"""Memory and numerics on a rank: the bytes a tensor, model, state or step holds; peaks; strict fp32; how far apart.

Introduced in ``notebooks/01_launchers.ipynb``; figures are taken live, side by side in one run.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..mesh import domain_source
from .allocations import cpu_allocator_changes

# PhysicsNeMo is imported inside the functions that use it: the byte arithmetic also runs in
# the notebook kernel, which need not pay its import.


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def shard_bytes(t) -> int:
    """Bytes of the elements this rank sees of a tensor: its local shard (a ShardTensor's or DTensor's), else the
    tensor. Not always what the rank holds: a shard can be a view of a larger buffer (``held_bytes``)."""
    local = _local(t)
    return local.numel() * local.element_size()


def held_bytes(*tensors) -> int:
    """Bytes this rank holds for ``tensors``: the storage behind each local shard, each storage once. More than
    ``shard_bytes`` when a shard is a view of a larger buffer: ``scatter_tensor``'s shard of a one-channel field split
    along H is a slice of the whole broadcast field, which stays allocated as long as the shard lives
    (notebook 03); an FSDP2 shard is a slice of its padded buffer."""
    storages = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """Bytes of this rank's shards of the parameters, gradients and optimizer state (``shard_bytes``: the local
    shards' elements, which the planner predicts; ``held_bytes`` adds FSDP2's padding)."""
    params = list(model.parameters())
    out = {
        "parameters": sum(shard_bytes(p) for p in params),
        "gradients": sum(shard_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer state": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer state"] += sum(shard_bytes(v) for v in state.values() if hasattr(v, "numel"))
    return out


def synchronize(device) -> None:
    """Wait for the device to finish its queued work (a no-op on CPU): timings and peaks need it on GPUs."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device) -> None:
    """Free what earlier work left behind before a measurement starts: ``gc.collect()``, and on a GPU
    ``torch.cuda.empty_cache()``. One case's garbage then neither counts in the next one's starting bytes nor is
    freed in the middle of its window, and each case starts from an empty cache."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class DevicePeak:
    """The CUDA caching allocator's peak on this rank's GPU inside ``with``, counted as ``AllocatorPeak`` counts it
    on a CPU rank: ``peak`` is the most bytes allocated at once inside the block minus what was allocated on entry,
    plus ``held_at_start``, the bytes the caller knows were allocated before and belong to the work (for example the
    model's parameters). Tensors left from earlier cells were allocated on entry, so they are not counted.

    On a GPU it frees what earlier work left (``release_memory``), reads ``memory_allocated`` and resets the peak
    counters on entry, and reads them on exit (``measured`` is True). ``peak_above_start`` is what the block itself
    added; ``peak_allocated`` and ``peak_reserved`` are the process's own ``max_memory_allocated`` and
    ``max_memory_reserved`` over the block, earlier cells' tensors included. On a CPU rank there is no allocator to
    read: ``measured`` is False and the byte counts of ``SavedActivations`` and ``state_bytes`` are what a GPU figure
    is later checked against.
    """

    def __init__(self, device, held_at_start: int = 0):
        self.device = torch.device(device)
        self.held_at_start = held_at_start
        self.measured = self.device.type == "cuda"
        self.start_allocated = self.peak_allocated = self.peak_reserved = 0

    def __enter__(self):
        if self.measured:
            release_memory(self.device)
            synchronize(self.device)
            self.start_allocated = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.measured:
            synchronize(self.device)
            self.peak_allocated = torch.cuda.max_memory_allocated(self.device)
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)

    @property
    def peak_above_start(self) -> int:
        """Bytes allocated at the peak beyond what was allocated on entry: what the region itself needed."""
        return self.peak_allocated - self.start_allocated

    @property
    def peak(self) -> int | None:
        """``peak_above_start`` plus ``held_at_start``: the quantity ``AllocatorPeak`` reports (None on CPU)."""
        return self.peak_above_start + self.held_at_start if self.measured else None

    def as_row(self) -> dict:
        return {"measured": self.measured, "peak allocated": self.peak_allocated,
                "peak above start": self.peak_above_start, "peak": self.peak, "peak reserved": self.peak_reserved}


class AllocatorPeak:
    """The allocator's peak bytes on this rank over a ``window()`` inside ``with``: what a training step really held
    at its most, taken from the allocator alone (no byte model). The same quantity on both devices: the most bytes
    live at once during the window, counting from the start of ``with``, plus what was allocated before it and
    belongs to the work: ``held_at_start`` bytes, or the tensors ``held`` (e.g. the model's parameters), whose frees
    inside ``with`` are then subtracted (FSDP2 frees the full parameters it shards). What else the process held on
    entry (tensors of earlier cells or cases) does not count. Both start with ``release_memory``.

    On a GPU: ``torch.cuda.max_memory_allocated`` over the window (its counters reset as the window opens) minus
    ``memory_allocated`` at the start of ``with``. On a CPU rank: torch.profiler's memory events (every allocation and
    free the CPU allocator makes, kernels' own buffers included), summed in time order from the start of ``with``;
    no free of a block allocated before it started is counted (``measure.allocations.cpu_allocator_changes``), so each
    ``held`` storage's free is marked in the profile when it happens (``weakref.finalize``). ``peak`` is None until
    the window has closed."""

    WINDOW = "shardlab: measured window"
    FREED = "shardlab: held storage freed, bytes="

    def __init__(self, device, held_at_start: int = 0, held=()):
        self.device = torch.device(device)
        self.held_at_start = held_at_start
        self.peak: int | None = None
        self._profile = None
        self._start = 0
        self._held = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in held}
        self.held_at_start += sum(storage.nbytes() for storage in self._held.values())
        self._watching: list = []

    def _freed(self, nbytes: int) -> None:
        with torch.profiler.record_function(f"{self.FREED}{nbytes}"):
            pass

    def __enter__(self):
        release_memory(self.device)
        if self.device.type == "cuda":
            synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
            self._watching = [weakref.finalize(storage, self._freed, storage.nbytes())
                              for storage in self._held.values()]
        self._held.clear()  # only weak references to the storages are left here: the work may free them
        return self

    @contextlib.contextmanager
    def window(self):
        if self._profile is not None:
            with torch.profiler.record_function(self.WINDOW):
                yield
            return
        if self.device.type != "cuda":  # no allocator this class reads: no peak
            yield
            return
        synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self._start + self.held_at_start

    def __exit__(self, *exc):
        if self._profile is None:
            return
        for watch in self._watching:
            watch.detach()
        self._profile.__exit__(*exc)
        if exc[0] is not None:  # the work failed: its error, not a missing window, is what the caller sees
            return
        events = list(self._profile.profiler.kineto_results.events())
        start, end = next((e.start_ns(), e.end_ns()) for e in events if e.name() == self.WINDOW)
        changes = cpu_allocator_changes(self._profile)
        changes += [(e.start_ns(), -int(e.name().removeprefix(self.FREED))) for e in events
                    if e.name().startswith(self.FREED)]
        live, peak = self.held_at_start, None
        for at, nbytes in sorted(changes, key=lambda change: change[0]):
            live += nbytes
            if start <= at <= end:
                peak = max(live, peak or live)
        self.peak = peak


@contextlib.contextmanager
def fp32_precision(precision: str):
    """Inside ``with``: fp32 matmuls and cuDNN convolutions in ``precision`` ("ieee": full fp32, "tf32"), restored on
    exit. Only the ``fp32_precision`` API: torch 2.14 raises about "a mix of the legacy and new APIs" when the
    legacy ``allow_tf32`` flags are read after anything set the new one (the flags exist without a GPU)."""
    flags = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    saved = [flag.fp32_precision for flag in flags]
    for flag in flags:
        flag.fp32_precision = precision
    try:
        yield
    finally:
        for flag, before in zip(flags, saved):
            flag.fp32_precision = before


def strict_fp32():
    """Inside ``with``: full fp32 matmuls and convolutions (no TF32), restored on exit.

    Recent GPUs run fp32 convolutions (and, if enabled, matmuls) in TF32, about 1e-3 relative: an
    assert at 1e-5 between a sharded and a single-device result would compare TF32 rounding. CPUs
    have no TF32, so the same cell runs unchanged on CPU ranks.
    """
    return fp32_precision("ieee")


class SavedActivations:
    """Bytes autograd saves for backward inside ``with`` (unique tensors, parameters excluded; each tensor's elements,
    as the planner counts them: a saved view of a larger buffer keeps all of it, which ``AllocatorPeak`` sees).

    On CPU this is the activation memory a backward pass will need; on GPU compare it with
    ``torch.cuda.max_memory_allocated``. ``counted`` lists (local shape, bytes) of every tensor counted, in order.
    """

    def __init__(self, exclude=()):
        self._excluded: dict[int, list[weakref.ref]] = {}  # data_ptr -> the storages excluded there
        self._seen: set[tuple[int, tuple]] = set()
        self.bytes = 0
        self.tensors = 0
        self.counted: list[tuple[tuple[int, ...], int]] = []
        self.exclude(exclude)

    def exclude(self, tensors) -> None:
        """Never count these tensors (nor views sharing their first element) while their memory lives: for example
        the parameters FSDP2 gathers for a layer just before it runs (from a forward pre-hook). Once that memory is
        given back, the address no longer excludes: an activation the allocator puts there later is counted."""
        for t in tensors:
            self._excluded.setdefault(t.data_ptr(), []).append(weakref.ref(t.untyped_storage()))

    def _is_excluded(self, ptr: int) -> bool:
        # A storage can give its memory back and live on: FSDP2 reshards a layer's gathered parameters by resizing
        # their storage to 0 bytes. So the address must still lie inside a live excluded storage, not only have been
        # excluded once.
        return any((s := ref()) is not None and s.data_ptr() <= ptr < s.data_ptr() + s.nbytes()
                   for ref in self._excluded.get(ptr, ()))

    def _pack(self, t):
        local = _local(t)
        key = (local.data_ptr(), tuple(local.shape))
        if key not in self._seen and not self._is_excluded(local.data_ptr()):
            self._seen.add(key)
            self.bytes += shard_bytes(local)
            self.tensors += 1
            self.counted.append((tuple(local.shape), shard_bytes(local)))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class CollectiveBytes(TorchDispatchMode):
    """Counts collectives and the bytes of the tensors handed to them, plus the largest tensor seen."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

    def __init__(self):
        super().__init__()
        self.ops: dict[str, dict[str, int]] = {}
        self.largest_tensor_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            self.largest_tensor_bytes = max(self.largest_tensor_bytes, t.numel() * t.element_size())
        if func.namespace in self.NAMESPACES and not func.__name__.startswith(("wait_tensor", "_wrap")):
            name = str(func.overloadpacket).split(".")[-1]
            entry = self.ops.setdefault(name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            entry["bytes"] += sum(t.numel() * t.element_size() for t in inputs)
        return out


def collective_bytes() -> CollectiveBytes:
    """A ``with`` block that records, on this rank, each collective's calls and input bytes
    (``.ops``) and the largest tensor any op touched (``.largest_tensor_bytes``)."""
    return CollectiveBytes()


def activation_bytes_by_domain_size(model, field, sizes=(1, 2, 4), dim: int = 2, peaks: dict | None = None
                                    ) -> dict[int, int]:
    """On this rank: bytes saved for backward by ``model(field)`` with the field sharded over N domain ranks.

    Call on every rank together; for each N it builds a (world/N, N) mesh on the field's device and
    scatters the field along ``dim`` (N = 1 runs the plain tensor). Pass a dict as ``peaks`` to also
    get, per N, the CUDA allocator's peak around the forward (``DevicePeak.as_row()``; not measured on CPU).
    """
    from physicsnemo.domain_parallel import scatter_tensor

    world = dist.get_world_size()
    result = {}
    for n in sizes:
        if world % n:
            raise ValueError(f"domain size {n} does not divide the world size {world}")
        if n == 1:
            x = field.clone()
        else:
            mesh = init_device_mesh(field.device.type, (world // n, n), mesh_dim_names=("ddp", "domain"))
            x = scatter_tensor(field, domain_source(mesh), mesh["domain"], (Shard(dim),))
        with DevicePeak(field.device) as peak, SavedActivations(exclude=model.parameters()) as saved:
            model(x)
        result[n] = saved.bytes
        if peaks is not None:
            peaks[n] = peak.as_row()
    return result


def ideal_activation_ratio(n: int, height: int, kernel_size: int) -> float:
    """1/N of the rows, plus the k//2 halo rows on each side that a sharded conv input carries."""
    return 1.0 if n == 1 else 1.0 / n + 2 * (kernel_size // 2) / height


def max_diff_to_source(module, group, src: int) -> float:
    """Largest |value − value on the source rank| over a module's parameters and buffers, across ``group``.

    Every rank of the group gets the same answer (0.0 means the module is in sync).
    """
    worst = 0.0
    for t in [*module.parameters(), *module.buffers()]:
        ref = t.detach().clone()
        dist.broadcast(ref, src=src, group=group)
        worst = max(worst, (t.detach().float() - ref.float()).abs().max().item())
    device = next(iter([*module.parameters(), *module.buffers()])).device
    worst = torch.tensor([worst], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return worst.item()


def relative_error(got, want, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, ``floor``), in float64 (``got`` gathered first when it is sharded); inf
    where the shapes differ. Parity's measure (``sl.parity``) and the judges' (``sl.exercises``)."""
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    scale = max(want.abs().max().item(), floor) or 1.0
    return (got.double() - want.double()).abs().max().item() / scale
