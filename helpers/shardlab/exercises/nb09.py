"""Judges of ``notebooks/09_memory_planner.ipynb``: the bytes of one rank's shards of parameters, gradients and
optimizer state on its device, predicted by hand, and the decision whether a layout fits a GPU.

Both answers are functions, judged in the notebook's kernel (``sl.exercises.judged``) on models, layouts and capacities
the notebook never showed. The first judge measures its own truth: it builds each rank's local shards on the meta
device and lets a real Adam step create its state. The second asks ``sl.plan.verdict``, outside the learner's call.
Each call is watched: the library functions that would do the exercise for the learner may not run.
"""

from __future__ import annotations

import torch

from ..plan import DTYPES, Planner, conv_model, plan, verdict
from .judging import Watch, second_hint

# (width, depth, kernel, dtype, ddp, replica, wrapper): other models and layouts than the notebook's worked problem.
STATE_CASES = (
    (64, 6, 3, "float32", 2, 1, "fsdp2"),  # the worked problem's model, the other replica
    (16, 3, 3, "float32", 3, 2, "fsdp2"),  # 16 rows over 3 replicas: 6, 6, 4; the 1-channel output conv: 1, 0, 0
    (32, 4, 5, "bfloat16", 4, 3, "fsdp2"),
    (24, 2, 3, "float32", 5, 4, "fsdp2"),  # more replicas than the output conv has rows
    (16, 3, 3, "float64", 2, 0, "ddp"),
    (8, 5, 3, "float32", 1, 0, "none"),
)


def _state_truth(model, ddp: int, replica: int, wrapper: str) -> tuple[int, int]:
    """(bytes of this replica's shards of the parameters and gradients and of Adam's state on their device, bytes of
    Adam's state elsewhere), measured on the meta device: each parameter's local shard (``fully_shard`` cuts dim 0
    with torch.chunk, empty shards included), and a real Adam step. With ``capturable`` and ``fused`` off, Adam puts
    each step count on the CPU (torch/optim/adam.py, ``_init_group``), away from the meta shards."""
    local = []
    for p in model.parameters():
        if wrapper == "fsdp2":
            chunks = list(torch.empty_like(p, device="meta").chunk(ddp, dim=0))
            chunks += [p.new_empty((0, *p.shape[1:]), device="meta")] * (ddp - len(chunks))
            local.append(chunks[replica].clone().requires_grad_())
        else:
            local.append(torch.empty_like(p, device="meta").requires_grad_())
    for t in local:
        t.grad = torch.zeros_like(t)
    optimizer = torch.optim.Adam(local, lr=1e-3)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    on_device = sum(v.nbytes for v in state if v.device.type == "meta")
    return 2 * sum(t.nbytes for t in local) + on_device, sum(v.nbytes for v in state) - on_device


