"""Judges of ``notebooks/02_device_mesh.ipynb``: a rank's ddp group worked out by rank arithmetic, and ddp groups
built by hand with ``dist.new_group`` and used for a gradient-style average.

Both answers are functions: each judge calls them on layouts the notebook never built, and works out what is right
by its own arithmetic (checked against the rank's ``(ddp, domain)`` mesh where the layout is the live one). The mesh's
own groups are what both exercises rebuild, so asking the mesh for them during the call fails.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..ranks.launch import default_device
from .judging import Watch, case_generator, second_hint

MESH_GROUPS = "the mesh's own groups, which this exercise builds by hand"


def _axis_ranks(mesh, axis: str) -> list[int]:
    return dist.get_process_group_ranks(mesh[axis].get_group())


def _ddp_lists(world: int, domain_size: int) -> list[list[int]]:
    return [list(range(offset, world, domain_size)) for offset in range(domain_size)]


def _watch_mesh_groups() -> Watch:
    return Watch(get_group=DeviceMesh.get_group, init_device_mesh=init_device_mesh,
                 get_process_group_ranks=dist.get_process_group_ranks, new_group=dist.new_group)


def _layouts(rng) -> list[tuple[int, int, int]]:
    """(rank, world, domain size) of four layouts the notebook never built, drawn afresh: domain groups of 1, one
    domain group filling the world, and two where the ddp and domain sizes differ (swapping them goes wrong there),
    with a rank past the start of the first domain group (a group starting at 0 goes wrong there)."""
    sizes = [(1, rng.randint(2, 6)), (rng.randint(2, 6), 1)]
    sizes += [(d, rng.choice([s for s in range(2, 6) if s != d])) for d in rng.sample(range(2, 6), 2)]
    layouts = []
    for domain_size, ddp_size in sizes:
        world = domain_size * ddp_size
        if domain_size > 1 and ddp_size > 1:
            rank = domain_size * rng.randrange(1, ddp_size) + rng.randrange(1, domain_size)
        else:
            rank = rng.randrange(1, world)
        layouts.append((rank, world, domain_size))
    rng.shuffle(layouts)
    return layouts


@second_hint(
    "Use the three arguments only, not dist.get_rank() or the mesh. A rank sits at position rank % domain_size of"
    " its domain group; its ddp group is every rank at that position: position, position + domain_size, ... below"
    " world (a range with a step)."
)
def ddp_ranks(ddp_group_of, mesh) -> str | None:
    """Exercise 1. Doing it means: from ``rank``, ``world`` and ``domain_size`` alone, list the ranks that share
    ``rank``'s position in their domain group (consecutive ranks form the domain groups), sorted.

    ``ddp_group_of(rank, world, domain_size)`` is called for this rank (compared with ``mesh["ddp"]``) and for
    layouts of other sizes, drawn for each check; asking the mesh or a process group for its ranks fails."""
    if not callable(ddp_group_of):
        return (f"ddp_group_of is a {type(ddp_group_of).__name__}: define a function ddp_group_of(rank, world, "
                "domain_size) that returns a list")
    others = _layouts(case_generator())
    me = (dist.get_rank(), dist.get_world_size(), mesh["domain"].size())
    truth = _axis_ranks(mesh, "ddp")
    with _watch_mesh_groups() as watch:
        mine = ddp_group_of(*me)
        answers = [(case, ddp_group_of(*case)) for case in others]
    problem = watch.forbidden(get_group=MESH_GROUPS, get_process_group_ranks=MESH_GROUPS, init_device_mesh=MESH_GROUPS,
                              new_group="but no group is needed: this is arithmetic on rank numbers")
    if problem:
        return problem
    for (rank, world, domain_size), got in [(me, mine), *answers]:
        where = f"for rank {rank} of {world} with domain groups of {domain_size}"
        if not isinstance(got, (list, tuple)) or not all(isinstance(r, int) for r in got):
            return f"{where} it returned {got!r}: return a sorted list of ranks (ints)"
        right = truth if (rank, world, domain_size) == me else _ddp_lists(world, domain_size)[rank % domain_size]
        if list(got) == right:
            continue
        said = f"{where} it returned {list(got)}, expected {right}"
        if (rank, world, domain_size) != me and list(got) == list(mine):
            return (f"{said}: it gave the same as for this rank of the running notebook; work the group out from the "
                    "arguments, not from this process or an earlier result")
        start = rank - rank % domain_size
        if sorted(got) == list(range(start, start + domain_size)):
            return (f"{said}: that is the rank's domain group (the ranks sharing one sample); the ddp group joins the "
                    "ranks at the same position of every domain group")
        return f"{said}, the ranks at that rank's position in every domain group, sorted"
    return None


def _tensor_of(rank: int, seed: int, device) -> torch.Tensor:
    """The tensor rank ``rank`` averages in the case ``seed``: the judge can rebuild any rank's without asking it."""
    generator = torch.Generator().manual_seed(seed + rank)
    return torch.randn(5, generator=generator).to(device)


