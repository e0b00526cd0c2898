"""Training layer: one Darcy surrogate trained on a (ddp, domain) mesh with no wrapper, DDP or FSDP2.

Introduced in ``notebooks/05_ddp_vs_fsdp2.ipynb``; the capstone (07) builds on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel

from . import data
from .levers import NO_LEVERS, Levers, is_checkpointed, use_checkpointing

# PhysicsNeMo is imported inside the functions that use it: the single-process reference
# (``train_one_process``) also runs in the notebook kernel, which need not pay its import.

WRAPPERS = ("none", "ddp", "fsdp2")


def decayed_lr(lr: float, step: int, steps: int) -> float:
    """The learning rate of ``step`` of a run of ``steps``: from ``lr`` down to near 0 in a straight line, which
    settles the last steps instead of leaving them bouncing at full rate."""
    return lr * (1 - step / steps)


def evaluate(model, inputs, targets, mesh=None) -> dict[str, float]:
    """Without gradients, the mean over the samples of the loss (mean squared error, as in training) and of the
    relative L2 error ||prediction - target|| / ||target||.

    On a mesh (every rank calls it): ddp replica r predicts samples r, r + ddp, ..., each scattered over its
    domain group, and the sums are all-reduced over ``mesh["ddp"]``, so every rank returns the same numbers.
    Without a mesh: one process, one sample at a time, on the model's device.
    """
    device = next(model.parameters()).device
    ddp_size, replica = (mesh["ddp"].size(), mesh.get_coordinate()[0]) if mesh is not None else (1, 0)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, relative L2 error, samples
    source = data.ScatterSource(inputs, targets)
    with torch.no_grad():
        for i in range(replica, len(inputs), ddp_size):
            if mesh is not None:  # scattered over the domain group as in training
                x, y = source.sample(i, mesh, device)
            else:
                x, y = inputs[i : i + 1].to(device), targets[i : i + 1].to(device)
            squared = (model(x) - y) ** 2
            both = torch.stack([squared.mean(), squared.sum() / (y**2).sum()])
            both = (both.full_tensor() if hasattr(both, "full_tensor") else both).double()
            sums += torch.cat([both[:1], both[1:].sqrt(), torch.ones(1, dtype=torch.float64, device=device)])
    if mesh is not None and ddp_size > 1:
        dist.all_reduce(sums, group=mesh["ddp"].get_group())
    return {"loss": (sums[0] / sums[2]).item(), "relative L2": (sums[1] / sums[2]).item()}


def wrap(model, mesh, how: str, levers: Levers = NO_LEVERS):
    """Sync plain weights and buffers over ``mesh["domain"]``, then wrap on ``mesh["ddp"]`` as asked.

    ``how``: "none" (gradients averaged by hand in ``train``), "ddp" (all parameters are plain
    tensors; DDP broadcasts rank 0's weights to the replicas), or "fsdp2" (``fully_shard`` on the ddp
    mesh: parameters become DTensors; it broadcasts nothing, so the replicas are synced first too).
    ``levers``: checkpointing is applied before wrapping (``use_checkpointing``: the model returned is then a new
    module of the same children), FSDP2's ``param_dtype`` and ``reshard_after_forward`` by ``fully_shard``; autocast
    is ``training_step``'s.
    """
    from physicsnemo.domain_parallel import sync_module_over_mesh

    if how not in WRAPPERS:
        raise ValueError(f"how={how!r}: use one of {WRAPPERS}. FSDP1 and distribute_module are not options here.")
    levers.check(how)
    if levers.checkpoint:
        model = use_checkpointing(model)
    if mesh["domain"].size() > 1:
        sync_module_over_mesh(model, mesh["domain"])  # before wrapping: FSDP2 would make them DTensors
    if how == "fsdp2" and mesh["ddp"].size() > 1:
        sync_module_over_mesh(model, mesh["ddp"])  # fully_shard broadcasts nothing: replicas keep their own init
    if how == "ddp":
        return DistributedDataParallel(model, process_group=mesh["ddp"].get_group())
    if how == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=levers.param_dtype, reduce_dtype=torch.float32
                                      if levers.param_dtype is not None else None)
        for unit, _ in fsdp_units(model):  # the root comes last: fully_shard takes its remaining parameters
            fully_shard(unit, mesh=mesh["ddp"], reshard_after_forward=levers.reshard_after_forward, mp_policy=policy)
    return model


def shard_spatial(model, spatial: dict[str, int], domain_mesh) -> None:
    """Each parameter or buffer named in ``spatial`` (name → dim) becomes a DTensor split along that dim on the
    ``domain`` mesh, as upstream shards positional tables; every parameter is made contiguous for ``fully_shard``."""
    from torch.distributed.tensor import distribute_tensor

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if name in spatial:
                split = distribute_tensor(p.data, domain_mesh, [Shard(spatial[name])])
                module.register_parameter(name, torch.nn.Parameter(split, p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if name in spatial and b is not None:
                module.register_buffer(name, distribute_tensor(b, domain_mesh, [Shard(spatial[name])]),
                                       persistent=name not in module._non_persistent_buffers_set)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.contiguous()  # fully_shard refuses non-contiguous parameters


def fsdp_units(model) -> list[tuple[torch.nn.Module, list[str]]]:
    """The modules ``wrap(..., "fsdp2")`` gives ``fully_shard``, each with the names (relative to it) of the
    parameters it manages: every child with a trainable parameter (the children of a container with no forward of its
    own, such as a ``ModuleList``, which ``fully_shard`` refuses), then the root with whatever is left.

    Works on the model before and after wrapping (``fully_shard`` keeps the module tree and the names)."""
    units, taken = [], []

    def visit(module, prefix):
        for name, child in module.named_children():
            if not any(p.requires_grad for p in child.parameters()):
                continue
            if type(child).forward is torch.nn.Module.forward:  # a container: its children run, not it
                visit(child, f"{prefix}{name}.")
            else:
                units.append((child, [n for n, _ in child.named_parameters()]))
                taken.append(f"{prefix}{name}.")

    visit(model, "")
    rest = [n for n, _ in model.named_parameters() if not n.startswith(tuple(taken))]
    return [*units, (model, rest)]


def average_gradients_by_hand(model, group) -> None:
    """What DDP does for you: all-reduce every gradient over the ddp group and divide by its size."""
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= size


def training_step(model, optimizer, batch, reduce_gradients=None, levers: Levers = NO_LEVERS):
    """One training step: ``batch()`` gives (input, target), sharded or not; the model's forward and the mean squared
    error, under ``torch.autocast`` of the input's device when ``levers.autocast`` is set; ``zero_grad`` and backward;
    ``reduce_gradients()`` if given, then the optimizer's step. Returns the loss.

    ``levers.checkpoint`` needs a model ``wrap`` checkpointed. Tools watch this step from outside, through what it is
    given: ``sl.plan`` replays it on the meta device, ``sl.plan.measure_rank`` measures it on ranks.
    """
    if levers.checkpoint and not is_checkpointed(model):
        raise ValueError("levers.checkpoint is on but the model is not checkpointed: build it with "
                         "sl.train.wrap(model, mesh, how, levers) (or model = sl.train.use_checkpointing(model)).")
    x, y = batch()
    lower = contextlib.nullcontext() if levers.autocast is None else torch.autocast(x.device.type, levers.autocast)
    with lower:
        out = model(x)
        loss = ((out - y) ** 2).mean()
        del out, x, y  # what backward needs, autograd keeps
    optimizer.zero_grad()
    loss.backward()
    if reduce_gradients is not None:
        reduce_gradients()
    optimizer.step()
    return loss


class Trainer:
    """A surrogate training on a (ddp, domain) mesh one step at a time; rank-local state, same calls on every rank.

    Step s gives ddp replica i the training sample ``sample_index(s, ddp_size, i, n_samples)`` (batch 1 per domain
    group); ``step()`` returns the global mean loss, identical on every rank. ``source``: where a rank gets its
    sample, a batch source of ``sl.data`` (``ScatterSource``: scattered from the domain group's first rank;
    ``SlabSource``: each rank reads only its rows from a store, no communication). ``samples=(inputs, targets)``
    is short for ``source=sl.data.ScatterSource(inputs, targets)``; neither: the Darcy training split, scattered.
    """

    def __init__(self, model, mesh, how: str, lr: float = 1e-3, samples=None, levers: Levers = NO_LEVERS,
                 source=None):
        self.device = next(model.parameters()).device
        if self.device.type != mesh.device_type:
            raise ValueError(f"the model is on {self.device.type} but the mesh on {mesh.device_type}: move the model "
                             "to this rank's device first, model.to(device).")
        if samples is not None and source is not None:
            raise ValueError("samples= and source= both given: samples=(inputs, targets) is short for "
                             "source=sl.data.ScatterSource(inputs, targets); pass one of them.")
        self.mesh, self.how = mesh, how
        self.source = source if source is not None else data.ScatterSource(*(samples if samples is not None else ()))
        self.n_samples = len(self.source)
        self.ddp_size, self.replica = mesh["ddp"].size(), mesh.get_coordinate()[0]
        self.levers = levers
        self.model = wrap(model, mesh, how, levers)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.steps_done = 0
        self.losses: list[float] = []

    def batch(self, step: int):
        """This rank's (input, target) for a step: a domain-sharded ShardTensor when domain > 1."""
        return self.sample(data.sample_index(step, self.ddp_size, self.replica, self.n_samples))

    def sample(self, i: int):
        """Training sample ``i`` as this rank gets it from its ``source``."""
        return self.source.sample(i, self.mesh, self.device)

    def step(self) -> float:
        """One training step (``training_step``)."""
        reduce = None
        if self.how == "none" and self.ddp_size > 1:
            reduce = lambda: average_gradients_by_hand(self.model, self.mesh["ddp"].get_group())  # noqa: E731
        loss = training_step(self.model, self.optimizer, lambda: self.batch(self.steps_done), reduce, self.levers)
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().reshape(1).clone()
        dist.all_reduce(value, group=self.mesh["ddp"].get_group())
        self.steps_done += 1
        self.losses.append(value.item() / self.ddp_size)
        return self.losses[-1]

    def full_state(self) -> dict:
        """Model and optimizer state gathered in full (FSDP2 shards included), plus the step. A collective: every
        rank calls it, but with ``cpu_offload=True`` the full state dicts reach rank 0 only; the other ranks get
        ``{}`` for the model and the optimizer (``save_checkpoint`` writes rank 0's)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.model, options=options),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options),
                "steps_done": self.steps_done, "losses": list(self.losses), "how": self.how}

    def load_full_state(self, state: dict | None) -> None:
        """Inverse of ``full_state``, a collective over every rank: global rank 0 passes the full state, the others
        None. Rank 0 broadcasts it tensor by tensor (``broadcast_from_rank0``) and each rank keeps what it holds: its
        FSDP2 shard, or all of it under DDP."""
        rank_0 = dist.get_rank() == 0
        if not rank_0:
            state = {"model": {}, "optimizer": {}}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        box = [(state["steps_done"], list(state["losses"])) if rank_0 else None]
        dist.broadcast_object_list(box, src=0)
        self.steps_done, self.losses = box[0][0], list(box[0][1])


@dataclass
class Run:
    """What ``train`` leaves behind: the loss per step and the wrapped model with its optimizer."""

    losses: list
    model: object
    optimizer: object


def train(model, mesh, how: str, steps: int = 5, lr: float = 1e-3, samples=None, levers: Levers = NO_LEVERS) -> Run:
    """Train ``steps`` steps on the mesh with a ``Trainer``; ``.losses`` is the global mean loss per step."""
    trainer = Trainer(model, mesh, how, lr=lr, samples=samples, levers=levers)
    for _ in range(steps):
        trainer.step()
    return Run(trainer.losses, trainer.model, trainer.optimizer)


def save_checkpoint(trainer: Trainer, path) -> None:
    """Gather the full state (a collective: every rank calls it); rank 0 alone writes one file."""
    state = trainer.full_state()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()  # nobody reads the file before it is complete


def train_one_process(model, steps: int, ddp_size: int, lr: float = 1e-3, samples=None, decay: bool = False,
                      optimizer=None, first: int = 0) -> list[float]:
    """The reference: one process, batch = the ddp replicas' samples of each step, same optimizer, on the
    model's device. ``decay``: the learning rate of each step is ``decayed_lr(lr, step, steps)``. ``optimizer`` and
    ``first``: a run resumed at step ``first`` with the optimizer (and its state) it had."""
    device = next(model.parameters()).device
    inputs, targets = samples if samples is not None else data.normalized_darcy()
    inputs, targets = inputs.to(device), targets.to(device)
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(first, first + steps):
        batch = [data.sample_index(step, ddp_size, replica, len(inputs)) for replica in range(ddp_size)]
        x, y = inputs[batch], targets[batch]
        if decay:
            for group in optimizer.param_groups:
                group["lr"] = decayed_lr(lr, step, steps)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
