"""Judges of ``notebooks/06_compile_caveats.ipynb``: graphs counted on each rank, and one graph for every shard height.

Each judge builds this rank's own inputs: the local shards of fields whose heights do not split evenly over the domain
group, so the ranks of a group see different local shapes. What is right is measured here, on the rank, by compiling
the judge's own functions with a counting backend; nothing is a typed constant. The functions are drawn for each
check (their math, and how and where the graph breaks), and they differ in how many graphs each shape costs, so only
an answer that compiles and counts graphs passes, and only one that runs the function on each shard as given gets
its values.
"""

from __future__ import annotations

import functools

import torch

from ..mesh import shard_bounds
from ..ranks.launch import default_device
from .judging import Watch, case_generator, earlier_object, second_hint

# Tiny steps the judge's functions are drawn from (what the message says, the step); all trace into one graph.
MATH = {"sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh, "gelu": torch.nn.functional.gelu,
        "times 2": lambda t: t * 2, "plus 1": lambda t: t + 1}


def _graph_break():
    torch._dynamo.graph_break()


def _explicit_break(t):
    _graph_break()
    return t


@torch.compiler.disable
def _eager_step(t):
    return t


def _printed(t):
    print(end="")  # Dynamo does not trace print: the graph breaks here
    return t


# Three ways a graph breaks between two graphs, each behind a call (what the message says, the step).
BREAKS = {"torch._dynamo.graph_break() in a function it calls": _explicit_break,
          "a call to a torch.compiler.disable'd function": _eager_step,
          "a print()": _printed}


def drawn_function(rng, breaks: str):
    """(a description, a function) with two steps of ``MATH`` drawn from ``rng`` and, between them, a graph break
    drawn from ``BREAKS`` that is taken on every shape (``breaks="always"``), on odd shard heights only ("odd") or
    never ("never"): two graphs per shape, two or one, or one."""
    first, second = rng.sample(sorted(MATH), 2)
    how = rng.choice(sorted(BREAKS))
    taken = {"always": lambda rows: True, "odd": lambda rows: rows % 2 == 1, "never": lambda rows: False}[breaks]
    before, step, after = MATH[first], BREAKS[how], MATH[second]

    def fn(t):
        t = before(t)
        if taken(t.shape[2]):
            t = step(t)
        return after(t)

    if breaks == "never":
        return f"a function with no graph break ({first}, then {second})", fn
    where = " on odd shard heights only" if breaks == "odd" else ""
    return f"a function with a graph break ({how}) between {first} and {second}{where}", fn


def pointwise(t):
    """Pointwise work that Dynamo captures in one graph."""
    return torch.nn.functional.gelu(t * 2) + 1


def _marked(fn):
    """``fn`` when compiled; 1000 more when it runs eagerly, so an eager fallback shows in the values."""

    def marked(t):
        return fn(t) + (0.0 if torch.compiler.is_compiling() else 1000.0)

    return marked


# Functions of every row of the shard (what the message says, the function): extra rows change every value.
ROW_MIXING = {"subtracts the mean over the rows": lambda t: t - t.mean(dim=2, keepdim=True),
              "takes a softmax over the rows": lambda t: torch.softmax(t, dim=2)}


def local_shards(mesh, heights, width: int = 8) -> list:
    """This rank's local shard (1, 1, rows, width) of a field of each height, split over ``mesh["domain"]``."""
    domain = mesh["domain"]
    rank_in_group = domain.get_local_rank()
    device = default_device()
    generator = torch.Generator().manual_seed(6)
    shards = []
    for height in heights:
        _, start, stop = shard_bounds(height, domain.size())[rank_in_group]
        shards.append(torch.randn(1, 1, stop - start, width, generator=generator).to(device))
    return shards