def _padded(model, ddp: int) -> int:
    """Bytes FSDP2 stores for one replica's parameters and gradients: every shard padded to the first's rows
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``padded_sharded_size = chunks[0].size()``)."""
    return 2 * sum(-(-p.shape[0] // ddp) * p[0].nbytes for p in model.parameters())


@second_hint(
    'Per parameter, not the whole state divided by ddp. Under "fsdp2" replica r holds min(ceil(rows / ddp), rows '
    "− r × ceil(rows / ddp)) rows of dim 0, at least 0, without FSDP2's padding; otherwise all rows. Bytes: 4 × "
    "rows × p[0].numel() × p.element_size() (parameter, gradient, Adam's two moments; its step counts are on the "
    "CPU)."
)
def state_by_hand(state_bytes) -> str | None:
    """Exercise 1. Doing it means: for each parameter, the rows of this replica's shard (all of them with DDP or no
    wrapper; with FSDP2, torch.chunk's split of dim 0 over the ddp ranks, possibly none), times the bytes of a row;
    that once for the parameter, once for its gradient, twice for Adam's two moments. Not Adam's step counts: they
    are on the CPU. Not FSDP2's padding: it is storage the shards' rows do not use, in the planner's peak.

    ``state_bytes(model, ddp, replica, wrapper)`` (a model on the meta device, in its dtype) is called for the worked
    problem's model on the other replica and for other models, dtypes, kernels and ddp sizes (more replicas than a
    parameter has rows, too). Truth: the judge's own measurement on the meta device. The planner, an optimizer step,
    ``fully_shard`` and ``sl.measure.state_bytes`` may not run in the call: they would measure, not predict."""
    from torch.distributed.fsdp import fully_shard

    from ..measure.memory import state_bytes as measured_state

    if not callable(state_bytes):
        return (f"state_bytes is a {type(state_bytes).__name__}: define a function state_bytes(model, ddp, replica, "
                "wrapper) that returns a number of bytes")
    cases = []
    for width, depth, kernel, dtype, ddp, replica, wrapper in STATE_CASES:
        model = conv_model(2, width=width, depth=depth, kernel_size=kernel).to(DTYPES[dtype])
        cases.append((f"conv_model(2, width={width}, depth={depth}, kernel_size={kernel}) in {dtype}, replica "
                      f"{replica} of ddp={ddp}, wrapper {wrapper!r}", model, ddp, replica, wrapper))
    with Watch(collectives=False, planner=(Planner.plan, plan), optimizer_step=torch.optim.Adam.step,
               fully_shard=fully_shard, measured=measured_state) as watch:
        answers = [state_bytes(model, ddp, replica, wrapper) for _, model, ddp, replica, wrapper in cases]
    problem = watch.forbidden(planner="which predicts it for you: add up the bytes yourself",
                              optimizer_step="which measures Adam's state instead of predicting it",
                              fully_shard="which shards real parameters: predict the shards' rows instead",
                              measured="which measures instead of predicting")
    if problem:
        return problem
    if len({repr(a) for a in answers}) == 1:
        return f"state_bytes returned {answers[0]!r} for every model and layout: compute it from the arguments"
    wrong = []  # (what, the mistakes the answer fits) per case it got wrong
    for (what, model, ddp, replica, wrapper), got in zip(cases, answers):
        if not isinstance(got, int) or isinstance(got, bool):
            return f"for {what} it returned {got!r}: return a whole number of bytes (an int)"
        right, on_cpu = _state_truth(model, ddp, replica, wrapper)
        if got != right:
            wrong.append((what, _mistakes(model, ddp, replica, wrapper, got, right, on_cpu)))
    if not wrong:
        return None
    what, first = wrong[0]
    # Two mistakes can give the same bytes for one case: name the one that explains every case it got wrong.
    common = [kind for kind in first if all(kind in mistakes for _, mistakes in wrong)]
    return f"for {what} {first[common[0]] if common else 'it returned bytes that are not what that replica holds'}"


def _mistakes(model, ddp: int, replica: int, wrapper: str, got: int, right: int, on_cpu: int) -> dict[str, str]:
    """What a wrong answer for one case is explained by, most specific first: {kind: what to tell the learner}."""
    found = {}
    if got == right + on_cpu:
        found["steps"] = (f"it also counted Adam's step counts ({on_cpu} bytes): with capturable and fused off, "
                          "the defaults, Adam keeps each one as a 0-d tensor on the CPU, not on the replica's device")
    if wrapper != "fsdp2":
        return found
    padded = _padded(model, ddp)  # the moments are the other half of ``right``: Adam's zeros_like of each shard
    if padded != right // 2 and got in (padded + right // 2, 2 * padded):
        found["padding"] = ("it counted FSDP2's padding: every shard is stored padded to the first shard's rows, "
                            "but the padding is storage the shard does not use (the planner counts it in its peak); "
                            "count the rows of this replica's own shard")
    full, _ = _state_truth(model, 1, 0, "ddp")
    if got == full:
        found["whole"] = "it counted every parameter whole; FSDP2 keeps only this replica's rows of each"
    if abs(got - full / ddp) <= 4 * len(list(model.parameters())):
        found["divided"] = ("it is about the whole state divided by ddp, but FSDP2 cuts each parameter's rows with "
                            "torch.chunk: a parameter with fewer rows than replicas leaves some replicas an empty "
                            "shard")
    return found


def _fits_cases() -> list[tuple]:
    """(what, planner, ddp, domain, wrapper, capacity, plan): capacities on both sides of each layout's limit."""
    planner = Planner(conv_model(2, width=16, depth=4), (1, 1, 1024, 1024), name="conv_model(2, width=16, depth=4)")
    cases = []
    for ddp, domain, wrapper in ((1, 1, "ddp"), (1, 4, "ddp"), (2, 2, "fsdp2")):
        result = planner.plan(ddp=ddp, domain=domain, wrapper=wrapper)
        need = result.largest().total
        limit = need + result.headroom(need)
        for capacity in (limit, limit - 1, need + 1, 2 * limit):
            what = (f"{planner.name} on 1024x1024, (ddp={ddp}, domain={domain}), {wrapper}, a GPU of "
                    f"{capacity:,} bytes")
            cases.append((what, planner, ddp, domain, wrapper, capacity, result))
    return cases


@second_hint(
    "result = planner.plan(ddp=ddp, domain=domain, wrapper=wrapper); need = result.largest().total, the largest "
    "rank's total with temporaries, not rank 0's accounted bytes; it fits when need + result.headroom(need) <= "
    "capacity."
)
def fits_by_hand(fits) -> str | None:
    """Exercise 2. Doing it means: plan the layout, take the largest rank's total (temporaries included, the rank
    that decides), add the headroom the plan keeps for what it cannot see (``Plan.headroom``), and compare that
    with the GPU's capacity.

    ``fits(planner, ddp, domain, wrapper, capacity)`` is called for a planner and layouts of the judge's own, with
    capacities just at, just under and well above each layout's limit. Truth: ``sl.plan.verdict``, asked by the judge
    outside the call; the verdict, and ``Planner.fits`` and ``smallest_domain``, may not run in the call."""
    if not callable(fits):
        return (f"fits is a {type(fits).__name__}: define a function fits(planner, ddp, domain, wrapper, capacity) "
                "that returns True or False")
    cases = _fits_cases()
    with Watch(collectives=False, verdict=(verdict, Planner.fits, Planner.smallest_domain)) as watch:
        answers = [fits(*case[1:6]) for case in cases]
    problem = watch.forbidden(verdict="which decides for you: compare the plan's figures with the capacity yourself")
    if problem:
        return problem
    for (what, planner, _, _, _, capacity, result), got in zip(cases, answers):
        if not isinstance(got, bool):
            return f"for {what} fits returned {got!r}; return True or False"
        right = verdict(planner, result, capacity).fits
        if got == right:
            continue
        if got:
            return (f"for {what} it says the layout fits, but the largest rank's total (temporaries included) plus "
                    "the headroom the plan keeps for what it cannot see (Plan.headroom: the CUDA context, NCCL's "
                    "buffers, fragmentation) is more than that")
        if len(set(answers)) == 1:
            return f"fits returned {got} for every layout and capacity: decide from the plan and the capacity"
        return f"for {what} it says {'fits' if got else 'does not fit'}, which is not the plan's verdict"
    return None

