"""A parity harness for any model: the model run domain-parallel on the ranks against one process on the whole input,
the output and every parameter gradient compared in float64, for even and uneven splits.

    case = sl.parity.Case("mine", build=lambda: Mine(), inputs=lambda n: {"x": torch.randn(1, n, 3)}, shard={"x": 1})
    sl.parity.problems(case)            # before any rank starts: one line per bad input, saying what to change
    sl.parity.run(["mypackage.cases:case"], ranks=4, timeout_s=300)   # a job of ranks, one result per case
    sl.parity.check(case)               # on every rank together (what the job runs)

A case says how to build the model, its whole inputs at a size, which inputs are split along which dim on ``domain``,
and the strategy (``ddp`` or ``fsdp_spatial``). What each field means and how the table's columns are measured:
docs/harness.md#parity.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

STRATEGIES = ("ddp", "fsdp_spatial")
TOLERANCE = 1e-10  # relative, float64: what a float64 model meets (rounding of sums split differently)
# A gradient below this share of the model's largest counts as zero (see parity_at). A zero one is the rounding of
# a cancelling sum, about 1e-16 of the largest and CPU-dependent (vector width): 1e-4 leaves it 1e-12, far from
# TOLERANCE on any CPU, and a wrong gradient above 1e-14 of the largest still fails.
ZERO_GRADIENT = 1e-4
# Where user code registers a handler for an op ShardTensor has none for (physicsnemo 2.2.2, installed).
HANDLERS = {"function": "ShardTensor.register_function_handler(op, handler) (domain_parallel/shard_tensor.py:907)",
            "dispatch": "ShardTensor.register_dispatch_handler(op, handler) (domain_parallel/shard_tensor.py:891)"}


@dataclass(frozen=True)
class Case:
    """One model, declared: see the module's docstring. ``sizes(domain)``: the sizes parity runs at (a size the domain
    size does not divide splits unevenly); ``settings``: what differs from the model's defaults, and why."""

    name: str
    build: Callable
    inputs: Callable[[int], dict]
    shard: Mapping[str, int]
    sizes: Callable[[int], tuple[int, ...]] = lambda domain: (128 * domain, 128 * domain + 1)
    strategy: str = "ddp"
    spatial: Mapping[str, int] = field(default_factory=dict)
    settings: str = "defaults"
    one_dict: bool = False  # forward takes the inputs as one dict (DoMINO), not as keyword arguments
    loss: Callable | None = None
    seed: int = 0
    memory_scale: int = 2  # memory is measured at sizes(domain)[0] and this many times it
    all_handlers: bool = False  # on CPU ranks, every ShardTensor handler (point-cloud ops too), as GPUs register

    def model(self, size: int):
        """The model, built under ``seed`` (``build(size)`` where ``build`` takes the size: a positional table's
        shape follows the field), in ``eval()`` as PhysicsNeMo's harness runs it: dropout off."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            built = self.build(size) if inspect.signature(self.build).parameters else self.build()
        return built.eval()

    def whole_inputs(self, size: int, dtype=None) -> dict:
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + 1)
            made = self.inputs(size)
        return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in made.items()}


def _taken(model) -> tuple[list[str], bool]:
    parameters = inspect.signature(model.forward).parameters.values()
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


def problems(case: Case, domain: int = 2) -> list[str]:
    """What is wrong with the case before any rank starts, one line each with what to change: a strategy that does not
    exist, inputs the model does not take, a split input that is not among the inputs, a split dim that does not
    follow the size (batch or channels), a spatial name the model has no parameter or buffer for."""
    lines = []
    if case.strategy not in STRATEGIES:
        lines.append(f"{case.name}: strategy {case.strategy!r}: use one of {', '.join(STRATEGIES)}.")
    small = case.sizes(domain)[0]
    model = case.model(small)
    inputs, bigger = case.whole_inputs(small), case.whole_inputs(small * case.memory_scale)
    names, any_keyword = _taken(model)
    foreign = [k for k in inputs if k not in names] if not (case.one_dict or any_keyword) else []
    if foreign:
        lines.append(f"{case.name}: {type(model).__name__}.forward takes ({', '.join(names)}), not "
                     f"{', '.join(map(repr, foreign))}: rename it in Case.inputs to the argument it is, or drop it.")
    for name, dim in case.shard.items():
        if name not in inputs:
            lines.append(f"{case.name}: shard names {name!r}, which Case.inputs does not give (it gives "
                         f"{', '.join(inputs)}): name one of those.")
            continue
        shape, grown = tuple(inputs[name].shape), tuple(bigger[name].shape)
        follows = [d for d in range(len(shape)) if shape[d] != grown[d]]
        if not -len(shape) <= dim < len(shape):
            lines.append(f"{case.name}: {name!r} has {len(shape)} dims, no dim {dim}: split dim {follows or '?'}.")
        elif shape[dim % len(shape)] == grown[dim % len(shape)]:
            lines.append(f"{case.name}: dim {dim} of {name!r} is {shape[dim]} long at size {small} and at "
                         f"{small * case.memory_scale}: it does not follow the field (a batch or channel dim), so "
                         f"splitting it is not domain parallelism: split dim {' or '.join(map(str, follows))}, "
                         "the one that grows with the size.")
    held = {n.rsplit(".", 1)[-1] for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    for name in case.spatial:
        if name not in held:
            lines.append(f"{case.name}: spatial names {name!r}, which {type(model).__name__} has no parameter or "
                         f"buffer of: name one of those whose shape follows the field.")
    return lines


def spatial_parameters(case: Case, domain: int = 2) -> dict[str, int]:
    """{qualified name: dim} of every parameter and buffer whose shape follows the field: built at two sizes, the dim
    whose length changed (a positional table; the case's ``build`` takes the size). Left replicated, each rank holds
    the whole table; ``fsdp_spatial`` with ``spatial={name: dim}`` splits it on ``domain``. A table of fixed length that
    the model indexes by position (a RoPE table built for the longest field) is not found by its shape."""
    small = case.sizes(domain)[0]
    shapes = [{name: tuple(t.shape) for name, t in [*model.named_parameters(), *model.named_buffers()]}
              for model in (case.model(small), case.model(small * case.memory_scale))]
    return {name: next(d for d, (a, b) in enumerate(zip(shape, shapes[1][name])) if a != b)
            for name, shape in shapes[0].items() if name in shapes[1] and shape != shapes[1][name]}


def unpatched_lines(audit) -> list[str]:
    """One line per op the audit saw DTensor's fallback move sharded data for: the op, and how a handler is
    registered from user code."""
    lines = []
    for row in audit.rows:
        for op in row["unpatched"]:
            how = HANDLERS["dispatch" if op.startswith("aten.") else "function"]
            lines.append(f"{row['module']}: {op} has no ShardTensor handler (DTensor's fallback moved the sharded "
                         f"data: {', '.join(row.get('unpatched moves', {}).get(op, []))}); register one from your "
                         f"code with {how}, or keep that dim whole around it.")
    return lines


def _outputs(out) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(case: Case, out):
    from .measure.audit import mean_square

    if case.loss is not None:
        return case.loss(out)
    return sum(mean_square(t) for t in _outputs(out))


def _call(case: Case, model, inputs: dict):
    return model(inputs) if case.one_dict else model(**inputs)


def _distributed(case: Case, model, mesh):
    """The model laid out by ``case.strategy`` on ``mesh`` (ddp × domain); returns (what to call, the inner model)."""
    import torch
    from physicsnemo.domain_parallel import sync_module_over_mesh
    from torch.distributed.fsdp import fully_shard

    from .train import shard_spatial

    if case.strategy == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["ddp"].get_group(),
                                                        find_unused_parameters=True)
        return ddp, model
    sync_module_over_mesh(model, mesh["domain"], verify=True)  # FSDP2 broadcasts nothing: start the replicas equal
    shard_spatial(model, case.spatial, mesh["domain"])
    fully_shard(model, mesh=mesh["ddp"])
    return model, model


def _scattered(case: Case, inputs: dict, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from .mesh import scatter

    domain = mesh["domain"]
    source = dist.get_global_rank(domain.get_group(), 0)
    return {k: scatter(v, source, domain, (Shard(case.shard[k]) if k in case.shard else Replicate(),))
            for k, v in inputs.items()}


def _prepared(case: Case, size: int, mesh, dtype):
    from physicsnemo.distributed import DistributedManager

    device = DistributedManager().device
    whole = {k: v.to(device) for k, v in case.whole_inputs(size, dtype).items()}
    model, inner = _distributed(case, case.model(size).to(device, dtype), mesh)
    return whole, model, inner


def parity_at(case: Case, size: int, mesh, dtype) -> dict:
    """On every rank together: ``case``'s model laid out by its strategy on ``mesh`` against one process on the whole
    input at ``size``, one forward and backward (what ``check`` and the port's job run): the largest relative error of
    the output and of any parameter's gradient (the worst named), and whether the split was even."""
    import torch

    from .measure.memory import relative_error

    whole, model, inner = _prepared(case, size, mesh, dtype)
    domain = mesh["domain"].size()
    split = {k: list(torch.tensor_split(torch.arange(whole[k].shape[d]), domain)) for k, d in case.shard.items()}
    even = all(len({len(part) for part in parts}) == 1 for parts in split.values())
    reference = case.model(size).to(whole[next(iter(whole))].device, dtype)
    want = _call(case, reference, whole)
    _loss(case, want).backward()
    got = _call(case, model, _scattered(case, whole, mesh))
    _loss(case, got).backward()
    output = max(relative_error(g, w) for g, w in zip(_outputs(got), _outputs(want), strict=True))
    pairs = [(name, p, q) for (name, p), (_, q) in zip(inner.named_parameters(), reference.named_parameters(),
                                                       strict=True) if q.grad is not None]
    # A gradient zero in exact arithmetic (a softmax key's bias shifts every logit alike) is rounding on both sides:
    # every tensor is measured against at least ZERO_GRADIENT of the model's largest gradient.
    floor = ZERO_GRADIENT * max((q.grad.abs().max().item() for _, _, q in pairs), default=0.0)
    grads = {name: float("inf") if p.grad is None else relative_error(p.grad, q.grad, floor) for name, p, q in pairs}
    worst = max(grads, key=grads.get) if grads else None
    return {"size": size, "split": "even" if even else "uneven", "output": output,
            "gradient": grads.get(worst, 0.0), "worst parameter": worst, "parameters": len(grads),
            "zero gradients": [name for name, _, q in pairs if q.grad.abs().max().item() < floor]}


def audit_at(case: Case, size: int, mesh, dtype) -> dict:
    """On every rank together: ``sl.measure.audit`` of ``case``'s distributed model at ``size`` (what ``check`` and the
    port's job run): its findings, the ops without a handler (each with how to register one), the bytes handed to
    collectives per phase, and each spatial table's bytes on this rank."""
    from .measure.audit import audit_model

    whole, model, inner = _prepared(case, size, mesh, dtype)
    inputs = _scattered(case, whole, mesh)
    tables = spatial_parameters(case, mesh["domain"].size())  # a spatial table's bytes on this rank, as laid out
    held = {name: (t.to_local() if hasattr(t, "to_local") else t).nbytes
            for name, t in [*inner.named_parameters(), *inner.named_buffers()] if name in tables}
    found = audit_model(model, inputs, loss=lambda out: _loss(case, out)) if case.one_dict else \
        audit_model(_keywords(model, list(inputs)), *inputs.values(), loss=lambda out: _loss(case, out))
    sent = {phase: sum(b for _, b in ops.values()) for phase, ops in found.totals().items()}
    return {"size": size, "findings": found.findings(), "unpatched": unpatched_lines(found), "bytes": sent,
            "error": found.error, "held": held}


def _keywords(model, names):
    """The model called with keyword arguments from positional ones: the audit passes inputs positionally."""
    import torch

    class Keywords(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return self.model(**dict(zip(names, args, strict=True)))

    return Keywords()


def _peak_at(case: Case, size: int, mesh, dtype) -> int | None:
    from physicsnemo.distributed import DistributedManager

    from .measure.memory import AllocatorPeak

    whole, model, inner = _prepared(case, size, mesh, dtype)
    inputs = _scattered(case, whole, mesh)
    del whole
    held = [t.to_local() if hasattr(t, "to_local") else t for t in [*inner.parameters(), *inputs.values()]]
    with AllocatorPeak(DistributedManager().device, held=held) as peak:
        with peak.window():
            _loss(case, _call(case, model, inputs)).backward()
    return peak.peak


def attempt(label: str, step, *args) -> dict:
    """``step(*args)`` as a dict, or where it raised (the innermost PhysicsNeMo frame: file and line), which each rank
    also prints: when ranks raise at different places, one may already wait in a collective another never enters."""
    import torch.distributed as dist

    from .measure.audit import _raised_where

    try:
        result = step(*args)
        return result if isinstance(result, dict) else {"value": result}
    except Exception as error:  # the model's own failure is the row's finding
        where = _raised_where(error)
        print(f"{RANK_SAYS}{dist.get_rank()}, {label}: {where[:300]}", file=sys.stderr, flush=True)
        return {"error": where}


RANK_SAYS = "shardlab.parity: rank "  # how a rank's own failure starts on stderr (tools.models reads it back)


def check(case: Case, domain: int | None = None, dtype: str = "float64", progress=None) -> dict:
    """On every rank together: parity at each of ``case.sizes(domain)``, the audit and the memory peak at two sizes.
    ``domain``: the domain axis's size (default: every rank); the rest is ``ddp``. ``progress(row, step)``: called
    before each step with the row so far (what a job that ends mid-way hands back)."""
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager

    from .mesh import build_mesh
    from .workarounds import register_shard_ops_on_cpu

    progress = progress or (lambda row, step: None)
    world = dist.get_world_size()
    domain = domain or world
    row = {"case": case.name, "ranks": world, "domain": domain, "strategy": case.strategy, "settings": case.settings,
           "dtype": dtype, "device": DistributedManager().device.type, "problems": problems(case, domain)}
    built = case.model(case.sizes(domain)[0])
    held = dict([*built.named_parameters(), *built.named_buffers()])
    row["spatial"] = {name: {"dim": dim, "split": name.rsplit(".", 1)[-1] in case.spatial, "values": held[name].numel(),
                             "length": held[name].shape[dim]} for name, dim in spatial_parameters(case, domain).items()}
    if row["problems"]:
        return row
    if case.all_handlers and not torch.cuda.is_available():
        register_shard_ops_on_cpu(everything=True)
    mesh = build_mesh(ddp=world // domain, domain=domain)
    kind = getattr(torch, dtype)
    sizes = case.sizes(domain)
    row["parity"] = []
    for size in sizes:
        progress(row, f"parity at {size}")
        row["parity"].append(attempt(f"parity at {size}", parity_at, case, size, mesh, kind) | {"size": size})
    progress(row, f"the audit at {sizes[0]}")
    row["audit"] = attempt(f"the audit at {sizes[0]}", audit_at, case, sizes[0], mesh, kind)
    row["memory"] = {}
    for size in (sizes[0], sizes[0] * case.memory_scale):
        progress(row, f"the peak at {size}")
        mine = attempt(f"the peak at {size}", _peak_at, case, size, mesh, kind)
        every = [None] * world
        dist.all_gather_object(every, mine.get("value"))
        row["memory"][size] = max(every) if None not in every else "not measured: the step raised"
    return row


def load(ref: str) -> Case:
    """``"package.module:name"``: the Case named ``name`` in that module."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def run(refs: list[str], ranks: int, timeout_s: float = 300, domain: int | None = None) -> list[dict]:
    """Each case of ``refs`` (``load``'s form) checked on ``ranks`` ranks (on GPUs where each rank has one, as
    ``run_job`` places them), in one job; one dict per case."""
    from .ranks.launch import run_job

    args = [*refs, *(["--domain", str(domain)] if domain else [])]
    return run_job("torchrun", ranks, "shardlab.parity", args, timeout_s=timeout_s).result


def _main(argv: list[str]) -> None:
    import torch.distributed as dist

    from shardlab import parity  # the module itself, not this __main__ copy: one Case class
    from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result

    domain = int(argv[argv.index("--domain") + 1]) if "--domain" in argv else None
    refs = [a for i, a in enumerate(argv) if a != "--domain" and (i == 0 or argv[i - 1] != "--domain")]
    init_distributed(90)
    rows = []

    def progress(row, step):  # rank 0 hands back what is done so far: a process that ends mid-way still reports
        if dist.get_rank() == 0:
            write_job_result([*rows, row | {"stopped in": step}])

    for ref in refs:
        rows.append(parity.check(parity.load(ref), domain, progress=progress))
    if dist.get_rank() == 0:
        write_job_result(rows)
    shutdown_distributed()


if __name__ == "__main__":
    _main(sys.argv[1:])
