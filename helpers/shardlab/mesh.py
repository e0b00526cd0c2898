"""Mesh layer: the named ``(ddp, domain)`` DeviceMesh, with shapes checked before torch sees them.

Also the sharding arithmetic drawn and measured in the notebooks: shard bounds and halo plans.
Introduced in ``notebooks/01_launchers.ipynb`` (smoke CLI); taught in ``02_device_mesh``.
"""

from __future__ import annotations

import torch.distributed as dist

# PhysicsNeMo is imported inside the functions that use it: the shape rules and the halo arithmetic
# also run in the notebook kernel, which need not pay PhysicsNeMo's import (seconds) for them.

MESH_AXES = ("ddp", "domain")


class MeshError(ValueError):
    """A mesh shape that cannot work for this world size; the message says what to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_mesh_shape(world_size: int, ddp: int = -1, domain: int = 1) -> tuple[int, int]:
    """(ddp, domain) sizes with at most one ``-1`` filled in, or a MeshError saying what to change."""
    if ddp == -1 and domain == -1:
        raise MeshError("both ddp and domain are -1: at most one axis can be inferred. Fix the domain size, "
                        "e.g. domain=2.")
    for name, size in (("ddp", ddp), ("domain", domain)):
        if size != -1 and (not isinstance(size, int) or size < 1):
            raise MeshError(f"{name}={size!r}: an axis size is a positive integer, or -1 to infer it.")
    fixed = domain if ddp == -1 else ddp
    if ddp == -1 or domain == -1:
        if world_size % fixed:
            other = "domain" if ddp == -1 else "ddp"
            raise MeshError(
                f"{other}={fixed} does not divide the world size {world_size}: choose one of "
                f"{_divisors(world_size)}, or start {fixed * -(-world_size // fixed)} ranks."
            )
        ddp, domain = (world_size // domain, domain) if ddp == -1 else (ddp, world_size // ddp)
    if ddp * domain != world_size:
        raise MeshError(
            f"ddp × domain = {ddp} × {domain} = {ddp * domain}, but the world size is {world_size}. "
            f"Use ddp=-1 to infer it, with domain one of {_divisors(world_size)}."
        )
    return ddp, domain


def build_mesh(ddp: int = -1, domain: int = 1):
    """The global ``(ddp, domain)`` DeviceMesh, created through ``DistributedManager.initialize_mesh``."""
    from physicsnemo.distributed import DistributedManager

    manager = DistributedManager()
    shape = resolve_mesh_shape(manager.world_size, ddp, domain)
    return manager.initialize_mesh(shape, MESH_AXES)


def domain_source(mesh) -> int:
    """Global rank of the first rank of this rank's domain group: where its sample is loaded and scattered from."""
    return dist.get_global_rank(mesh["domain"].get_group(), 0)


def check_batch_per_domain_group(batch_size: int, domain_size: int) -> None:
    """PhysicsNeMo's domain parallelism shards one sample per domain group: batch 1, scale on ddp."""
    if domain_size > 1 and batch_size != 1:
        raise MeshError(
            f"batch size {batch_size} per domain group: with domain parallelism (domain size {domain_size}) each "
            "domain group works on exactly one sample. Use batch 1 per domain group and scale the global "
            "batch on the ddp axis (global batch = ddp size)."
        )


def shard_bounds(height: int, n_ranks: int) -> list[tuple[int, int, int]]:
    """(rank, start, stop) of the rows each rank gets from ``scatter_tensor``: ``torch.chunk``'s split, every
    rank ceil(height / n) rows until they run out, so the last ranks may get fewer rows, or none."""
    if n_ranks < 1 or height < 0:
        raise ValueError(f"cannot split {height} rows over {n_ranks} ranks: need height >= 0 and n_ranks >= 1.")
    size = -(-height // n_ranks)
    return [(rank, min(rank * size, height), min((rank + 1) * size, height)) for rank in range(n_ranks)]


def halo_plan(height: int, n_ranks: int, kernel_size: int) -> list[dict]:
    """Per rank, the rows it owns and the halo rows it receives from rank r-1 (above) and r+1 (below)."""
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size={kernel_size}: use an odd size (3, 5, ...), which pads the same on both sides.")
    halo = kernel_size // 2
    bounds = shard_bounds(height, n_ranks)
    if n_ranks > 1 and halo:
        for rank, start, stop in bounds:
            if stop - start < halo:
                raise ValueError(
                    f"a {kernel_size}×{kernel_size} kernel needs {halo} halo row(s) from each neighbour, but rank "
                    f"{rank} owns only {stop - start} of {height} rows: use at most {height // halo} ranks or a "
                    "taller field."
                )
    plan = []
    for rank, start, stop in bounds:
        plan.append({
            "rank": rank,
            "owned": (start, stop),
            "from_above": (start - halo, start) if rank > 0 and halo else None,
            "from_below": (stop, stop + halo) if rank < n_ranks - 1 and halo else None,
        })
    return plan


def scatter(tensor, global_src: int, mesh, placements, global_shape=None, dtype=None, requires_grad: bool = False):
    """``scatter_tensor`` with its inputs checked first, on every rank, with a message that says what to change.

    Upstream accepts a ``global_shape`` that contradicts the tensor and silently builds an
    inconsistent ShardTensor; a source outside the mesh gets a terse error.
    """
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import scatter_tensor

    ranks = mesh.mesh.flatten().tolist()
    if global_src not in ranks:
        raise MeshError(f"source rank {global_src} is not in this mesh (ranks {ranks}): use a global rank of the "
                        "mesh, e.g. dist.get_global_rank(mesh.get_group(), 0).")
    problem = [None]
    if dist.get_rank() == global_src and global_shape is not None and tuple(global_shape) != tuple(tensor.shape):
        problem[0] = (f"global_shape {tuple(global_shape)} does not match the tensor's shape {tuple(tensor.shape)} on "
                      f"the source rank {global_src}: pass global_shape=tensor.shape, or leave it None.")
    dist.broadcast_object_list(problem, src=global_src, group=DistributedManager().get_mesh_group(mesh))
    if problem[0]:
        raise MeshError(problem[0])
    return scatter_tensor(tensor, global_src, mesh, placements, global_shape=global_shape, dtype=dtype,
                          requires_grad=requires_grad)
