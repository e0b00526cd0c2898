"""Judges of ``notebooks/05_ddp_vs_fsdp2.ipynb``: getting a model ready for ``fully_shard`` (weights agreed before
sharding, sharded on the ddp axis), and an FSDP2 step built by hand (all-gather the parameters, forward and
backward, reduce-scatter the gradients) matched against ``fully_shard``'s gradient shards.

Both judges run the learner's function, which calls collectives: every rank runs them together, as
``sl.check.on_ranks`` does.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..launch import default_device
from ..measure import collective_bytes, strict_fp32
from ..models import conv_stack


def fsdp2_ready(fn, mesh) -> str | None:
    """On a rank: ``fn(model, mesh)`` gets a model whose initial weights differ on every rank and must return it
    wrapped by ``fully_shard`` on ``mesh["ddp"]``, every rank starting from global rank 0's weights."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    device = default_device()
    model = conv_stack(seed=dist.get_rank()).to(device)  # every rank its own initial weights, on purpose
    first = conv_stack(seed=0).to(device)  # what global rank 0 starts from
    wrapped = fn(model, mesh)
    if wrapped is None:
        return "shard_for_fsdp2 returned None: return the wrapped model (fully_shard returns the module it wraps)"
    if not isinstance(wrapped, FSDPModule):
        return f"shard_for_fsdp2 returned a {type(wrapped).__name__} that fully_shard did not wrap"
    params = list(wrapped.parameters())
    if not all(isinstance(p, DTensor) for p in params):
        return "some parameters are still plain tensors: fully_shard makes every parameter of what it wraps a DTensor"
    axes = {p.device_mesh.mesh_dim_names for p in params}
    if axes != {("ddp",)}:
        if ("domain",) in axes:
            return ("the parameters are sharded over the domain axis: those ranks share one sample, so nothing "
                    "averages the gradients of the replicas")
        return f"the parameters are sharded over the mesh axes {sorted(axes)}, not over the ddp axis alone"
    worst = 0.0
    for p, q in zip(params, first.parameters()):
        worst = max(worst, (p.full_tensor().detach() - q.detach()).abs().max().item())
    if worst > 0:
        return (f"after wrapping, the full weights seen on this rank differ from global rank 0's initial weights (by "
                f"up to {worst:.3g}): fully_shard keeps whatever each rank held, so make them agree before sharding")
    return None


def _is_gather(name: str) -> bool:
    return "gather" in name


def _is_reduce_scatter(name: str) -> bool:
    return "reduce_scatter" in name


def fsdp2_step(fn, fsdp_model, template, x, y) -> str | None:
    """On a rank: ``fn(shards, template, x, y, group)`` gets this rank's parameter shards (as ``fully_shard`` holds
    them) and must return this rank's shards of the ddp-averaged gradients of ``((model(x) - y) ** 2).mean()``,
    equal to the gradient shards ``fully_shard`` left on ``fsdp_model`` after the same step.

    The template it gets has zeros for weights: it gives shapes and the forward, not the values."""
    named = dict(fsdp_model.named_parameters())
    if any(p.grad is None for p in named.values()):
        return "fsdp_model has no gradients yet: run the cell before the exercise (the library's step) first"
    group = next(iter(named.values())).device_mesh.get_group()
    shards = {name: p.to_local().detach().clone() for name, p in named.items()}
    expected = {name: p.grad.to_local() for name, p in named.items()}
    blank = copy.deepcopy(template)
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    with strict_fp32(), collective_bytes() as comm:
        got = fn(shards, blank, x, y, group)
    if not isinstance(got, dict):
        return f"fsdp2_grads_by_hand returned a {type(got).__name__}; return a dict {{parameter name: gradient shard}}"
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"the gradients returned are keyed differently from the shards: missing {missing}, unexpected {extra}"
    full_shapes = {name: tuple(p.shape) for name, p in template.named_parameters()}
    for name, want in expected.items():
        mine = got[name]
        if not isinstance(mine, torch.Tensor):
            return f"{name}: got a {type(mine).__name__}, not a tensor"
        mine = mine.to_local() if hasattr(mine, "to_local") else mine
        if tuple(mine.shape) != tuple(want.shape):
            if tuple(mine.shape) == full_shapes.get(name):
                return (f"{name}: returned the full gradient, shape {tuple(mine.shape)}; after FSDP2's step each rank "
                        "keeps only the rows of its own shard")
            return f"{name}: returned shape {tuple(mine.shape)}, not the shape of this rank's shard of that gradient"
        if mine.device != want.device:
            return f"{name}: the gradient is on {mine.device}, not on this rank's device"
        if want.numel():
            scale = max(want.abs().max().item(), 1e-12)
            if not torch.allclose(mine.detach(), want, rtol=1e-4, atol=1e-6 * scale):
                return (f"{name}: the values differ from fully_shard's gradient shard on this rank; they must come "
                        "from the gathered weights (the template's are zeros) and be averaged over the ddp replicas, "
                        "each of which trained on its own sample")
    ops = list(comm.ops)
    if not any(_is_gather(op) for op in ops):
        return ("the values are right, but no all-gather was called: FSDP2 rebuilds each full parameter from the "
                "ranks' shards with an all-gather")
    if not any(_is_reduce_scatter(op) for op in ops):
        return ("the values are right, but no reduce-scatter was called: FSDP2 reduce-scatters the gradients, so "
                "each rank receives the sum of its own rows only")
    return None
