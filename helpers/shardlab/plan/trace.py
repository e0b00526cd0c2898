"""Tracing on the meta device: one rank's training step replayed on shapes alone.

``trace_rank`` runs ``sl.train.training_step`` itself (the step ``Trainer.step`` takes) on a meta copy of the model,
and watches it from outside, through what it hands the step: the batch (the scatter, or the rank's own slab of
rows), the model (a wrapper that counts what the forward saves and shards its convolutions) and the optimizer
(``_Replay``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..levers import NO_LEVERS, Levers
from ..train import training_step
from .inputs import OPTIMIZERS

ALLOCATOR_BLOCK = 512  # the CUDA caching allocator hands out multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp)


def storage_id(t: torch.Tensor) -> int:
    """An identity for a tensor's storage that also works on the meta device (where every data_ptr is 0)."""
    return t.untyped_storage()._cdata


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def blocks(n: int) -> int:
    """Bytes the CUDA caching allocator counts for an allocation of n bytes."""
    return -(-n // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


class LiveBytes(TorchDispatchMode):
    """Live storages created inside ``with``, counted in allocator blocks; ``peak`` is the high-water mark, with
    ``workspace(func, args)`` bytes held inside each op on top of what is live after it, if given. An op's output
    that shares an input's storage (a view, ``detach``, an in-place op such as ``add_`` into a gradient) allocates
    nothing: a parameter or gradient made before ``with`` is not counted again.

    Works on meta tensors: a storage's Python object can be watched with ``weakref.finalize``.
    """

    def __init__(self, workspace=None):
        super().__init__()
        self.live = self.peak = 0
        self.workspace = workspace
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._sizes and key not in inputs:
                    self._sizes[key] = blocks(storage.nbytes())
                    self.live += self._sizes[key]
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live + (self.workspace(func, args) if self.workspace else 0))
        return out


class FFTDims(TorchDispatchMode):
    """Inside ``with``: the tensor dims every FFT transforms (``dims``), seen at the aten level, where each of
    ``torch.fft``'s functions arrives as ``_fft_r2c``, ``_fft_c2c`` or ``_fft_c2r`` with its dims listed."""

    def __init__(self):
        super().__init__()
        self.dims: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("_fft_r2c", "_fft_c2c", "_fft_c2r"):
            rank = args[0].dim()
            for d in args[1]:
                self.dims.setdefault(d % rank, name)
        return func(*args, **(kwargs or {}))


class CalledFunctions(TorchFunctionMode):
    """Inside ``with``: every torch function called (``called``), as ShardTensor keys its function handlers."""

    def __init__(self):
        super().__init__()
        self.called: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.called.add(func)
        return func(*args, **(kwargs or {}))


def handlers_note(called) -> str:
    """What a plan leaves out where some of the functions ``called`` run through a ShardTensor handler registered from
    outside PhysicsNeMo (``ShardTensor.register_function_handler``, physicsnemo/domain_parallel/shard_tensor.py:907):
    the replay, on plain tensors, runs each as torch does, not as that handler does. "" where none does."""
    from physicsnemo.domain_parallel import ShardTensor

    found = {}
    for func in called:
        handler = ShardTensor._function_registry.get(func)
        module = getattr(handler, "__module__", None) or ""
        if handler is not None and not module.startswith("physicsnemo"):
            found[f"{getattr(func, '__module__', '') or ''}.{getattr(func, '__name__', func)}".lstrip(".")] = module
    if not found:
        return ""
    return (f"{', '.join(sorted(found))}: replayed as torch runs them on a rank's rows, not as the ShardTensor "
            f"handlers registered for them from {', '.join(sorted(set(found.values())))} do; what those hold above "
            "that (their own saved tensors and temporaries) is not in this plan: measure a step with the handlers")


_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _per_dim(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, list | tuple) else (value,) * n


