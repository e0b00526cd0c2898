"""Judges of ``notebooks/08_troubleshooting.ipynb``: the weight drift over a domain group, measured by hand.

The answer is a function, called on models the judge builds (one whose ranks all started differently, one whose
domain groups agree); the judge knows every rank's seed, so it works out each rank's drift without communicating.
The call is watched: the broadcasts it runs and over which ranks, and the library function it rebuilds.
"""

from __future__ import annotations

import torch.distributed as dist

from ..measure.memory import max_diff_to_source
from ..models import conv_stack
from ..ranks.launch import default_device
from .judging import Watch, second_hint

SHAPE = {"width": 4, "layers": 2}  # another model than the notebook's


def _weights_of(seed: int, device):
    return [p.detach() for p in conv_stack(seed=seed, **SHAPE).to(device).parameters()]


@second_hint(
    "The source is dist.get_global_rank(mesh[\"domain\"].get_group(), 0), not rank 0 or the ddp group's first rank."
    " Broadcast a clone of each parameter from it over that group, keep the largest |p − theirs|, then all-reduce"
    " a tensor of it with op=dist.ReduceOp.MAX over the same group, so that the whole group returns one number."
)
def drift_by_hand(domain_drift, mesh) -> str | None:
    """Exercise. Doing it means: broadcast every parameter from the first rank of this rank's domain group, over
    that group, take the largest absolute difference to this rank's own values, and all-reduce its maximum over
    the group, so that every rank of the group gets the same answer (0.0 when the group agrees).

    ``domain_drift(model, mesh)`` is called with a model seeded by the global rank (every rank differs) and with
    one seeded by the domain group (its ranks agree, the groups differ). Observed: broadcasts over the domain
    group, not ``sl.measure.max_diff_to_source`` or a sync, and the value, against the judge's own arithmetic (it
    knows every rank's seed)."""
    from physicsnemo.domain_parallel import sync_module_over_mesh

    if not callable(domain_drift):
        return f"domain_drift is a {type(domain_drift).__name__}: define a function domain_drift(model, mesh)"
    device, rank = default_device(), dist.get_rank()
    group = mesh["domain"].get_group()
    ranks, source = dist.get_process_group_ranks(group), dist.get_global_rank(group, 0)
    cases = (("a model every rank initialised with its own seed", lambda r: 200 + r),
             ("a model the ranks of each domain group initialised alike", lambda r: 300 + source))
    runs = []
    for what, seed_of in cases:  # every call on every rank, then verdicts
        model = conv_stack(seed=seed_of(rank), **SHAPE).to(device)
        with Watch(max_diff_to_source=max_diff_to_source, sync=sync_module_over_mesh) as watch:
            got = domain_drift(model, mesh)
        theirs = _weights_of(seed_of(source), device)
        drift = {r: max((mine - there).abs().max().item()
                        for mine, there in zip(_weights_of(seed_of(r), device), theirs)) for r in ranks}
        runs.append((what, got, max(drift.values()), drift[rank], watch))
    for what, got, truth, own, watch in runs:
        problem = watch.forbidden(max_diff_to_source="the library function this exercise rebuilds",
                                  sync="which changes the weights it should measure")
        if problem:
            return problem
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"on {what}, domain_drift returned {got!r}: return the largest difference as a Python float"
        if len(ranks) > 1 and not watch.collectives("broadcast", ranks=ranks):
            other = sorted({tuple(e.ranks) for e in watch.collectives("broadcast")})
            if other:
                return (f"on {what}, the broadcasts ran over ranks {[list(r) for r in other]}, not over this rank's "
                        f"domain group {ranks}: the ranks that share a sample are the ones whose weights must agree")
            return f"on {what}, nothing was broadcast over the domain group: compare with the values the source sends"
        if abs(got - truth) <= 1e-6 * max(1.0, truth):
            continue
        if abs(got - own) <= 1e-6 * max(1.0, own):
            return (f"on {what}, it returned this rank's own largest difference; every rank of the group must return "
                    "the same, the group's largest: all-reduce the maximum over the domain group")
        if len({round(g, 9) for _, g, *_ in runs if isinstance(g, (int, float))}) == 1:
            return (f"domain_drift returned {got!r} for every model, in sync or not: measure the model it is given "
                    "against its domain group's first rank")
        return (f"on {what}, it returned {got:.6g}, which is not the largest difference to the group's first rank "
                "over the domain group (every rank of the group returns the same)")
    return None