@second_hint(
    "On every rank, create every ddp group in the same order: dist.new_group(list(range(offset, world, "
    "domain_size))) for each offset in range(domain_size). Take the one at rank % domain_size, all-reduce a clone"
    " of t with group= that group (without it the sum runs over every rank), and divide by "
    "dist.get_world_size(group)."
)
def hand_made_ddp_average(ddp_average, mesh) -> str | None:
    """Exercise 2. Doing it means: every rank creates every ddp group with ``dist.new_group`` (consecutive ranks form
    domain groups of ``domain_size``), all-reduces the tensor it was given over its own ddp group, and divides by
    the group's size.

    ``ddp_average(t, domain_size)`` is called with a random tensor per rank, for this notebook's domain size and for
    up to two other domain sizes that divide the world, drawn for each check. Observed: the groups ``new_group``
    created, the all-reduce's group, the value; the mesh's groups may not be used."""
    if not callable(ddp_average):
        return (f"ddp_average is a {type(ddp_average).__name__}: define a function ddp_average(t, domain_size) that "
                "returns the averaged tensor")
    rank, world, device = dist.get_rank(), dist.get_world_size(), default_device()
    rng = case_generator()
    others = [d for d in range(1, world + 1) if world % d == 0 and d != mesh["domain"].size()]
    sizes = [mesh["domain"].size(), *rng.sample(others, min(2, len(others)))]
    rng.shuffle(sizes)
    runs = []
    for domain_size in sizes:  # every call on every rank, then verdicts
        seed = rng.randrange(2**31)
        with _watch_mesh_groups() as watch:
            got = ddp_average(_tensor_of(rank, seed, device), domain_size)
        runs.append((domain_size, seed, got, watch))
    for domain_size, seed, got, watch in runs:
        ddp_lists = _ddp_lists(world, domain_size)
        mine = ddp_lists[rank % domain_size]
        where = f"with domain groups of {domain_size}"
        problem = watch.forbidden(get_group=MESH_GROUPS, init_device_mesh=MESH_GROUPS)
        if problem:
            return problem
        created = [sorted(e.arguments.get("ranks") or range(world)) for e in watch.calls("new_group")]
        if not created:
            return (f"{where}, no process group was created during the call: create the ddp groups with "
                    "dist.new_group there (a group made earlier in the notebook was made for another layout)")
        missing = [g for g in ddp_lists if g not in created]
        if missing:
            domain_lists = [list(range(s, s + domain_size)) for s in range(0, world, domain_size)]
            if any(g in created for g in domain_lists if len(g) > 1):
                return (f"{where}, the groups created are the domain groups (the ranks sharing one sample), not the "
                        "ddp groups")
            return (f"{where}, the groups created do not include every ddp group, e.g. {missing[0]}: every rank "
                    "creates every group, in the same order")
        reductions = watch.collectives("all_reduce")
        if not reductions:
            return f"{where}, nothing was all-reduced: all-reduce the tensor over this rank's ddp group"
        if not any(list(e.ranks) == mine for e in reductions):
            ranks = sorted({tuple(e.ranks) for e in reductions})
            if list(range(world)) in [list(r) for r in ranks] and mine != list(range(world)):
                return f"{where}, the all-reduce ran over every rank, not over this rank's ddp group"
            return f"{where}, the all-reduce ran over ranks {[list(r) for r in ranks]}, not over this rank's ddp group"
        if not isinstance(got, torch.Tensor):
            return f"{where}, ddp_average returned a {type(got).__name__}: return the averaged tensor"
        if got.device.type != mesh.device_type:
            return f"{where}, the result lives on {got.device}, but the mesh's ranks compute on {mesh.device_type}"
        own = [_tensor_of(r, seed, device).cpu() for r in mine]
        total = torch.stack(own).sum(0)
        if tuple(got.shape) != tuple(total.shape):
            return f"{where}, the result has shape {tuple(got.shape)}, not the shape of the tensor it was given"
        if len(mine) > 1 and torch.allclose(got.cpu(), total, atol=1e-6):
            return f"{where}, the result holds the sum over the group: DDP averages, so divide by the group's size"
        if torch.allclose(got.cpu(), torch.full_like(total, sum(mine) / len(mine))):
            return (f"{where}, the result is the average of the group's rank numbers: average the tensor the function "
                    "was given, not the notebook's torch.full((3,), rank)")
        if not torch.allclose(got.cpu(), total / len(mine), atol=1e-6):
            return f"{where}, the result is not the average over this rank's ddp group of the tensors it was given"
    return None