def conv_halo(kernel_size: int, dilation: int = 1) -> int:
    """Rows a sharded convolution needs from each neighbour: half its receptive field (odd kernels), as PhysicsNeMo's
    ``compute_halo_from_kernel_stride_and_dilation``; even kernels are only shardable with stride = kernel: none."""
    return 0 if kernel_size % 2 == 0 else (dilation * (kernel_size - 1) + 1) // 2


class _ShardedConvolutions(TorchFunctionMode):
    """Inside ``with``: every convolution behaves as PhysicsNeMo's ShardTensor convolution on one rank.

    Along the sharded dim the input gets the neighbours' halo rows (or, at the first and last rank of the domain,
    the convolution's own zero padding), and the convolution then runs with no padding along that dim.
    """

    def __init__(self, dim: int, first: bool, last: bool, padded: dict):
        super().__init__()
        self.dim, self.first, self.last, self.padded = dim, first, last, padded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in _CONVS:
            return func(*args, **(kwargs or {}))
        spatial = _CONVS[func]
        call = dict(zip(_CONV_ARGS, args)) | (kwargs or {})
        x, weight = call["input"], call["weight"]
        axis = self.dim - (x.dim() - spatial)  # which kernel dim runs along the sharded tensor dim
        if not 0 <= axis < spatial:
            return func(**call)
        k = weight.shape[2 + axis]
        dilation = _per_dim(call.get("dilation", 1), spatial)
        padding = call.get("padding", 0)
        if isinstance(padding, str):  # "same" / "valid", as PhysicsNeMo's padding_from_str_and_params resolves them
            padding = tuple(((weight.shape[2 + i] - 1) * dilation[i]) // 2 if padding == "same" else 0
                            for i in range(spatial))
        padding = list(_per_dim(padding, spatial))
        halo = conv_halo(k, dilation[axis])
        if halo == 0:
            return func(**call)
        above = padding[axis] if self.first else halo
        below = padding[axis] if self.last else halo
        pads = [0] * (2 * x.dim())
        pads[2 * (x.dim() - 1 - self.dim)], pads[2 * (x.dim() - 1 - self.dim) + 1] = above, below
        xp = F.pad(x, pads)
        self.padded[storage_id(xp)] = (above + below) / xp.shape[self.dim]  # the share of rows not this rank's
        # A storage freed (inside a checkpointed block, nothing keeps it) leaves its address to a later one.
        weakref.finalize(xp.untyped_storage(), self.padded.pop, storage_id(xp), None)
        padding[axis] = 0
        return func(**(call | {"input": xp, "padding": tuple(padding)}))


class _SavedOnMeta:
    """Bytes autograd saves for backward, deduplicated and with parameters excluded as ``SavedActivations`` does,
    for meta tensors (whose data pointers are all 0: the storage identifies them)."""

    def __init__(self, exclude: set[int], padded: dict):
        self.exclude, self.padded = exclude, padded
        self.seen: set[tuple] = set()
        self.bytes = 0
        self.halos = 0.0

    def pack(self, t):
        key = (storage_id(t), t.storage_offset(), tuple(t.shape))
        if key[0] not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += nbytes(t)
            self.halos += nbytes(t) * self.padded.get(key[0], 0.0)
        return t


# What torch.autocast runs in lower precision, for the ops a field model calls (the CPU and CUDA lists of
# aten/src/ATen/autocast_mode.cpp share these); everything else runs in the dtype its inputs promote to.
_LOWER_PRECISION_OPS = {torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
                        torch.conv_transpose3d, F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                        torch.Tensor.matmul, torch.Tensor.__matmul__, F.scaled_dot_product_attention}


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast`` for meta tensors, which carry no autocast dispatch key: inside ``with``, the inputs of the
    ops autocast lowers (``_LOWER_PRECISION_OPS``) are cast to ``dtype`` when they are fp32, and each weight (a leaf
    that needs a gradient) is cast once and cached until the outermost ``with`` ends, as autocast's cast cache does.

    The casts go through autograd as autocast's do, so the replay saves and frees what a real autocast step does."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}

    def __exit__(self, *exc):
        self.cache.clear()
        return super().__exit__(*exc)

    def _cast(self, t):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            return t
        if t.is_leaf and t.requires_grad:
            if id(t) not in self.cache:
                self.cache[id(t)] = t.to(self.dtype)
            return self.cache[id(t)]
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _LOWER_PRECISION_OPS:
            args = tuple(self._cast(a) for a in args)
            kwargs = {k: self._cast(v) for k, v in (kwargs or {}).items()}
        return func(*args, **(kwargs or {}))


