"""Judges of ``notebooks/11_memory_levers.ipynb``: a layout ``(ddp, domain, wrapper, levers)`` that fits a budget per
rank with the fewest domain ranks.

The answer is a function, judged in the notebook's kernel (``sl.check.judged``) on models, fields, world sizes and
budgets the notebook never showed: budgets just at and just under what the best layout of some domain size needs, and
one that nothing fits. The judge finds the truth itself, by planning every layout the exercise allows, outside the
learner's call. While the call runs, it is watched: the planner's own searches may not run, and the layout returned
must be one the call planned. Then one layout, chosen for a model and budget of the judge's own at this cluster's
world size, trains one step on the ranks (``sl.plan.measure_rank``), measured against its plan.
"""

from __future__ import annotations

import functools

import torch

from ..check import Watch, earlier_object
from ..plan import Planner, compare, conv_model, fmt_bytes, plan, verdict
from ..train import Levers

WRAPPERS = ("ddp", "fsdp2")  # "none" averages gradients by hand (notebook 05): not a layout to train with
LOW = torch.bfloat16
MEASURED_MODEL = {"width": 24, "layers": 3, "kernel_size": 3}  # trained on the ranks: small, and not the notebook's
MEASURED_FIELD = (1, 1, 52, 40)
MEASURE_TIMEOUT_S = 300


def lever_choices(wrapper: str) -> list[Levers]:
    """Every combination of levers the exercise allows with ``wrapper``."""
    precisions = (None, LOW) if wrapper == "fsdp2" else (None,)
    return [Levers(checkpoint=c, autocast=a, param_dtype=p) for c in (False, True) for a in (None, LOW)
            for p in precisions]


