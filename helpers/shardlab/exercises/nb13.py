"""Judges of ``notebooks/13_physicsnemo_models.ipynb``: a PhysicsNeMo model run on a point cloud sharded along its
points, and a parity check that must tell a right domain-parallel run from wrong ones.

Both answers are functions, judged on every rank with models and clouds of the judge's own, drawn for each check
(point counts that split unevenly, other feature counts, other seeds); what is right is computed outside the judged
call. A forward pre-hook on the judge's models sees what each model was really given: a model run on the whole
cloud, or never run, is caught whatever the answer returns.
"""

from __future__ import annotations

import torch

from ..models import transolver
from ..points import PointCloud, mse, predict
from .judging import Watch, case_generator, earlier_object, second_hint


def _cloud(rng, n: int, features: int, device) -> PointCloud:
    """A float64 cloud of a point count that torch.chunk splits unevenly over ``n`` ranks, values drawn from rng."""
    points = rng.choice([p for p in range(8 * n, 24 * n) if p % n and -(-p // n) * (n - 1) < p])
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    values = [torch.rand(1, points, width, generator=generator, dtype=torch.float64) for width in (features, 2, 1)]
    return PointCloud(*values).to(device)


def _model(features: int, seed: int, device):
    """A small float64 Transolver of the judge's own, taking ``features`` values per point."""
    return transolver(features=features, width=16, layers=1, heads=2, slices=4, seed=seed).to(device, torch.float64)


def _inputs_seen(model) -> list[str]:
    """Records, for every call of ``model``, what it was given: "sharded" (ShardTensors) or "whole"."""
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(
        "sharded" if all(hasattr(a, "to_local") for a in args) else "whole"))
    return seen


@second_hint(
    "Use the model and cloud you are given. src = dist.get_global_rank(domain.get_group(), 0); scatter "
    "cloud.features and cloud.coords with scatter_tensor(t, src, domain, (Shard(1),)), and return model(features,"
    " coords) on the scattered pieces: a model run on the whole cloud, cut afterwards, is not domain parallel."
)
def runs_sharded(run_sharded, cloud, domain) -> str | None:
    """Exercise 1. Doing it means: scatter the cloud's features and coordinates along the points (dim 1) over
    ``domain`` from its first rank, and call the model on the two ShardTensors; its output stays sharded.

    ``run_sharded(model, cloud, domain)`` is called with models and clouds of the judge's own (another feature count,
    a point count that splits unevenly) on the notebook's domain axis, and on the notebook's own cloud. Observed: what
    the model was given, the output's type, placement, mesh, local size and values against the model on the whole
    cloud; ``PointCloud.shard`` (the answer key) may not run."""
    if not callable(run_sharded):
        return f"run_sharded is a {type(run_sharded).__name__}: define a function run_sharded(model, cloud, domain)"
    from physicsnemo.domain_parallel import ShardTensor
    from torch.distributed.tensor import Shard

    rng, n, device = case_generator(), domain.size(), cloud.features.device
    features = rng.randint(2, 4)
    mine = _cloud(rng, n, features, device)
    cases = [(f"a cloud of {mine.points} points with {features} features", mine, features),
             ("the notebook's cloud", cloud, cloud.features.shape[-1])]
    cases = [(what, _model(width, rng.randrange(1000), device), whole) for what, whole, width in cases]
    runs = []
    for what, model, whole in cases:  # every call on every rank, then verdicts
        with torch.no_grad():
            truth = model(whole.features, whole.coords)
        seen = _inputs_seen(model)
        with Watch(shard=PointCloud.shard) as watch, torch.no_grad():
            runs.append((what, whole, truth, seen, run_sharded(model, whole, domain), watch))
    for what, whole, truth, seen, out, watch in runs:
        problem = watch.forbidden(shard="the helper this exercise rebuilds: scatter the features and coordinates")
        if problem:
            return f"on {what}, {problem}"
        if not seen:
            return f"on {what}, the model was never called: run it on the sharded cloud"
        if "whole" in seen:
            return (f"on {what}, the model ran on the whole cloud on every rank: shard the inputs first, so each "
                    "rank runs it on its own points")
        if not isinstance(out, ShardTensor):
            return f"on {what}, the answer is a {type(out).__name__}: return the model's output, a ShardTensor"
        if earlier_object(out, run_sharded):
            return f"on {what}, {earlier_object(out, run_sharded)}"
        if tuple(out.placements) != (Shard(1),) or out.device_mesh.mesh.tolist() != domain.mesh.tolist():
            return (f"on {what}, the output is placed {tuple(out.placements)} on ranks {out.device_mesh.mesh.tolist()}"
                    f": the points are dim 1, split over the domain ranks {domain.mesh.tolist()}")
        here, expected = out.to_local().shape[1], torch.empty(whole.points, device="meta").chunk(n)
        if here != expected[domain.get_local_rank()].shape[0]:
            return f"on {what}, this rank holds {here} points, not torch.chunk's share: scatter with scatter_tensor"
        if not torch.allclose(out.full_tensor(), truth, rtol=1e-9, atol=1e-12):
            return f"on {what}, the output differs from the model on the whole cloud: shard both inputs the same way"
    return None


def _moving(probe, cloud) -> list[str]:
    """The parameters the loss on ``cloud`` really moves with (a gradient above 1e-6 in ``probe``, a twin of the judged
    models): spoiling one it ignores, such as Transolver's slice temperature here, would spoil nothing."""
    mse(predict(probe, cloud), cloud.target).backward()
    return [name for name, p in probe.named_parameters() if p.grad is not None and p.grad.abs().max() > 1e-6]


def _wrong_forward(model, rng, moving) -> str:
    """One weight of ``model`` moved by a thousandth: the two models no longer hold the same weights."""
    name = rng.choice([n for n, p in model.named_parameters() if p.dim() == 2 and n in moving])
    with torch.no_grad():
        model.get_parameter(name).mul_(1.001)
    return f"one weight ({name}) differs"


def _wrong_gradient(model, rng, moving) -> str:
    """Every gradient of one parameter scaled by 1.001 on its way: the forward is right, that gradient is not."""
    name = rng.choice(moving)
    model.get_parameter(name).register_hook(lambda grad: grad * 1.001)
    return f"the gradient of {name} is 0.1 % off (the outputs are equal)"


@second_hint(
    "Run both: the model on cloud.shard(domain) and one_process on the whole cloud (sl.points.predict), each "
    "followed by sl.points.mse(...).backward(). Compare out.full_tensor() with the whole output and every p.grad "
    "with its q.grad (torch.allclose, tight tolerances: float64); any difference gives False."
)
def checks_parity(parity_holds, cloud, domain) -> str | None:
    """Exercise 2. Doing it means: run the model on the cloud sharded over ``domain`` and the one-process model on
    the whole cloud, forward and backward (``sl.points.mse``), and compare the gathered output and every parameter's
    gradient, tightly enough for float64, on every rank.

    ``parity_holds(model, one_process, cloud, domain)`` is called with three pairs of the judge's own on a cloud of
    its own: the same weights (it must say True), one weight that differs (False), and one gradient that goes wrong
    on its way while the outputs agree (False), in an order drawn for each check. Observed: the answer, and that each
    model ran, the sharded one on ShardTensors and the other on the whole cloud."""
    if not callable(parity_holds):
        return (f"parity_holds is a {type(parity_holds).__name__}: define a function parity_holds(model, one_process, "
                "cloud, domain) that returns True or False")
    rng, n, device = case_generator(), domain.size(), cloud.features.device
    features = rng.randint(1, 3)
    mine = _cloud(rng, n, features, device)
    kinds = [("the same weights", None, True), ("", _wrong_forward, False), ("", _wrong_gradient, False)]
    rng.shuffle(kinds)
    runs = []
    for what, spoil, right in kinds:  # every call on every rank, then verdicts
        seed = rng.randrange(1000)
        model, one_process, probe = (_model(features, seed, device) for _ in range(3))
        what = spoil(model, rng, _moving(probe, mine)) if spoil else what
        seen = (_inputs_seen(model), _inputs_seen(one_process))
        runs.append((what, right, seen, parity_holds(model, one_process, mine, domain)))
    for what, right, (sharded, whole), answer in runs:
        if not isinstance(answer, bool):
            return f"with {what}, parity_holds returned a {type(answer).__name__}: return True or False"
        if "sharded" not in sharded or "whole" in sharded or set(whole) != {"whole"}:
            return (f"with {what}, the model ran {sharded or 'never'} and the one-process model {whole or 'never'}: "
                    "run the model once on the sharded cloud and the one-process model once on the whole cloud")
        if answer != right:
            advice = (": a right run must pass: a tolerance above float64's rounding" if right
                      else ": compare every parameter's gradient too, not only the outputs" if "gradient" in what
                      else ": compare the gathered output with the one-process output, tightly (float64)")
            return f"with {what}, parity_holds said {answer}{advice}"
    return None
