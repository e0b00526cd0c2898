"""Judges of ``notebooks/10_beyond_halos.ipynb``: a shard patch of the learner's own, registered with PhysicsNeMo's
handler API for an operator ShardTensor has no handler for (``sl.models.DIFFUSE``, a 5-point stencil).

The judge calls the operator on ShardTensors it builds itself (the notebook's ``xf``, a field of its shape with other
values, and a field of 4n - 1 rows, split unevenly), each with another ``alpha``, forward and backward, and watches the
work: the registered handler is the learner's and runs, nothing gathers the field, no message is larger than the halo
rows, the output and the input gradient equal the operator's on the whole field.
After judging it restores the registries from a snapshot taken before the answer (``registry_snapshot``,
``restore_registry``), so no learner's handler outlives the exercise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..models import DIFFUSE, diffuse
from ..ranks.rankstate import restore_registry
from .judging import Watch, earlier_object, second_hint
from .nb04 import SMALL, _diagnose, _shard_tensor

HALO = 1  # rows of each neighbour the 5-point stencil reads



def registered_handler(op=DIFFUSE):
    """The handler ShardTensor would run for ``op`` (by the operator, then by its name), or None."""
    ShardTensor = _shard_tensor()
    return ShardTensor._function_registry.get(op) or ShardTensor._named_function_registry.get(str(op))


def _cases(x):
    """(what, whole field, the same field scattered along H with requires_grad, alpha): the judge's own inputs."""
    from physicsnemo.domain_parallel import scatter_tensor

    mesh = x.device_mesh
    source = dist.get_global_rank(mesh.get_group(), 0)
    generator = torch.Generator().manual_seed(10)
    other = torch.randn(tuple(x.shape), generator=generator).to(x.device)
    uneven = torch.randn(1, 2, 4 * mesh.size() - 1, 6, generator=generator).to(x.device)
    cases = []
    for what, whole, alpha in (("xf", x.full_tensor(), 0.1), ("a field of xf's shape with other values", other, 0.25),
                               ("a field of 4n - 1 rows, split unevenly", uneven, 0.15)):
        cases.append((what, whole, scatter_tensor(whole, source, mesh, (Shard(2),), requires_grad=True), alpha))
    return cases


@second_hint(
    "Work on the t you are given, not xf. halo_padding(t.to_local(), t.device_mesh, HaloConfig(mesh_dim=0, "
    "tensor_dim=2, halo_size=1, edge_padding_size=1)) brings one row of each neighbour (zeros at the field's "
    "ends), differentiably; apply func(padded, alpha), drop the first and last row, and wrap with "
    "ShardTensor.from_local(out, t.device_mesh, t.placements, sharding_shapes=t._spec.sharding_shapes()). No "
    "full_tensor()."
)
def shard_patch(patch, x, before: dict) -> str | None:
    """Exercise. Doing it means: a handler ``patch(func, types, args, kwargs)`` registered for ``DIFFUSE`` that takes
    one halo row from each neighbour (zeros where the field ends), runs ``func`` on the padded local rows, trims the
    halo and returns a ShardTensor laid out like its input, and whose exchange is differentiable (PhysicsNeMo's
    ``halo_padding``, or an autograd.Function of one's own).

    Observed, on each of the judge's inputs: the handler registered for the operator is ``patch`` and it runs; no
    message moves more than the halo rows and ``full_tensor``/``redistribute`` do not run; the result is a new
    ShardTensor with the input's placements and shard sizes; its values and the input's gradient equal the operator's
    on the whole field (computed by the judge outside the watched call). Then the registries are put back as they
    were in ``before`` (a ``registry_snapshot()`` taken before the answer cell ran), whatever the answer registered."""
    ShardTensor = _shard_tensor()
    from torch.distributed.tensor import DTensor

    try:
        if not callable(patch):
            return (f"diffuse_patch is a {type(patch).__name__}: define a function "
                    "diffuse_patch(func, types, args, kwargs)")
        if registered_handler() is None:
            return ("no handler is registered for the operator: register diffuse_patch with "
                    "ShardTensor.register_function_handler (the check unregisters it after judging: run the answer "
                    "cell again to register it again)")
        runs = []
        for what, whole, sharded, alpha in _cases(x):  # every rank runs every case before any verdict
            with Watch(patch=patch, full_tensor=(ShardTensor.full_tensor, DTensor.full_tensor),
                       redistribute=DTensor.redistribute) as watch:
                try:
                    out = DIFFUSE(sharded, alpha)
                except Exception as error:  # noqa: BLE001  a wrong patch raises on this rank: a verdict, not a crash
                    out = error
            runs.append((what, whole, sharded, alpha, out, watch))
        # Backward on every rank, in the same order (a patch that communicates in backward needs all ranks there).
        for _, whole, sharded, _, out, _ in runs:
            if isinstance(out, ShardTensor) and out.requires_grad and tuple(out.shape) == tuple(whole.shape):
                (out.to_local() * _loss_weights(whole)[..., slice(*_rows(sharded)), :]).sum().backward()
        x_whole = runs[0][1]
        # Every case's forward first, then the gradients: a wrong forward is the more telling verdict.
        for what, whole, sharded, alpha, out, watch in runs:
            problem = _judge_forward(patch, what, whole, sharded, alpha, out, watch, x_whole)
            if problem:
                return problem
        for what, whole, sharded, alpha, _, _ in runs:
            problem = _judge_gradient(what, whole, sharded, alpha)
            if problem:
                return problem
        return None
    finally:
        restore_registry(before)


