"""Judges of ``notebooks/11_memory_levers.ipynb``: a layout ``(ddp, domain, wrapper, levers)`` that fits a budget per
rank with the fewest domain ranks.

The answer is a function, judged in the notebook's kernel (``sl.exercises.judged``) on models, fields, world sizes and
budgets the notebook never showed: budgets a byte under and exactly at what the best layout of some domain size needs,
and one that nothing fits. The judge finds the truth itself, by planning every layout the exercise allows, outside
the learner's call. While the call runs, it is watched: the planner's own searches may not run, and the layout
returned must be one the call planned. Then the layout chosen at this cluster's world size, for a model of the
judge's own, trains one step on the ranks (``sl.plan.measure_rank``), measured against its plan and
the budget.
"""

from __future__ import annotations

import functools

import torch

from .. import plan as plan_package
from ..levers import Levers
from ..plan import Planner, conv_model, fmt_bytes
from ..plan.validate import compare
from .judging import Watch, earlier_object, second_hint

WRAPPERS = ("ddp", "fsdp2")  # "none" averages gradients by hand (notebook 05): not a layout to train with
LOW = torch.bfloat16
MEASURED_MODEL = {"width": 24, "layers": 3, "kernel_size": 3}  # trained on the ranks: small, and not the notebook's
MEASURED_FIELD = (1, 1, 52, 40)
MEASURE_TIMEOUT_S = 300
# The judge's problems: (width, depth, kernel size, field), world size (None: this cluster's), and the budget: a byte
# under, or exactly at, the least that the layouts allowed need with the i-th smallest domain size (-1: the largest).
PROBLEMS = (((32, 5, 3, (1, 1, 512, 512)), 8, ("a byte under", 0)),
            ((48, 3, 5, (1, 1, 384, 256)), 6, ("exactly at", 2)),  # domain 3: the interior rank holds the most
            ((16, 3, 3, (1, 1, 1024, 1024)), 2, ("a byte under", -1)),  # nothing fits
            ((*MEASURED_MODEL.values(), MEASURED_FIELD), None, ("a byte under", 0)))


def lever_choices(wrapper: str) -> list[Levers]:
    """Every combination of levers the exercise allows with ``wrapper``."""
    precisions = (None, LOW) if wrapper == "fsdp2" else (None,)
    return [Levers(checkpoint=c, autocast=a, param_dtype=p) for c in (False, True) for a in (None, LOW)
            for p in precisions]


@functools.lru_cache(maxsize=8)
def _planner(width: int, depth: int, kernel_size: int, field: tuple) -> Planner:
    """One planner per model and field: its traces are reused for every layout."""
    return Planner(conv_model(2, width=width, depth=depth, kernel_size=kernel_size), field)


