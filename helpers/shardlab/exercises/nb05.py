"""Judges of ``notebooks/05_ddp_vs_fsdp2.ipynb``: getting a model ready for ``fully_shard`` (weights agreed before
sharding, sharded on the ddp axis), and an FSDP2 step built by hand (all-gather the parameters, forward and
backward, reduce-scatter the gradients) matched against ``fully_shard``'s gradient shards.

Both answers are functions, called on models and samples the notebook never used, drawn anew for each check (the
weights' seed, the width and depth, the sample): the judges build their own answer key (a model wrapped by
``sl.train.wrap`` and stepped outside the judged call) and watch the call: the collectives it runs, over which ranks
and with how many bytes, and the library functions it may not use. They run collectives: every rank runs them
together, as ``sl.exercises.on_ranks`` does.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist

from ..data import normalized_darcy
from ..measure.memory import strict_fp32
from ..models import conv_stack
from ..ranks.launch import default_device
from ..train import wrap
from .judging import Watch, case_generator, earlier_object, second_hint


def judged_shape(draw: random.Random, ddp_size: int) -> dict:
    """A conv_stack's width, depth and seed that the notebook never used, with a width that does not split evenly over
    the replicas, so that FSDP2's padding is at work in the hidden layers too, not only in the one-channel output."""
    width = draw.randint(3, 12)
    if ddp_size > 1 and width % ddp_size == 0:
        width += 1
    return {"width": width, "layers": draw.randint(2, 4), "seed": draw.randrange(1_000, 1_000_000)}


