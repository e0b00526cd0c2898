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


def _halo_width(kernel_size: int) -> int:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size={kernel_size}: use an odd size (3, 5, ...), which pads the same on both sides.")
    return kernel_size // 2


def halo_plan(height: int, n_ranks: int, kernel_size: int) -> list[dict]:
    """Per rank, the rows it owns and the halo rows it receives from rank r-1 (above) and r+1 (below)."""
    halo = _halo_width(kernel_size)
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
    if mesh.ndim != len(placements):  # upstream hangs in a collective the ranks enter differently
        raise MeshError(f"{len(placements)} placement(s) for a {mesh.ndim}-D mesh {tuple(mesh.mesh_dim_names or ())}: "
                        "give one placement per mesh axis, or pass the axis you scatter over, e.g. mesh['domain'].")
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


# Two domain axes: a field tiled over H (domain_h) and W (domain_w). Introduced in ``12_data_at_scale``.
TILE_AXES = ("ddp", "domain_h", "domain_w")
TILE_DIMS = (2, 3)  # the H and W dims of an (N, C, H, W) field, sharded over domain_h and domain_w


def _check_tiles(tiles) -> tuple[int, int]:
    if not (isinstance(tiles, (tuple, list)) and len(tiles) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tiles)):
        raise MeshError(f"tiles={tiles!r}: give (tiles along H, tiles along W) as two positive integers, "
                        "e.g. tiles=(2, 2).")
    return int(tiles[0]), int(tiles[1])


def resolve_tile_shape(world_size: int, ddp: int = -1, tiles=(2, 2)) -> tuple[int, int, int]:
    """(ddp, domain_h, domain_w) sizes for ``tiles`` = (tiles along H, tiles along W), ``ddp=-1`` inferred; or a
    MeshError saying what to change."""
    rows, cols = _check_tiles(tiles)
    domain = rows * cols
    if ddp != -1 and (not isinstance(ddp, int) or ddp < 1):
        raise MeshError(f"ddp={ddp!r}: an axis size is a positive integer, or -1 to infer it.")
    if ddp == -1:
        if world_size % domain:
            raise MeshError(f"tiles={rows, cols} put {domain} ranks in each domain group, which does not divide the "
                            f"world size {world_size}: choose tiles whose product is one of {_divisors(world_size)}, "
                            f"or start {domain * -(-world_size // domain)} ranks.")
        ddp = world_size // domain
    if ddp * domain != world_size:
        raise MeshError(f"ddp × tiles = {ddp} × {rows}×{cols} = {ddp * domain}, but the world size is {world_size}. "
                        f"Use ddp=-1 to infer it, with tiles whose product is one of {_divisors(world_size)}.")
    return ddp, rows, cols


def build_tile_mesh(ddp: int = -1, tiles=(2, 2)):
    """The global ``(ddp, domain_h, domain_w)`` DeviceMesh, through ``DistributedManager.initialize_mesh``; a field
    is tiled over its ``tile_domain``."""
    from physicsnemo.distributed import DistributedManager

    manager = DistributedManager()
    return manager.initialize_mesh(resolve_tile_shape(manager.world_size, ddp, tiles), TILE_AXES)


def tile_domain(mesh):
    """The 2-D ``(domain_h, domain_w)`` submesh of this rank: the ranks that tile one sample."""
    names = mesh.mesh_dim_names or ()
    if not set(TILE_AXES[1:]) <= set(names):
        raise MeshError(f"a mesh with axes {names} has no (domain_h, domain_w) axes: build it with "
                        "build_tile_mesh(ddp=-1, tiles=(rows, cols)).")
    return mesh[TILE_AXES[1:]]


def tile_placements() -> tuple:
    """``(Shard(2), Shard(3))``: H over domain_h, W over domain_w, for an (N, C, H, W) field on ``tile_domain``."""
    from torch.distributed.tensor import Shard

    return tuple(Shard(dim) for dim in TILE_DIMS)


def scatter_tiles(field, mesh, requires_grad: bool = False):
    """``field`` (N, C, H, W), from the first rank of this rank's domain group, tiled over its ``tile_domain``."""
    domain = tile_domain(mesh)
    source = int(domain.mesh.flatten()[0])
    return scatter(field, source, domain, tile_placements(), requires_grad=requires_grad)


def tile_bounds(height: int, width: int, tiles) -> list[dict]:
    """Per domain rank (row-major: rank = i × tiles along W + j): its tile coordinates (i, j) and the rows and
    columns it owns, split as ``scatter_tensor`` splits each axis (``shard_bounds``)."""
    rows, cols = _check_tiles(tiles)
    return [{"rank": i * cols + j, "coords": (i, j), "rows": (r0, r1), "cols": (c0, c1)}
            for i, r0, r1 in shard_bounds(height, rows) for j, c0, c1 in shard_bounds(width, cols)]


def _neighbours(index: int, count: int) -> int:
    return (index > 0) + (index < count - 1)