def graphs_compiled(fn, inputs, dynamic) -> int:
    """Graphs Dynamo hands to a backend when ``fn``, compiled with ``dynamic``, is called on each input."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counting_backend, dynamic=dynamic)
    with torch.no_grad():
        for t in inputs:
            compiled(t)
    torch._dynamo.reset()
    return len(graphs)


def _draw_heights(rng, mesh, odd_and_even: bool = False) -> list[int]:
    """Four field heights, one of them twice (a repeat costs no new graph), some not splitting evenly over the domain
    group, whose shards give this rank three different heights (so dynamic=None, which turns dynamic at the second,
    compiles fewer graphs), both odd and even ones when ``odd_and_even``. Each rank draws until its own shards
    qualify: nothing here is collective."""
    domain = mesh["domain"]
    while True:
        heights = rng.sample(range(30, 90), 3)
        heights.append(rng.choice(heights))
        rng.shuffle(heights)
        rows = {stop - start for height in heights
                for _, start, stop in [shard_bounds(height, domain.size())[domain.get_local_rank()]]}
        uneven = domain.size() == 1 or any(height % domain.size() for height in heights)
        if uneven and len(rows) == 3 and (not odd_and_even or len({r % 2 for r in rows}) == 2):
            return heights


@functools.lru_cache(maxsize=32)
def _graphs_for_rows(fn, rows: tuple, dynamic) -> int:
    """``graphs_compiled`` for shards of these heights: the same on every call, so each rank compiles it once."""
    return graphs_compiled(fn, [torch.zeros(1, 1, r, 8, device=default_device()) for r in rows], dynamic)


@second_hint(
    "The backend is called once per graph Dynamo compiles (a graph break makes two), not once per call: def "
    "backend(gm, example_inputs): graphs.append(gm); return gm.forward. Compile with dynamic=False (the default "
    "turns a changed shape dynamic and compiles fewer), call the compiled function on every input, return "
    "len(graphs)."
)
def counts_graphs(count_graphs, mesh):
    """Exercise 1. Doing it means: compile ``fn`` with ``dynamic=False`` and a backend of one's own that counts the
    graphs it is handed, call the compiled function on every input, and return that count.

    ``count_graphs(fn, inputs)`` is called for three functions drawn for each check (``drawn_function``: one graph
    break, a break on odd heights only, none; the math, and the way the graph breaks, behind a call, drawn too), each
    on this rank's uneven shards of fields whose heights are drawn for each check (one height repeated). Truth: the
    judge's own counting backend. ``torch._dynamo.explain`` (a count made by PyTorch) may not run."""
    if not callable(count_graphs):
        return f"count_graphs is a {type(count_graphs).__name__}: define a function count_graphs(fn, inputs)"
    rng = case_generator()
    cases = [(*drawn_function(rng, breaks), local_shards(mesh, _draw_heights(rng, mesh, breaks == "odd")))
             for breaks in ("always", "odd", "never")]
    rng.shuffle(cases)
    answers = []
    for _, fn, inputs in cases:
        torch._dynamo.reset()
        with Watch(attributes={"explain": (torch._dynamo, "explain")}, collectives=False) as watch:
            answers.append(count_graphs(fn, inputs))
        problem = watch.forbidden(explain="which counts for you: count the graphs your own backend is handed")
        if problem:
            return problem
    torch._dynamo.reset()
    for (what, fn, inputs), got in zip(cases, answers):
        rows = tuple(t.shape[2] for t in inputs)
        where = f"for {what}, on {len(inputs)} shards of {list(rows)} rows,"
        if not isinstance(got, int) or isinstance(got, bool):
            return f"{where} count_graphs returned {got!r}: return the number of graphs, an int"
        right = _graphs_for_rows(fn, rows, False)
        if got == right:
            continue
        where += f" it returned {got}, expected {right}"
        if got in (len(inputs), len(set(rows))):
            counted = {len(inputs): "calls", len(set(rows)): "distinct shapes"}[got]
            return (f"{where}: that is the number of {counted}; count graphs (a backend is called once per graph, and "
                    "a graph break makes more, wherever in the calls it happens)")
        if len(set(answers)) == 1:
            return f"it returned {got} for every function and every set of inputs: count what the compiler does"
        if got == _graphs_for_rows(fn, rows, None):
            return (f"{where}: that is what the default dynamic=None compiles (after the first new shape Dynamo makes "
                    "the dimension dynamic); compile with dynamic=False")
        return f"{where}: count the graphs Dynamo hands the backend for these shards on this rank"
    return None