def local_slices(extent: int, n: int) -> list[int]:
    """Rows each of n domain ranks holds: ``torch.chunk`` of the sharded dim, which ``scatter_tensor`` (through
    DTensor's ``Shard``) uses. Uneven: the first ranks get ceil(extent / n), the last one the rest."""
    size = -(-extent // n)
    return [max(0, min(size, extent - i * size)) for i in range(n)]


def fsdp_shards(shape: torch.Size, ddp: int) -> tuple[list[torch.Size], int]:
    """``fully_shard``'s split of a parameter over the ddp ranks: the local shapes (``torch.chunk`` of dim 0, possibly
    empty), and the padded shard's element count (every shard is padded to the size of the first)."""
    if len(shape) == 0:
        return [shape] * ddp, 1
    rows = local_slices(shape[0], ddp)
    chunks = [torch.Size([r, *shape[1:]]) for r in rows]
    return chunks, chunks[0].numel()


@dataclass
class Trace:
    activations: int
    halos: int
    peak: int  # the replayed scatter, forward and backward's high-water mark of live bytes, inputs included
    after: int  # live bytes left when backward is done: what sits under the optimizer step
    forward_peak: int = 0  # the high-water mark up to backward (scatter, forward, loss)
    backward_peak: int = 0  # the high-water mark in backward


class _Replay:
    """What ``trace_rank`` hands ``training_step`` as its optimizer, and how it sees the step from outside.

    The forward runs through ``forward`` (``_ReplayedModel``): the input cast to FSDP2's ``param_dtype`` if there is
    one (``MixedPrecisionPolicy(cast_forward_inputs=True)``, at the root), the tensors it saves counted (``saved``),
    its convolutions sharded (``sharded()``), and autocast's stand-in on for the forward and the loss, until the
    step's ``zero_grad()``, which it calls just before its backward. There the forward's high-water mark is taken
    and the backward's contexts are entered, until ``finish()``. The previous step's gradients stay (persistent
    state, counted with the wrapper's shard shapes), and the optimizer's own step is replayed apart
    (``optimizer_state``), on those shapes too."""

    def __init__(self, live: LiveBytes, levers: Levers, saved: _SavedOnMeta, sharded):
        self.live, self.levers, self.saved, self.sharded = live, levers, saved, sharded
        self.forward_peak = 0
        self._entered = contextlib.ExitStack()  # entered in one call of the step, left in a later one

    def forward(self, module, x):
        if self.levers.autocast is not None:
            self._entered.enter_context(MetaAutocast(self.levers.autocast))  # left at zero_grad, after the loss
        with torch.autograd.graph.saved_tensors_hooks(self.saved.pack, lambda t: t), self.sharded():
            return module(x if self.levers.param_dtype is None else x.to(self.levers.param_dtype))

    def zero_grad(self):
        self._entered.close()
        self.forward_peak, self.live.peak = self.live.peak, self.live.live
        self._entered.enter_context(self.sharded())
        if self.levers.checkpoint and self.levers.autocast is not None:
            self._entered.enter_context(MetaAutocast(self.levers.autocast))
        # As on ranks, where ShardTensor.backward does it: backward runs with torch functions off, and a checkpoint
        # turns them back on to recompute its block (workarounds.recompute_with_shard_tensor_handlers), so the modes
        # above act in the recompute only (a mode is off while handling backward).
        self._entered.enter_context(torch._C.DisableTorchFunction())

    def step(self):
        pass

    def finish(self):
        self._entered.close()


class _ReplayedModel(torch.nn.Module):
    """The model as ``trace_rank`` hands it to the step: its forward run by ``_Replay.forward``."""

    def __init__(self, module, replay: _Replay):
        super().__init__()
        self.module, self.replay = module, replay

    def forward(self, x):
        return self.replay.forward(self.module, x)


def trace_rank(model, field_shape: tuple, target_shape: tuple, dtype, dim: int, domain: int, position: int,
               workspace=None, levers: Levers = NO_LEVERS, loading: str = "scatter") -> Trace:
    """One rank's training step (``sl.train.training_step``) on the meta device: the batch as ``loading`` makes it
    (``"scatter"``: the whole fields, then this rank's slice; ``"slab"``: only this rank's rows, in storage of their
    own), then the forward with its saved tensors recorded and its convolutions sharded, the loss and the backward,
    live bytes tracked (with the kernels' ``workspace``, as ``LiveBytes`` takes it).

    ``model`` is already as ``levers`` make it (checkpointed; in ``param_dtype``, whose input cast is added here);
    autocast runs as ``MetaAutocast`` (the meta device has no ``torch.autocast``), in the forward and the loss, and
    again in backward, where checkpointed blocks are recomputed under autocast (its cast weights are then cached for
    the whole backward: an over-estimate of one low-precision copy of the weights)."""
    padded: dict[int, float] = {}
    params = list(model.parameters())
    saved = _SavedOnMeta({storage_id(p) for p in params}, padded)
    for p in params:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    size = -(-field_shape[dim] // domain)  # torch.chunk's slices, as scatter_tensor cuts them
    start, stop = min(position * size, field_shape[dim]), min((position + 1) * size, field_shape[dim])
    # Each tensor with how many of its rows one input row makes: the target's are the output's, k times the input's
    # where the model multiplies the sharded dim by k.
    tensors = ((field_shape, 1), (target_shape, target_shape[dim] // field_shape[dim]))

    def scatter():  # scatter_tensor: the whole tensor on every rank, then this rank's slice (a view where it can be)
        fields = []
        for shape, k in tensors:
            full = torch.empty(shape, dtype=dtype, device="meta")
            fields.append(full.narrow(dim, k * start, k * (stop - start)).contiguous() if domain > 1 else full)
        return fields

    def slab():  # read from storage: this rank's rows only, a fresh tensor that ShardTensor.from_local wraps
        return [torch.empty((*shape[:dim], k * (stop - start), *shape[dim + 1:]), dtype=dtype, device="meta")
                for shape, k in tensors]

    def sharded():
        if domain == 1:
            return contextlib.nullcontext()
        return _ShardedConvolutions(dim, position == 0, position == domain - 1, padded)

    with LiveBytes(workspace) as live:
        replay = _Replay(live, levers, saved, sharded)
        try:
            # The levers are the replay's own: the model is as they make it, autocast is MetaAutocast.
            loss = training_step(_ReplayedModel(model, replay), replay, slab if loading == "slab" else scatter)
        finally:
            replay.finish()
        after = live.live  # what sits under the optimizer step
        del loss
    for p in params:
        p.grad = None
    peak = max(live.peak, replay.forward_peak)
    return Trace(saved.bytes, round(saved.halos), peak, after, replay.forward_peak, live.peak)


def optimizer_state(optimizer_name: str, local: list[torch.Tensor]) -> tuple[int, int, int]:
    """(state bytes as ``state_bytes`` counts them, of which on the parameters' device, the step's scratch)."""
    optimizer = OPTIMIZERS[optimizer_name](local)
    for p in local:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the state, as the first training step does
    with LiveBytes() as live:
        optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    on_device = sum(blocks(nbytes(v)) for v in state if v.device.type == "meta")  # Adam's step count stays on CPU
    return sum(nbytes(v) for v in state), on_device, live.peak