def _need(planner: Planner, world: int, domain: int, wrapper: str, levers: Levers) -> int:
    """The largest rank's total for one layout."""
    return planner.largest(world // domain, domain, wrapper, levers=levers).total


@functools.lru_cache(maxsize=64)
def _least(planner: Planner, world: int, domain: int) -> int:
    """The least largest-rank total over the layouts the exercise allows with ``domain`` ranks on the domain axis."""
    return min(_need(planner, world, domain, wrapper, levers) for wrapper in WRAPPERS
               for levers in lever_choices(wrapper))


def _cases(world_here: int) -> list[dict]:
    """Each of ``PROBLEMS`` with its budget and the fewest domain ranks that fit it (None: nothing does)."""
    cases = []
    for shape, world, (how, index) in PROBLEMS:
        planner, world = _planner(*shape), world or world_here
        sizes = [n for n in range(1, world + 1) if world % n == 0 and planner.valid_domain(n)]
        if len(sizes) == 1:  # one rank: its only layout size, exactly
            how, index = "exactly at", 0
        budget = _least(planner, world, sizes[index]) - (how == "a byte under")
        fewest = next((n for n in sizes if _least(planner, world, n) <= budget), None)
        cases.append({"planner": planner, "world": world, "budget": budget, "fewest": fewest,
                      "what": f"world {world}, a {'x'.join(map(str, shape[3][2:]))} field, a budget of {budget:,} "
                              "bytes per rank"})
    return cases


def _planned(event) -> tuple:
    """(ddp, domain, wrapper, levers) of one watched call of the planner."""
    args = event.arguments
    return args.get("ddp"), args.get("domain"), args.get("wrapper"), args.get("levers")


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
    need = _need(case["planner"], world, domain, wrapper, levers)
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
    from ..mesh import build_mesh
    from ..models import conv_stack
    from ..plan.validate import measure_rank
    from ..ranks.launch import default_device

    generator = torch.Generator().manual_seed(11)
    shape = (2 * ddp, *MEASURED_FIELD[1:])
    samples = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    model = conv_stack(**MEASURED_MODEL, seed=11).to(default_device())
    return measure_rank(model, build_mesh(ddp=ddp, domain=domain), wrapper, samples=samples, levers=levers)


def _measured_problem(cluster, case: dict, layout: tuple) -> str | None:
    """One training step of ``layout`` on the ranks: measured against its plan, and within the budget."""
    ddp, domain, wrapper, levers = layout
    measured = cluster.wait(cluster.view.apply_async(measure_layout, ddp, domain, wrapper, levers),
                            MEASURE_TIMEOUT_S, f"train and measure one step of {_text(layout)}")
    predicted = case["planner"].plan(ddp, domain, wrapper, levers=levers)
    off = [row for row in compare(predicted, list(measured)) if abs(row["error"]) > 0.05]
    if off:  # the planner's error, not the learner's: said as such
        raise RuntimeError(f"the planner and the ranks disagree on {_text(layout)}: {off}")
    over = [m.rank for m in measured if m.accounted > case["budget"]]
    if over:
        return f"for {case['what']}, trained on the ranks, rank(s) {over} held more than the budget"
    worst = max(measured, key=lambda m: m.accounted)
    print(f"  trained on {cluster.n} ranks: {_text(layout)}; largest rank {fmt_bytes(worst.accounted)} counted as "
          f"planned; {fmt_bytes(predicted.largest().total)} on a GPU, temporaries included; budget "
          f"{fmt_bytes(case['budget'])}")
    return None


def _defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s method resolution order that defines ``name``: where a watch replaces it."""
    return next(c for c in cls.__mro__ if name in vars(c))


@second_hint(
    "One planner = sl.plan.Planner(model, field). For each domain size that divides world and "
    "planner.valid_domain allows, smallest first, for each wrapper and each Levers(...) to try, compare "
    "planner.largest(world // domain, domain, wrapper, levers=levers).total (the largest rank's total) with the "
    "budget; return the first (ddp, domain, wrapper, levers) that fits, None after the loops."
)
def layout_fits_budget(choose_layout, cluster) -> str | None:
    """The exercise. Doing it means: for each domain size from the smallest, each wrapper and each allowed set of
    levers, plan the layout and compare its largest rank's total (temporaries included) with the budget; return the
    first that fits, or None.

    ``choose_layout(model, field, world, budget)`` is called on the judge's models and fields (``PROBLEMS``), at world
    sizes of its own and at this cluster's, with budgets a byte under the best layout of the smallest domain size,
    exactly at the best of the second, and under everything. Truth: every allowed layout planned by the judge,
    outside the call. The planner's searches (``Planner.smallest_domain``, ``Planner.fits``, ``sl.plan.verdict``) may
    not run in the call, and each layout returned must have been planned in it. The layout chosen at this cluster's
    world size then trains for one step on the ranks, its bytes measured against the plan and the budget."""
    if not callable(choose_layout):
        return (f"choose_layout is a {type(choose_layout).__name__}: define a function choose_layout(model, field, "
                "world, budget)")
    cases = _cases(cluster.n)
    watched = {name: (_defined_in(Planner, name), name) for name in ("smallest_domain", "fits", "plan", "largest")}
    watched["verdict"] = (plan_package, "verdict")
    with Watch(attributes=watched, collectives=False) as watch:  # no profile hook: planning stays fast
        answers = []
        for case in cases:
            start = len(watch.events)
            got = choose_layout(case["planner"].model, case["planner"].field_shape, case["world"], case["budget"])
            answers.append((got, [_planned(e) for e in watch.events[start:] if e.name in ("plan", "largest")]))
    searches = ("which {} for you (one wrapper and one set of levers at a time, with a GPU's headroom): plan each "
                "layout yourself and compare its largest rank's total with the budget")
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
    here, (got, _) = cases[-1], answers[-1]
    return _measured_problem(cluster, here, got) if got is not None else None
