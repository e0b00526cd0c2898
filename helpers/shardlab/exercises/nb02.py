"""Judges of ``notebooks/02_device_mesh.ipynb``: a ddp group worked out by rank arithmetic, and ddp groups built
by hand with ``dist.new_group`` and used for a gradient-style average. Each judge reads what is right from the
rank's own ``(ddp, domain)`` mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _axis_ranks(mesh, axis: str) -> list[int]:
    return dist.get_process_group_ranks(mesh[axis].get_group())


def ddp_ranks(answer, mesh) -> str | None:
    """On a rank: ``answer`` must list the ranks of this rank's ddp group, as the mesh has it."""
    if not isinstance(answer, (list, tuple)) or not all(isinstance(r, int) for r in answer):
        return f"answer is {answer!r}: set it to a sorted list of ranks (ints)"
    if dist.get_rank() not in answer:
        return f"{list(answer)} does not contain this rank: a rank is always in its own ddp group"
    if list(answer) == _axis_ranks(mesh, "ddp"):
        return None
    if sorted(answer) == _axis_ranks(mesh, "domain"):
        return (f"{list(answer)} is this rank's domain group (the ranks sharing one sample); the ddp group joins "
                "the ranks at the same position of every domain group")
    if len(answer) != mesh["ddp"].size():
        return f"{list(answer)} has {len(answer)} ranks, but a ddp group has one rank per domain group"
    return f"{list(answer)} is not this rank's ddp group (or is not sorted)"


def hand_made_ddp_average(ddp_group, answer, mesh) -> str | None:
    """On a rank: ``ddp_group`` must be a process group with the ranks of ``mesh["ddp"]``, and ``answer`` the
    average over it of ``torch.full((3,), float(rank))``, on the mesh's device."""
    if not isinstance(ddp_group, dist.ProcessGroup):
        return f"ddp_group is a {type(ddp_group).__name__}: keep the process group dist.new_group returned"
    got = dist.get_process_group_ranks(ddp_group)
    expected = _axis_ranks(mesh, "ddp")
    if got != expected:
        if got == _axis_ranks(mesh, "domain"):
            return f"ddp_group holds ranks {got}: that is this rank's domain group, not its ddp group"
        return f"ddp_group holds ranks {got}, which are not the ranks of this rank's ddp group"
    if not isinstance(answer, torch.Tensor):
        return f"answer is a {type(answer).__name__}: keep the tensor you all-reduced"
    if answer.device.type != mesh.device_type:
        return f"answer lives on {answer.device}, but the mesh's ranks compute on {mesh.device_type}"
    if tuple(answer.shape) != (3,):
        return f"answer has shape {tuple(answer.shape)}: all-reduce torch.full((3,), float(rank)) itself"
    mean = sum(expected) / len(expected)
    if torch.allclose(answer.cpu(), torch.full((3,), float(sum(expected)))) and len(expected) > 1:
        return "answer holds the sum over the group: DDP averages, so divide by the group's size"
    if not torch.allclose(answer.cpu(), torch.full((3,), mean)):
        return "answer is not the average of the group's rank numbers: all-reduce over ddp_group, then divide"
    return None
