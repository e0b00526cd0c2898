"""Judges of ``notebooks/06_compile_caveats.ipynb``: graphs counted on each rank, and one graph for every shard height.

Each judge builds this rank's own inputs: the local shards of a few fields whose heights do not split
evenly over the domain group, so the ranks of a group see different local shapes. What is right is
measured here, on the rank, by compiling the judge's own functions; nothing is a typed constant.
"""

from __future__ import annotations

import torch

from ..launch import default_device
from ..mesh import shard_bounds

# Field heights whose shards differ in rows between the ranks of a domain group of 2 (64 → 32|32, 63 → 32|31, ...).
HEIGHTS = (64, 63, 62, 61)


def with_a_graph_break(t):
    """Pointwise work with a graph break in the middle: Dynamo compiles two graphs for each input shape."""
    t = torch.nn.functional.gelu(t * 2)
    torch._dynamo.graph_break()
    return t + 1


def pointwise(t):
    """Pointwise work that Dynamo captures in one graph."""
    return torch.nn.functional.gelu(t * 2) + 1


def local_shards(mesh, heights=HEIGHTS) -> list:
    """This rank's local shard (1, 1, rows, 8) of a field of each height, split over ``mesh["domain"]``."""
    domain = mesh["domain"]
    rank_in_group = domain.get_local_rank()
    device = default_device()
    generator = torch.Generator().manual_seed(6)
    shards = []
    for height in heights:
        _, start, stop = shard_bounds(height, domain.size())[rank_in_group]
        shards.append(torch.randn(1, 1, stop - start, 8, generator=generator).to(device))
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


def counts_graphs(count_graphs, mesh):
    """Exercise 1: ``count_graphs(fn, inputs)`` returns how many graphs ``torch.compile(fn, dynamic=False)``
    compiles over the inputs. Judged on this rank's uneven shards, with a function that graph-breaks once."""
    if not callable(count_graphs):
        return f"count_graphs is a {type(count_graphs).__name__}: define a function count_graphs(fn, inputs)"
    inputs = local_shards(mesh)
    torch._dynamo.reset()
    got = count_graphs(with_a_graph_break, inputs)
    if not isinstance(got, int) or isinstance(got, bool):
        return f"count_graphs returned {got!r}: return the number of graphs, an int"
    right = graphs_compiled(with_a_graph_break, inputs, dynamic=False)
    if got == right:
        return None
    if got == len(inputs):
        return (f"it returned {got} for {len(inputs)} calls: that counts calls. Count the graphs: a backend is "
                "called once per graph it compiles")
    if got == graphs_compiled(with_a_graph_break, inputs, dynamic=None):
        return (f"it returned {got}, what the default dynamic=None compiles (after the first new shape Dynamo makes "
                "the dimension dynamic): compile with dynamic=False")
    return (f"it returned {got}, but Dynamo compiles a different number of graphs for these {len(inputs)} local "
            "shards on this rank (this function has a graph break: count graphs, not shapes)")


def compiles_once(compile_once, mesh):
    """Exercise 2: ``compile_once(fn)`` returns a compiled callable that compiles one graph for every shard
    height on this rank, and gives the eager values."""
    from torch._dynamo.utils import counters

    if not callable(compile_once):
        return f"compile_once is a {type(compile_once).__name__}: define a function compile_once(fn)"
    inputs = local_shards(mesh)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    compiled = compile_once(pointwise)
    if compiled is pointwise:
        return "compile_once returned the function itself: nothing is compiled"
    with torch.no_grad():
        outputs = [compiled(t) for t in inputs]
        graphs = counters["stats"]["unique_graphs"] - before
        worst = max((o - pointwise(t)).abs().max().item() for o, t in zip(outputs, inputs))
    torch._dynamo.reset()
    if graphs == 0:
        return "no graph was compiled for these calls: return a torch.compile(...) of fn, or a function that calls one"
    if graphs > 1:
        rows = sorted({t.shape[2] for t in inputs})
        return (f"{graphs} graphs were compiled on this rank for shards of {len(rows)} different heights: every new "
                "height still recompiles. Tell the compiler that the sharded dimension varies")
    if not worst <= 1e-6:
        return f"the compiled results differ from the eager function by up to {worst:.2e}"
    return None