@second_hint(
    "fully_shard broadcasts nothing, and refuses a sync afterwards. Before it: sync_module_over_mesh(model, "
    "mesh[\"domain\"]), then sync_module_over_mesh(model, mesh[\"ddp\"]), which leaves global rank 0's weights on "
    'every rank. Then fully_shard each layer that has parameters and the model itself, with mesh=mesh["ddp"] '
    "(never the domain axis)."
)
def fsdp2_ready(fn, mesh, draw: random.Random | None = None) -> str | None:
    """Exercise 1. Doing it means: broadcast global rank 0's plain weights and buffers over the domain axis and over
    the ddp axis (``sync_module_over_mesh``), then ``fully_shard`` each layer and the model on ``mesh["ddp"]``.

    ``fn(model, mesh)`` gets a model (width, depth and weights drawn for this check: ``judged_shape``, from ``draw``
    or a fresh ``case_generator``) whose initial weights differ on every rank. Observed: the broadcasts over both axes
    happen before ``fully_shard``; the model it returns is the one it was given, wrapped by FSDP2 on the ddp axis, and
    every rank then computes with global rank 0's initial weights.
    ``sl.train.wrap`` (the library's version of this function) may not run."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    device = default_device()
    shape = judged_shape(draw or case_generator(), mesh["ddp"].size())
    first = conv_stack(**shape).to(device)  # what global rank 0 starts from
    model = conv_stack(**(shape | {"seed": shape["seed"] + dist.get_rank()})).to(device)  # every rank its own
    with Watch(wrap=wrap, fully_shard=fully_shard) as watch:
        wrapped = fn(model, mesh)
    problem = watch.forbidden(wrap="the library's version of this function: write the syncs and fully_shard yourself")
    if problem:
        return problem
    if wrapped is None:
        return "shard_for_fsdp2 returned None: return the wrapped model (fully_shard returns the module it wraps)"
    if wrapped is not model:
        return f"{earlier_object(wrapped, fn) or 'it returned another model'}, not the model it was given, wrapped"
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
    worst = max((p.full_tensor().detach() - q.detach()).abs().max().item() for p, q in zip(params, first.parameters()))
    if worst > 0:
        return (f"after wrapping, the full weights seen on this rank differ from global rank 0's initial weights (by "
                f"up to {worst:.3g}): fully_shard keeps whatever each rank held, so make them agree before sharding, "
                "with rank 0's own weights")
    first_shard = next(i for i, e in enumerate(watch.events) if e.kind == "call" and e.name == "fully_shard")
    for axis in ("domain", "ddp"):
        ranks = dist.get_process_group_ranks(mesh[axis].get_group())
        if len(ranks) > 1 and not any(e.kind == "collective" and e.name == "broadcast" and list(e.ranks) == ranks
                                      for e in watch.events[:first_shard]):
            return (f"the weights agree, but nothing was broadcast over the {axis} axis before fully_shard: where did "
                    "rank 0's weights come from? Sync them over each axis")
    return None


def _padded_bytes(p, n: int) -> int:
    """Bytes of one rank's shard of ``p`` padded to torch.chunk's first shard: what FSDP2 all-gathers per rank."""
    rows = -(-p.shape[0] // n)
    return rows * p[0].numel() * p.element_size()


@second_hint(
    "Pad each shard to ceil(rows / n) rows, dist.all_gather_single into n × that many, keep the first rows and "
    "make them leaves (requires_grad_()); run torch.func.functional_call(template, full, (x,)), not template(x), "
    "whose weights are zeros. Then pad each gradient to n × ceil(rows / n) rows, dist.reduce_scatter_tensor into "
    "ceil(rows / n) rows, divide by n, and keep as many rows as your shard has."
)
def fsdp2_step(fn, mesh, draw: random.Random | None = None) -> str | None:
    """Exercise 2. Doing it means: all-gather every parameter's shards over the ddp group into the full parameter,
    run forward and backward with those as leaves, and reduce-scatter each gradient back into this rank's rows,
    averaged over the replicas.

    ``fn(shards, template, x, y, group)`` gets this rank's parameter shards of a model the judge wrapped with
    ``sl.train.wrap(..., "fsdp2")`` (width, depth, weights and samples drawn for this check, as in ``fsdp2_ready``)
    and stepped once, a template of zeros (shapes and forward only), and the ddp group. Observed: over the ddp group,
    an all-gather of one padded shard per parameter and a reduce-scatter; no ``fully_shard`` or ``sl.train.wrap``; and
    the returned shards, against the gradient shards the judge's FSDP2 model holds."""
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    device = default_device()
    ddp_size, replica = mesh["ddp"].size(), mesh.get_coordinate()[0]
    draw = draw or case_generator()
    template = conv_stack(**judged_shape(draw, ddp_size)).to(device)
    key = wrap(copy.deepcopy(template), mesh, "fsdp2")  # the answer key: built here, out of the learner's reach
    inputs, targets = normalized_darcy()
    sample = draw.randrange(ddp_size, len(inputs) - ddp_size + 1) + replica  # the notebook's cell used 0 .. ddp - 1
    x, y = inputs[sample:sample + 1].to(device), targets[sample:sample + 1].to(device)
    if mesh["domain"].size() > 1:
        source = dist.get_global_rank(mesh["domain"].get_group(), 0)
        x, y = (scatter_tensor(t, source, mesh["domain"], (Shard(2),)) for t in (x, y))
    with strict_fp32():
        ((key(x) - y) ** 2).mean().backward()
    named = dict(key.named_parameters())
    group = mesh["ddp"].get_group()
    ranks = dist.get_process_group_ranks(group)
    shards = {name: p.to_local().detach().clone() for name, p in named.items()}
    expected = {name: p.grad.to_local() for name, p in named.items()}
    blank = copy.deepcopy(template)
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    with strict_fp32(), Watch(fully_shard=fully_shard, wrap=wrap) as watch:
        got = fn(shards, blank, x, y, group)
    problem = watch.forbidden(fully_shard="the library this exercise rebuilds", wrap="which calls fully_shard")
    if problem:
        return problem
    if not isinstance(got, dict):
        return f"fsdp2_grads_by_hand returned a {type(got).__name__}; return a dict {{parameter name: gradient shard}}"
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        return f"the gradients returned are keyed differently from the shards: missing {missing}, unexpected {extra}"
    if ddp_size > 1:
        gathers = watch.collectives("all_gather", ranks=ranks)
        if not gathers:
            return ("no all-gather ran over the ddp group: FSDP2 rebuilds each full parameter from the replicas' "
                    "shards with an all-gather")
        padded, sent = [_padded_bytes(p, ddp_size) for p in template.parameters()], [e.bytes for e in gathers]
        if any(sent.count(size) < padded.count(size) for size in set(padded)):
            return ("the all-gathers over the ddp group were not one padded shard per parameter per rank: pad each "
                    "shard to ceil(rows / n) rows and gather those")
        if not watch.collectives("reduce_scatter", ranks=ranks):
            return ("no reduce-scatter ran over the ddp group: FSDP2 reduce-scatters the gradients, so each rank "
                    "receives the sum of its own rows only")
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
                return (f"{name}: the values differ from the gradient shard fully_shard gives for the shards, sample "
                        "and group it was given; they must come from the gathered weights (the template's are zeros) "
                        "and be averaged over the ddp replicas, each of which trained on its own sample")
    return None
