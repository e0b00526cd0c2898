"""Judge of ``notebooks/15_port_your_model.ipynb``: a ShardTensor handler for ``torch.nn.functional.batch_norm``,
written and registered from user code, which makes a model with batch norm domain-parallel without a gather.

The answer is a handler, ``batch_norm_on_shards(func, types, args, kwargs)``. The judge registers it
(``ShardTensor.register_function_handler``) for the length of the check only, on a model and a field of its own,
drawn for each check: 2-D convolutions around a ``BatchNorm2d`` (the lesson's model is 3-D) with another channel
count, momentum and split, a row count the ranks split unevenly. It requires what the port requires: the audit comes
back clean (no op without a handler, no silent gather) and parity holds against one process, in training (the output,
every gradient, the running statistics) and in evaluation (the output from those statistics). It watches the work:
every collective the handler runs is recorded, and a gather of the field (``full_tensor``, a redistribution to
``Replicate``) fails whatever the numbers say; the package's own handler, the answer key, may not run.
"""

from __future__ import annotations

import torch

from ..measure.memory import relative_error
from .judging import Watch, case_generator, second_hint

TOLERANCE = 1e-10  # relative, float64: what sums split differently round to (sl.parity.TOLERANCE)


def _model(channels: int, momentum: float, affine: bool, seed: int, device):
    """The judge's own model: a halo convolution, batch norm, a ReLU and another convolution, float64, seeded. No bias
    before the norm (its gradient is zero in exact arithmetic: nothing to compare)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, channels, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(channels, momentum=momentum, affine=affine),
            torch.nn.ReLU(),
            torch.nn.Conv2d(channels, 1, 3, padding=1))
        if affine:  # not the defaults (1 and 0): a handler that drops them must show it
            torch.nn.init.uniform_(model[1].weight, 0.5, 1.5)
            torch.nn.init.uniform_(model[1].bias, -0.5, 0.5)
    return model.to(device, torch.float64)


def _registered(handler):
    """Register ``handler`` for F.batch_norm and hand back a function that puts the previous entry back (PhysicsNeMo
    2.2.2 keeps the handlers in one class dict, ``ShardTensor._function_registry``, shard_tensor.py:799, and has no
    call that removes one)."""
    from physicsnemo.domain_parallel import ShardTensor

    registry, op = ShardTensor._function_registry, torch.nn.functional.batch_norm
    before = registry.get(op)
    ShardTensor.register_function_handler(op, handler)

    def restore():
        if before is None:
            registry.pop(op, None)
        else:
            registry[op] = before

    return restore


@second_hint(
    "Bind the arguments (inspect.signature(torch.nn.functional.batch_norm).bind(*args, **kwargs), then "
    "apply_defaults()). In training, over dims (0, 2, 3, ...): mean = x.sum(dims, keepdim=True) / count and "
    "var = ((x - mean) ** 2).sum(dims, keepdim=True) / count, with count = x.numel() // x.shape[1] (the ShardTensor's "
    "shape is the whole field's, and its sum all-reduces); update the running buffers through .to_local() under "
    "no_grad (the variance unbiased: × count / (count - 1)); then (x - mean) / sqrt(var + eps) * weight + bias, the "
    "parameters reshaped to (1, C, 1, ...). In evaluation, use the running buffers. Never x.full_tensor()."
)
def shards_batch_norm(batch_norm_on_shards, domain, package=None) -> str | None:
    """Doing it means: a handler that computes batch norm's statistics over the whole field from sums each rank takes
    over its own rows (ShardTensor's sum all-reduces one number per channel), updates the running statistics as torch
    does, and normalises each rank's rows where they are; in evaluation, normalises with the running statistics.

    ``batch_norm_on_shards(func, types, args, kwargs)`` is registered for F.batch_norm on a model and field of the
    judge's own, split over ``domain`` unevenly; ``package`` is the notebook's module, whose handler (the answer key)
    may not run. Observed: the audit's findings; every collective the model ran in training and what it moved;
    the output, every gradient and the running statistics against one process in training; the output in
    evaluation."""
    if not callable(batch_norm_on_shards):
        return (f"batch_norm_on_shards is a {type(batch_norm_on_shards).__name__}: define a function "
                "batch_norm_on_shards(func, types, args, kwargs) that returns the normalised ShardTensor")
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from physicsnemo.domain_parallel import ShardTensor, scatter_tensor
    from torch.distributed.tensor import Shard

    from ..measure.audit import audit_model, mean_square

    rng, n, device = case_generator(), domain.size(), DistributedManager().device
    channels, momentum, affine = rng.randint(2, 5), rng.choice([0.1, 0.3, 0.5]), rng.random() < 0.75
    rows = rng.choice([r for r in range(3 * n, 6 * n) if r % n and -(-r // n) * (n - 1) < r] or [3 * n])
    seed = rng.randrange(1000)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    field = torch.randn(1, 1, rows, rng.randint(5, 9), generator=generator, dtype=torch.float64).to(device)
    source = dist.get_global_rank(domain.get_group(), 0)
    what = f"a {channels}-channel BatchNorm2d (momentum {momentum}, affine {affine}) on {rows} rows over {n} ranks"

    key = getattr(package, "batch_norm_on_shards", None)
    restore = _registered(batch_norm_on_shards)
    try:
        audited = audit_model(_model(channels, momentum, affine, seed, device),
                              scatter_tensor(field, source, domain, (Shard(2),)))
        model, whole = _model(channels, momentum, affine, seed, device), _model(channels, momentum, affine, seed,
                                                                                  device)
        x = scatter_tensor(field, source, domain, (Shard(2),))
        with Watch(**({"key": key} if callable(key) else {})) as watch:
            out = model(x)
            mean_square(out).backward()
        want = whole(field)
        mean_square(want).backward()
        model.eval()
        whole.eval()
        with torch.no_grad():
            evaluated, evaluated_want = model(x), whole(field)
    finally:
        restore()

    if callable(key) and watch.calls("key"):
        return (f"on {what}, it called the package's batch_norm_on_shards, the answer key: write the handler's "
                "statistics yourself")
    gathers = [e for e in watch.collectives() if e.name != "all_reduce"]
    if any(e.name == "all_gather" for e in gathers):
        return (f"on {what}, it gathered the field ({', '.join(sorted({e.name for e in gathers}))}): full_tensor or a "
                "redistribution to Replicate puts the whole field on every rank, which the handler exists to avoid: "
                "take sums over each rank's rows instead")
    if not audited.clean:
        return f"on {what}, the audit is not clean: {audited.findings()[0]}"
    if not isinstance(out, ShardTensor) or tuple(out.placements) != (Shard(2),):
        return (f"on {what}, the model's output is a {type(out).__name__} "
                f"{tuple(getattr(out, 'placements', ()))}: return a ShardTensor split as the input is, Shard(2)")
    errors = {"the output": relative_error(out, want)}
    for (name, p), q in zip(model.named_parameters(), whole.parameters(), strict=True):
        errors[f"the gradient of {name}"] = float("inf") if p.grad is None else relative_error(p.grad, q.grad)
    norm, norm_want = model[1], whole[1]
    errors["the running mean"] = relative_error(norm.running_mean, norm_want.running_mean)
    errors["the running variance"] = relative_error(norm.running_var, norm_want.running_var)
    errors["the output in evaluation"] = relative_error(evaluated, evaluated_want)
    # The first to differ, in the order each depends on the one before (the evaluation output follows from the
    # running statistics): the learner is told the cause, not its largest consequence.
    worst = next((name for name, error in errors.items() if error > TOLERANCE), None)
    if worst is not None:
        said = {"the running mean": ": update the running statistics as torch does (momentum, once per step)",
                "the running variance": ": the running variance is the unbiased one, × count / (count - 1)",
                "the output in evaluation": ": in evaluation (training False) use the running statistics"}
        advice = said.get(worst, ": the statistics are the whole field's, over every rank's rows, not this rank's")
        return f"on {what}, {worst} differs from one process by {errors[worst]:.1e} (relative){advice}"
    return None