def halo_bytes_slab(height: int, width: int, channels: int, n_ranks: int, kernel_size: int,
                    itemsize: int = 4) -> list[int]:
    """Bytes each domain rank sends in one 'same' convolution's halo exchange, the field split along H over
    ``n_ranks``: k//2 rows × W × C to each neighbour. The backward pass sends as many back."""
    halo = _halo_width(kernel_size)
    plan = halo_plan(height, n_ranks, kernel_size)  # refuses shards thinner than the halo
    return [halo * width * channels * itemsize * ((p["from_above"] is not None) + (p["from_below"] is not None))
            for p in plan]


def halo_bytes_tile(height: int, width: int, channels: int, tiles, kernel_size: int, itemsize: int = 4) -> list[int]:
    """Bytes each domain rank sends in one 'same' convolution's halo exchange, the field tiled ``tiles`` = (along H,
    along W), in ``tile_bounds`` order.

    PhysicsNeMo exchanges one axis after the other (``conv_patches.partial_conv_nd`` applies ``halo_padding`` per
    sharded dim, in mesh order): first k//2 rows × the tile's columns to each H neighbour; then k//2 columns of the
    tile already padded along H (its rows + 2·(k//2): halo rows, or the conv's zero padding at the edge) to each W
    neighbour. The corners travel in the second step; there is no diagonal exchange."""
    halo = _halo_width(kernel_size)
    n_rows, n_cols = _check_tiles(tiles)
    sent = []
    for tile in tile_bounds(height, width, (n_rows, n_cols)):
        (i, j), (r0, r1), (c0, c1) = tile["coords"], tile["rows"], tile["cols"]
        if min(r1 - r0, c1 - c0) < halo:
            raise ValueError(f"a {kernel_size}×{kernel_size} kernel needs {halo} halo row(s) and column(s) from each "
                             f"neighbour, but tile {(i, j)} is only {r1 - r0}×{c1 - c0}: use fewer tiles or a larger "
                             f"field than {height}×{width}.")
        along_h = _neighbours(i, n_rows) * halo * (c1 - c0)
        along_w = _neighbours(j, n_cols) * halo * (r1 - r0 + 2 * halo)
        sent.append((along_h + along_w) * channels * itemsize)
    return sent


def conv_halo_bytes(model, height: int, width: int, layout, itemsize: int | None = None) -> list[int]:
    """Bytes each domain rank sends in the halo exchanges of one forward pass of ``model``'s Conv2d layers:
    ``layout`` an int N (slabs along H) or (tiles along H, tiles along W). ``itemsize``: the parameters' by default.

    Only 'same' convolutions (stride 1, padding k//2, square odd kernels), which keep H and W: every layer then
    sees the same field."""
    import torch

    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    itemsize = itemsize or next(model.parameters()).element_size()
    total = None
    for conv in convs:
        k = conv.kernel_size[0]
        if conv.kernel_size != (k, k) or conv.stride != (1, 1) or conv.padding != (k // 2, k // 2):
            raise ValueError(f"{conv}: the halo arithmetic covers 'same' convolutions only (stride 1, padding k//2, "
                             "square odd kernel).")
        if isinstance(layout, int):
            sent = halo_bytes_slab(height, width, conv.in_channels, layout, k, itemsize)
        else:
            sent = halo_bytes_tile(height, width, conv.in_channels, layout, k, itemsize)
        total = sent if total is None else [a + b for a, b in zip(total, sent)]
    if total is None:
        raise ValueError(f"{type(model).__name__} has no Conv2d layer: there is no halo to count.")
    return total


def halo_by_tile_grid(height: int, width: int, n_ranks: int, kernel_size: int = 3) -> dict[tuple[int, int], int]:
    """The busiest rank's halo per channel and byte of item (``halo_bytes_tile``'s largest entry at C = 1,
    itemsize 1) for every tile grid of ``n_ranks``, (N, 1) being slabs along H; grids whose tiles are thinner than
    the halo are left out. Per convolution, h = k//2:

    - slabs: min(2, N−1)·h·W·C, whatever N: past N = 3 more ranks never shrink it;
    - tiles ph × pw: h·C·(a·W/pw + b·(H/ph + 2h)), a = min(2, ph−1), b = min(2, pw−1): a tile's perimeter.
    - With neighbours on every side (ph, pw ≥ 3) tiles win when W/pw + H/ph + 2h < W. On the best grid
      (ph/pw ≈ H/W) W/pw + H/ph = 2·√(HW/N): tiles win once N > 4·(H/W)·(W/(W − 2h))², about 4·H/W: the
      perimeter shrinks as 1/√N, a slab's edge never. Edge tiles have fewer neighbours, so small grids cross earlier:
      a square field, from N = 4 (2×2: h·C·(L + 2h) against 2·h·L·C); 256×16 (k = 3), slabs through N = 32, a
      32×2 grid at 64.
    """
    grids = {}
    for rows in _divisors(n_ranks):
        try:
            grids[(rows, n_ranks // rows)] = max(halo_bytes_tile(height, width, 1, (rows, n_ranks // rows),
                                                                 kernel_size, 1))
        except ValueError:
            continue
    return grids
