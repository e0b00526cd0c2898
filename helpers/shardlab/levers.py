"""Memory levers of a training step: activation checkpointing, autocast, and FSDP2's mixed precision and
resharding, as one ``Levers`` value that ``sl.train.wrap`` and ``sl.train.training_step`` apply and ``sl.plan``
replays.

Introduced in ``notebooks/11_memory_levers.ipynb``.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from .workarounds import recompute_with_shard_tensor_handlers

LOW_PRECISION = (torch.bfloat16, torch.float16)  # what autocast and FSDP2's param_dtype may lower to


@dataclass(frozen=True)
class Levers:
    """The memory levers of a training step, off by default; ``wrap`` and ``training_step`` apply them.

    - ``checkpoint``: activation checkpointing (``torch.utils.checkpoint``, non-reentrant) of an ``nn.Sequential``
      model, one block per ``fsdp_units`` unit: the unit with the parameter-free modules that run before it (a
      GELU and the next convolution). A block keeps only its input; what its modules save is recomputed in
      backward. Each block ends at its unit, so FSDP2's pre-backward all-gather has run when the block is
      recomputed and the recompute gathers nothing again. Parameter-free modules after the last unit run as usual.
    - ``autocast``: a lower-precision dtype (``torch.bfloat16``, ``torch.float16``) for the forward and the loss,
      under ``torch.autocast(device.type, dtype)``; weights stay fp32, autocast caches one low-precision copy of
      each for the forward.
    - ``param_dtype``: FSDP2 only, ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=torch.float32)``: the
      sharded (master) weights, gradients and optimizer state stay fp32; FSDP2 gathers the weights in
      ``param_dtype`` and computes in it, then reduces the gradients in fp32.
    - ``reshard_after_forward``: FSDP2 only; False keeps every unit's gathered weights from its forward to its
      backward (no second all-gather, more memory).
    """

    checkpoint: bool = False
    autocast: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True

    def __post_init__(self):
        for name in ("autocast", "param_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in LOW_PRECISION):
                raise ValueError(f"{name}={dtype!r}: give a lower-precision dtype, torch.bfloat16 or torch.float16, "
                                 "or None to leave it off (fp32 is what the step computes in without it).")

    @property
    def label(self) -> str:
        """What is on, for a bar label: "checkpoint + autocast bf16", "baseline" when nothing is."""
        short = {torch.bfloat16: "bf16", torch.float16: "fp16"}
        on = [name for name, is_on in (
            ("checkpoint", self.checkpoint),
            (f"autocast {short.get(self.autocast)}", self.autocast is not None),
            (f"param_dtype {short.get(self.param_dtype)}", self.param_dtype is not None),
            ("no reshard after forward", not self.reshard_after_forward)) if is_on]
        return " + ".join(on) or "baseline"

    def __str__(self) -> str:
        return self.label

    def check(self, how: str) -> None:
        """Refuse, with what to change, the levers this wrapper cannot apply."""
        if how != "fsdp2" and self.param_dtype is not None:
            raise ValueError(f"param_dtype={self.param_dtype} is FSDP2's MixedPrecisionPolicy, and how={how!r}: use "
                             f"how='fsdp2', or autocast={self.param_dtype} for a lower-precision forward with {how}.")
        if how != "fsdp2" and not self.reshard_after_forward:
            raise ValueError(f"reshard_after_forward=False is an FSDP2 option, and how={how!r}: use how='fsdp2', or "
                             "leave reshard_after_forward=True.")


NO_LEVERS = Levers()  # the default: every lever off


def checkpoint_blocks(model) -> list[list[torch.nn.Module]]:
    """The blocks ``Levers(checkpoint=True)`` checkpoints in an ``nn.Sequential``: each ``fsdp_units`` unit with
    the parameter-free children that run before it (see ``Levers``); a ValueError for any other model."""
    if not isinstance(model, torch.nn.Sequential):
        raise ValueError(f"checkpoint=True cuts an nn.Sequential into blocks, and this model is a "
                         f"{type(model).__name__}: call torch.utils.checkpoint.checkpoint(..., use_reentrant=False) "
                         "around its blocks inside its forward instead, and leave the lever off.")
    blocks, pending = [], []
    for child in model:
        pending.append(child)
        if any(p.requires_grad for p in child.parameters()):
            blocks.append(pending)
            pending = []
    return blocks + ([pending] if pending else [])


def _run(modules, x):
    for module in modules:
        x = module(x)
    return x


class CheckpointedSequential(torch.nn.Sequential):
    """An ``nn.Sequential`` whose forward checkpoints it block by block (``checkpoint_blocks``): each block with a
    trainable parameter runs under ``torch.utils.checkpoint.checkpoint`` (non-reentrant), which keeps the block's input
    for backward and recomputes the rest; the others, and every block without gradients, run as usual."""

    def forward(self, x):
        for block in checkpoint_blocks(self):
            if torch.is_grad_enabled() and any(p.requires_grad for m in block for p in m.parameters()):
                x = checkpoint(functools.partial(_run, block), x, use_reentrant=False,
                               context_fn=recompute_with_shard_tensor_handlers)
            else:
                x = _run(block, x)
        return x


def use_checkpointing(model) -> CheckpointedSequential:
    """``model`` (an ``nn.Sequential``) checkpointed block by block: a ``CheckpointedSequential`` of the same child
    modules, so parameter names and the state dict are unchanged. Use the module it returns."""
    checkpoint_blocks(model)  # refuses any other model, with what to do instead
    return CheckpointedSequential(collections.OrderedDict(model.named_children()))


def is_checkpointed(model) -> bool:
    """Whether the model (or the module DDP wraps) is one ``use_checkpointing`` made."""
    return isinstance(getattr(model, "module", model), CheckpointedSequential)
