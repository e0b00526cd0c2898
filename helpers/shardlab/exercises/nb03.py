"""Judges of ``notebooks/03_scatter_and_shardtensor.ipynb``: the rows a rank owns in an unequal decomposition, a
scatter along W, and a scatter built by hand (broadcast + narrow + ``ShardTensor.from_local``) matched against
``scatter_tensor``. Each judge reads what is right from the rank's own ShardTensors and mesh; none calls a
collective, so a rank whose answer is wrong cannot leave the others waiting."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard


def _is_shard_tensor(t) -> bool:
    from physicsnemo.domain_parallel import ShardTensor

    return isinstance(t, ShardTensor)


def rows_held(answer, slabs) -> str | None:
    """On a rank: ``answer`` must be the global ``(start, stop)`` rows of this rank's slab of ``slabs``."""
    if not isinstance(answer, tuple) or len(answer) != 2 or not all(isinstance(v, int) for v in answer):
        return f"answer is {answer!r}: set it to a tuple of two ints, (start, stop)"
    start, stop = answer
    local_rows = slabs.to_local().shape[2]
    if stop - start != local_rows:
        return f"({start}, {stop}) spans {stop - start} rows, but this rank's slab has a different number of rows"
    if start != slabs.offsets(mesh_dim=0):
        if start == 0:
            return "start is 0 on a rank whose slab does not begin the field: count the rows of the ranks before it"
        return f"this rank's slab does not start at row {start}: the ranks before it own other numbers of rows"
    return None


def w_shard(xw, answer, mesh) -> str | None:
    """On a rank: ``xw`` must be the sample scattered along W over ``mesh["domain"]``, and ``answer`` its local
    shape on this rank."""
    if not _is_shard_tensor(xw):
        return f"xw is a {type(xw).__name__}: keep what scatter_tensor returned"
    if tuple(xw.placements) != (Shard(3),):
        return f"xw is placed {tuple(xw.placements)}: W is dimension 3 of (N, C, H, W)"
    domain = mesh["domain"]
    if xw.device_mesh.mesh.tolist() != domain.mesh.tolist():
        return "xw is spread over other ranks than this rank's domain group: scatter over mesh['domain']"
    if not isinstance(answer, tuple):
        return f"answer is {answer!r}: set it to a tuple (the local shape), e.g. with tuple(...)"
    if answer == tuple(xw.shape) and tuple(xw.shape) != tuple(xw.to_local().shape):
        return "answer is xw's global shape (xw.shape); the rank holds only its own columns"
    # What this rank should hold, from the global shape and its place in the domain group (torch.chunk's split).
    columns = torch.empty(xw.shape[3], device="meta").chunk(domain.size())[domain.get_local_rank()].shape[0]
    if answer != (*xw.shape[:3], columns):
        return f"{answer} is not the shape of the block this rank holds"
    return None


def matches_scatter(mine, reference) -> str | None:
    """On a rank: ``mine`` (built by hand) must be the ShardTensor ``scatter_tensor`` gave as ``reference``:
    same type, mesh, placements, global shape, shard sizes and local values, on the same device."""
    if not _is_shard_tensor(mine):
        kind = type(mine).__name__
        return (f"mine is a {kind}, not a ShardTensor: build it with ShardTensor.from_local"
                + (" (a plain DTensor does not carry per-rank shard sizes)" if kind == "DTensor" else ""))
    if mine.device_mesh.mesh.tolist() != reference.device_mesh.mesh.tolist():
        return "mine lives on a different set of ranks than this rank's domain group"
    if tuple(mine.placements) != tuple(reference.placements):
        return f"mine is placed {tuple(mine.placements)}, scatter_tensor's result is placed differently"
    if tuple(mine.shape) != tuple(reference.shape):
        return f"mine has global shape {tuple(mine.shape)}, which is not the sample's"
    local, expected = mine.to_local(), reference.to_local()
    if local.device != expected.device:
        return f"mine's local shard is on {local.device}, not on this rank's device"
    if tuple(local.shape) != tuple(expected.shape):
        return f"this rank's local shard has shape {tuple(local.shape)}, not the rows it should own"
    if not torch.equal(local, expected):
        return "this rank's local shard holds other values: narrow to the rows of this rank's place in its domain group"
    if mine._spec.sharding_shapes() != reference._spec.sharding_shapes():
        return "the shard sizes recorded in mine's spec differ from scatter_tensor's (check sharding_shapes)"
    return None
