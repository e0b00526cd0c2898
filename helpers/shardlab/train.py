"""Training layer: one Darcy surrogate trained on a (ddp, domain) mesh with no wrapper, DDP or FSDP2.

Introduced in ``notebooks/05_ddp_vs_fsdp2.ipynb``; the capstone (07) builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass

WRAPPERS = ("none", "ddp", "fsdp2")


def normalized_darcy(samples: int | None = None) -> tuple:
    """(inputs, targets) of shape (N, 1, H, W): permeability centred and scaled, pressure scaled to O(1)."""
    from .data import load_darcy

    data = load_darcy(samples=samples)
    k, p = data["permeability"], data["pressure"]
    return (k - k.mean()) / k.std(), p / p.abs().max()


def wrap(model, mesh, how: str):
    """Sync plain weights and buffers over ``mesh["domain"]``, then wrap on ``mesh["ddp"]`` as asked.

    ``how``: "none" (gradients averaged by hand in ``train``), "ddp" (all parameters are plain
    tensors), or "fsdp2" (``fully_shard`` on the ddp mesh: parameters become DTensors).
    """
    from physicsnemo.domain_parallel import sync_module_over_mesh

    if how not in WRAPPERS:
        raise ValueError(f"how={how!r}: use one of {WRAPPERS}. FSDP1 and distribute_module are not options here.")
    if mesh["domain"].size() > 1:
        sync_module_over_mesh(model, mesh["domain"])  # before wrapping: FSDP2 would make them DTensors
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=mesh["ddp"].get_group())
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh["ddp"])
        return fully_shard(model, mesh=mesh["ddp"])
    return model


def average_gradients_by_hand(model, group) -> None:
    """What DDP does for you: all-reduce every gradient over the ddp group and divide by its size."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= size


@dataclass
class Run:
    """What ``train`` leaves behind: the loss per step and the wrapped model with its optimizer."""

    losses: list
    model: object
    optimizer: object


def train(model, mesh, how: str, steps: int = 5, lr: float = 1e-3, samples=None, on_step=None) -> Run:
    """Train on the mesh; ``.losses`` is the global mean loss per step (identical on every rank).

    Step s gives ddp replica i the sample s * ddp_size + i, scattered over its domain group
    (batch 1 per domain group). ``on_step(step, loss)`` is called after each step.
    """
    import torch
    import torch.distributed as dist
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.tensor import Shard

    inputs, targets = samples if samples is not None else normalized_darcy()
    ddp_size, replica = mesh["ddp"].size(), mesh.get_coordinate()[0]
    if (steps - 1) * ddp_size + replica >= len(inputs):
        raise ValueError(f"{steps} steps × ddp size {ddp_size} need {steps * ddp_size} samples; there are {len(inputs)}.")
    domain_group = mesh["domain"].get_group()
    src = dist.get_global_rank(domain_group, 0)
    wrapped = wrap(model, mesh, how)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        i = step * ddp_size + replica
        x, y = inputs[i : i + 1], targets[i : i + 1]
        if mesh["domain"].size() > 1:
            x = scatter_tensor(x, src, mesh["domain"], (Shard(2),))
            y = scatter_tensor(y, src, mesh["domain"], (Shard(2),))
        loss = ((wrapped(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        if how == "none" and ddp_size > 1:
            average_gradients_by_hand(model, mesh["ddp"].get_group())
        optimizer.step()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().reshape(1).clone()
        dist.all_reduce(value, group=mesh["ddp"].get_group())
        losses.append(value.item() / ddp_size)
        if on_step:
            on_step(step, losses[-1])
    return Run(losses, wrapped, optimizer)


def train_one_process(model, steps: int, ddp_size: int, lr: float = 1e-3, samples=None) -> list[float]:
    """The reference: one process, batch = the ddp replicas' samples of each step, same optimizer."""
    import torch

    inputs, targets = samples if samples is not None else normalized_darcy()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = inputs[step * ddp_size : (step + 1) * ddp_size], targets[step * ddp_size : (step + 1) * ddp_size]
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def state_bytes(model, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only)."""
    from .measure import local_bytes

    params = list(model.parameters())
    out = {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer state": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer state"] += sum(local_bytes(v) for v in state.values() if hasattr(v, "numel"))
    return out