def _need(model, field, world: int, domain: int, wrapper: str, levers: Levers) -> int | None:
    """The largest rank's total for one layout, or None when the field cannot be split that way."""
    try:
        return plan(model, field, ddp=world // domain, domain=domain, wrapper=wrapper, levers=levers).largest().total
    except ValueError:
        return None


@functools.lru_cache(maxsize=8)
def _least_per_domain(key: tuple, world: int) -> dict[int, tuple[int, tuple]]:
    """{domain size: (the least largest-rank total over the layouts allowed, that layout)} for every domain size of
    ``world`` the field allows; the model and field come from ``_MODELS[key]``."""
    model, field = _MODELS[key]
    least = {}
    for domain in (n for n in range(1, world + 1) if world % n == 0):
        needs = [(need, (world // domain, domain, wrapper, levers)) for wrapper in WRAPPERS
                 for levers in lever_choices(wrapper)
                 if (need := _need(model, field, world, domain, wrapper, levers)) is not None]
        if needs:
            least[domain] = min(needs, key=lambda pair: pair[0])
    return least


_MODELS: dict[tuple, tuple] = {}


def _model(width: int, depth: int, kernel_size: int, field: tuple) -> tuple:
    key = (width, depth, kernel_size, field)
    if key not in _MODELS:
        _MODELS[key] = (conv_model(2, width=width, depth=depth, kernel_size=kernel_size), field)
    return key


def _cases(world_here: int) -> list[dict]:
    """The judge's problems: (model, field, world, budget) and the fewest domain ranks that fit (None: nothing)."""
    cases = []
    here = _model(*MEASURED_MODEL.values(), MEASURED_FIELD)
    for key, world, how in ((_model(32, 5, 3, (1, 1, 512, 512)), 8, "just under"),
                            (_model(48, 3, 5, (1, 1, 384, 256)), 6, "just at"),
                            (_model(16, 3, 3, (1, 1, 1024, 1024)), 4, "nothing"),
                            (here, world_here, "just under")):
        least = _least_per_domain(key, world)
        sizes = sorted(least)
        if how == "nothing":
            budget = least[sizes[-1]][0] - 1
        elif how == "just at":  # exactly what the best layout of the second domain size needs
            budget = least[sizes[1]][0] if len(sizes) > 1 else least[sizes[0]][0]
        else:  # a byte less than the best layout of the smallest domain size needs
            budget = least[sizes[0]][0] - 1 if len(sizes) > 1 else least[sizes[0]][0]
        fewest = next((n for n in sizes if least[n][0] <= budget), None)
        model, field = _MODELS[key]
        cases.append({"model": model, "field": field, "world": world, "budget": budget, "fewest": fewest,
                      "what": f"world {world}, a {'x'.join(map(str, field[2:]))} field, a budget of "
                              f"{budget:,} bytes per rank", "measured": key == here and world == world_here})
    return cases


def _planned(event) -> tuple:
    """(ddp, domain, wrapper, levers) of one watched call of the planner."""
    args = event.arguments
    levers = args.get("levers", getattr(args.get("self"), "levers", None))
    return args.get("ddp"), args.get("domain"), args.get("wrapper"), levers


def _text(layout: tuple) -> str:
    ddp, domain, wrapper, levers = layout
    return f"(ddp={ddp}, domain={domain}, {wrapper!r}, levers: {levers})"


def _layout_problem(case: dict, got, planned: list[tuple]) -> str | None:
    """What is wrong with the layout returned for one case, or None."""
    what, world, budget, fewest = case["what"], case["world"], case["budget"], case["fewest"]
    if got is None:
        if fewest is None:
            return None
        return f"for {what} it returned None, but a layout fits: try both wrappers and the levers at each domain size"
    if not (isinstance(got, tuple) and len(got) == 4):
        return f"for {what} it returned {got!r}: return a tuple (ddp, domain, wrapper, levers), or None"
    ddp, domain, wrapper, levers = got
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (ddp, domain)):
        return f"for {what} it returned ddp={ddp!r}, domain={domain!r}: give both as positive whole numbers"
    if ddp * domain != world:
        return f"for {what} it returned ddp={ddp} × domain={domain} = {ddp * domain} ranks, not the world's {world}"
    if wrapper not in WRAPPERS:
        return f"for {what} it returned the wrapper {wrapper!r}: train replicas with 'ddp' or 'fsdp2'"
    if not isinstance(levers, Levers):
        return f"for {what} it returned levers={levers!r}: give an sl.train.Levers"
    if (ddp, domain, wrapper, levers) not in planned:
        return (f"for {what} it returned {_text(got)}, a layout it never planned: the layout must come from plans of "
                "the model, field, world and budget it is given, not be typed in")
    need = _need(case["model"], case["field"], world, domain, wrapper, levers)
    if fewest is None:
        return f"for {what} nothing fits, but it returned {_text(got)}, whose largest rank needs {need:,} bytes"
    if need > budget:
        return (f"for {what} it returned {_text(got)}, which does not fit: its largest rank needs {need:,} bytes, "
                "temporaries included; compare the budget with the largest rank's total")
    if domain > fewest:
        return (f"for {what} it returned {_text(got)}, which fits, but {fewest} domain ranks are enough with some "
                "wrapper and levers: keep as many ranks on ddp as the budget allows")
    return None


def measure_layout(ddp: int, domain: int, wrapper: str, levers: Levers):
    """On every rank together: one measured training step of the judge's model with this layout, on random samples
    of ``MEASURED_FIELD`` (the same on every rank); this rank's ``RankBytes``."""
    from ..launch import default_device
    from ..mesh import build_mesh
    from ..models import conv_stack
    from ..plan import measure_rank

    generator = torch.Generator().manual_seed(11)
    shape = (2 * ddp, *MEASURED_FIELD[1:])
    samples = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    model = conv_stack(width=MEASURED_MODEL["width"], layers=MEASURED_MODEL["layers"],
                       kernel_size=MEASURED_MODEL["kernel_size"], seed=11).to(default_device())
    return measure_rank(model, build_mesh(ddp=ddp, domain=domain), wrapper, samples=samples, levers=levers)


def _measured_problem(cluster, case: dict, layout: tuple) -> str | None:
    """One training step of ``layout`` on the ranks: measured against its plan, and within the budget."""
    ddp, domain, wrapper, levers = layout
    result = cluster.wait(cluster.view.apply_async(measure_layout, ddp, domain, wrapper, levers), MEASURE_TIMEOUT_S,
                          f"train and measure one step of {layout}")
    predicted = plan(case["model"], case["field"], ddp=ddp, domain=domain, wrapper=wrapper, levers=levers)
    rows = compare(predicted, list(result))
    off = [row for row in rows if abs(row["error"]) > 0.05]
    if off:  # the planner's error, not the learner's: say so plainly
        raise RuntimeError(f"the planner and the ranks disagree on {layout}: {off}")
    over = [m.rank for m in result if m.accounted > case["budget"]]
    if over:
        return f"for {case['what']}, trained on the ranks, rank(s) {over} held more than the budget"
    worst = max(result, key=lambda m: m.accounted)
    print(f"  measured on {cluster.n} ranks: {layout}, largest rank {fmt_bytes(worst.accounted)} counted, "
          f"{fmt_bytes(predicted.largest().total)} planned with temporaries, budget {fmt_bytes(case['budget'])}"
          + (f", CUDA peak {fmt_bytes(worst.peak)} (the allocator's blocks and workspaces: compare, not judged)"
             if worst.peak is not None else ""))
    return None


def layout_fits_budget(choose_layout, cluster) -> str | None:
    """The exercise. Doing it means: for each domain size from the smallest, each wrapper and each allowed set of
    levers, plan the layout and compare its largest rank's total (temporaries included) with the budget; return the
    first that fits, or None.

    ``choose_layout(model, field, world, budget)`` is called on the judge's models and fields, at world sizes of its
    own and at this cluster's, with budgets a byte under the best layout of the smallest domain size, exactly at the
    best of the second, and under everything. Truth: every allowed layout planned by the judge, outside the call.
    The planner's searches (``Planner.smallest_domain``, ``Planner.fits``, ``sl.plan.verdict``) may not run in the
    call, and each layout returned must have been planned in it. The case at this cluster's world size is then
    trained for one step on the ranks, its bytes measured against the plan and the budget."""
    if not callable(choose_layout):
        return (f"choose_layout is a {type(choose_layout).__name__}: define a function choose_layout(model, field, "
                "world, budget)")
    cases = _cases(cluster.n)
    with Watch(collectives=False, smallest_domain=Planner.smallest_domain, fits=Planner.fits, verdict=verdict,
               planned=(Planner.plan, Planner.largest)) as watch:
        answers = []
        for case in cases:
            start = len(watch.events)
            answers.append((choose_layout(case["model"], case["field"], case["world"], case["budget"]),
                            [_planned(e) for e in watch.events[start:] if e.name == "planned"]))
    searches = "which {} for you, with a GPU's headroom and without levers: plan each layout yourself and compare " \
               "its largest rank's total with the budget"
    problem = watch.forbidden(smallest_domain=searches.format("searches the domain sizes"),
                              fits=searches.format("decides"), verdict=searches.format("decides"))
    if problem:
        return problem
    for case, (got, _) in zip(cases, answers):
        if (earlier := earlier_object(got, choose_layout)) is not None:
            return (f"for {case['what']} {earlier}: the layout must come from the model, field, world and budget "
                    "it is given")
    for case, (got, planned) in zip(cases, answers):
        if problem := _layout_problem(case, got, planned):
            return problem
    case, (got, _) = next((c, a) for c, a in zip(cases, answers) if c["measured"])
    return _measured_problem(cluster, case, got) if got is not None else None