@second_hint(
    'Compile once, outside: compiled = torch.compile(fn, backend="eager", dynamic=False); return a function that '
    "calls torch._dynamo.mark_dynamic(t, 2) on its input, then compiled(t). dynamic=True makes the width dynamic "
    "too, and padding the shards to one height changes what a mean or softmax over H sees."
)
def compiles_once(compile_once, mesh):
    """Exercise 2. Doing it means: return ``torch.compile(fn, ...)`` (or a function that calls it) with the sharded
    dimension, and only that one, marked dynamic (``torch._dynamo.mark_dynamic(t, 2)``), so that every shard height
    runs one compiled graph.

    ``compile_once(fn)`` is called on two functions whose eager runs add 1000 (``torch.compiler.is_compiling()`` is
    False there): a pointwise one, and one of every row of the shard drawn from ``ROW_MIXING`` (a shard padded or cut
    to another height gives it other values). Each compiled function is fed this rank's shards of several heights,
    then one shard of another width (heights and widths drawn for each check). Observed: one Dynamo graph for all
    heights, fn's own values, compiled, for every call (no eager fallback), and one more graph for the new width (a
    width that stays static keeps the graph specialised)."""
    if not callable(compile_once):
        return f"compile_once is a {type(compile_once).__name__}: define a function compile_once(fn)"
    rng = case_generator()
    heights, width = _draw_heights(rng, mesh), rng.randint(6, 10)
    inputs = local_shards(mesh, heights, width)
    wider = local_shards(mesh, heights[:1], width=width + rng.randint(1, 6))[0]
    mixing = rng.choice(sorted(ROW_MIXING))
    for what, fn in (("", pointwise), (f"a fn that {mixing}", ROW_MIXING[mixing])):
        problem = _compiled_once(compile_once, fn, inputs, wider)
        if problem:
            return f"for {what}: {problem}" if what else problem
    return None


def _compiled_once(compile_once, fn, inputs, wider) -> str | None:
    """What is wrong with ``compile_once(fn marked by _marked)`` on ``inputs`` and then ``wider``, or None."""
    from torch._dynamo.utils import counters

    marked = _marked(fn)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = compile_once(marked)
    reused = earlier_object(compiled, compile_once)
    if reused:
        torch._dynamo.reset()
        return f"{reused}, not a compiled fn"
    if compiled is marked:
        torch._dynamo.reset()
        return "compile_once returned the function itself: nothing is compiled"
    with torch.no_grad():
        outputs = [compiled(t) for t in inputs]
        graphs = counters["stats"]["unique_graphs"] - before
        after_width = compiled(wider)
        graphs_with_width = counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    if graphs == 0:
        return "no graph was compiled for these calls: return a torch.compile(...) of fn, or a function that calls one"
    if graphs > 1:
        rows = sorted({t.shape[2] for t in inputs})
        return (f"{graphs} graphs were compiled on this rank for shards of {len(rows)} different heights: every new "
                "height still recompiles. Tell the compiler that the sharded dimension varies")
    for t, out in zip([*inputs, wider], [*outputs, after_width]):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(t.shape):
            return f"for a shard of {t.shape[2]} rows it returned {type(out).__name__}, not fn's output"
        worst = (out - fn(t)).abs().max().item()
        if abs(worst - 1000.0) < 1.0:
            return (f"for a shard of {t.shape[2]} rows and width {t.shape[3]} the function ran eagerly, not compiled: "
                    "every height must run the one compiled graph")
        if not worst <= 1e-5:
            if fn is pointwise:
                return f"the compiled results differ from fn's by up to {worst:.2e}"
            return (f"for a shard of {t.shape[2]} rows the compiled results differ from fn's by up to {worst:.2e}: "
                    "each value of this fn depends on every row of the shard, so fn must get the shard as it is "
                    "(rows added, as padding, or rows cut off change its values)")
    if graphs_with_width == graphs:
        return ("a shard of another width ran without a new graph: every dimension was made dynamic. Only the sharded "
                "dimension varies between ranks; mark that one, and keep the others specialised")
    return None