def _wrong_source(got, expected, whole, local, alpha, x_whole, first, stop) -> str | None:
    """What a wrong output was computed from, when it is the stencil of something other than this input's rows."""
    if tuple(got.shape) != tuple(expected.shape):
        return None
    candidates = [("the stencil on this rank's slab alone: the rows next to the slab's edges need a halo row from the "
                   "neighbour", diffuse(local, alpha))]
    if tuple(x_whole.shape) == tuple(whole.shape) and not torch.equal(x_whole, whole):
        candidates.append(("the stencil of xf, not of the tensor the operator was given: compute from args",
                           diffuse(x_whole, alpha)[..., first:stop, :]))
    candidates += [(f"the stencil with alpha={a}, not the alpha the operator was given",
                    diffuse(whole, a)[..., first:stop, :]) for a in (0.1, 0.15, 0.25) if a != alpha]
    return next((f"the rows are {why}" for why, candidate in candidates
                 if torch.allclose(got, candidate, atol=1e-5, rtol=1e-5)), None)


def _loss_weights(whole):
    """A loss weight per value of the whole field, so that every output row's gradient differs."""
    return torch.linspace(-1, 1, whole.numel(), device=whole.device).reshape(whole.shape)


def _rows(sharded) -> tuple[int, int]:
    """(first, last + 1) global rows of H this rank holds."""
    start = sharded.offsets(mesh_dim=0)
    return start, start + sharded.to_local().shape[2]


def _judge_forward(patch, what, whole, sharded, alpha, out, watch, x_whole) -> str | None:
    ShardTensor = _shard_tensor()
    where = f"on {what} (alpha={alpha})"
    if not watch.calls("patch"):
        return (f"{where}: diffuse_patch did not run: the handler registered for the operator is "
                f"{getattr(registered_handler(), '__name__', registered_handler())!r}; register diffuse_patch itself")
    problem = watch.forbidden(full_tensor="which gathers the whole field onto every rank: exchange only the halo rows",
                              redistribute="which moves whole shards between ranks: exchange only the halo rows")
    if problem:
        return f"{where}: {problem}"
    local = sharded.to_local()
    halo_bytes = HALO * local[..., :1, :].nbytes
    bulky = [e for e in watch.collectives() if e.bytes > 2 * halo_bytes + SMALL]
    if bulky:
        return (f"{where}: one {bulky[0].name} call moved {bulky[0].bytes} bytes, but the stencil needs only {HALO} "
                f"row from each neighbour ({halo_bytes} bytes each way): exchange the edge rows, not the field")
    if isinstance(out, Exception):
        return f"{where}: the operator raised {type(out).__name__}: {str(out)[:200]}"
    if not isinstance(out, ShardTensor):
        return f"{where}: the patch returned a {type(out).__name__}; return a ShardTensor laid out like the input"
    reused = earlier_object(out, patch)
    if reused:
        return f"{where}: {reused}, not the operator applied to the tensor it was given"
    if tuple(out.placements) != tuple(sharded.placements) or (
            out._spec.sharding_shapes() != sharded._spec.sharding_shapes()):
        return (f"{where}: the result is placed {tuple(out.placements)} with shards "
                f"{[s[2] for s in out._spec.sharding_shapes()[0]]} rows, the input "
                f"{tuple(sharded.placements)} with {[s[2] for s in sharded._spec.sharding_shapes()[0]]}: keep the "
                "input's layout (its placements and sharding shapes)")
    mesh = sharded.device_mesh
    me, n = mesh.get_local_rank(), mesh.size()
    first, stop = _rows(sharded)
    expected = diffuse(whole, alpha)[..., first:stop, :]
    got = out.to_local().detach()
    problem = _diagnose(got, expected, HALO, me, n)
    if problem:
        return f"{where}: {_wrong_source(got, expected, whole, local, alpha, x_whole, first, stop) or problem}"
    ranks = dist.get_process_group_ranks(mesh.get_group())
    if n > 1 and not watch.collectives(ranks=ranks):
        return (f"{where}: the values are right but nothing was exchanged over the input's mesh: where did the halo "
                "rows come from? Take them from the neighbours")
    return None


def _judge_gradient(what, whole, sharded, alpha) -> str | None:
    where = f"on {what} (alpha={alpha})"
    first, stop = _rows(sharded)
    whole_leaf = whole.clone().requires_grad_(True)
    (diffuse(whole_leaf, alpha) * _loss_weights(whole)).sum().backward()
    if sharded.grad is None:
        return (f"{where}: no gradient reached the input: the patch cut the autograd graph (make the halo exchange "
                "differentiable: PhysicsNeMo's halo_padding is, a plain isend/irecv is not)")
    grad = sharded.grad.to_local() if hasattr(sharded.grad, "to_local") else sharded.grad
    worst = (grad - whole_leaf.grad[..., first:stop, :]).abs().max().item()
    if not worst <= 1e-5:
        return (f"{where}: the forward is right but the input's gradient differs from one process's by up to "
                f"{worst:.2e}: the gradient of a halo row belongs to the rank that sent it")
    return None
