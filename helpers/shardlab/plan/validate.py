"""The planner validated: its categories counted live during one ``Trainer.step`` on real ranks, against the plan.

CPU: exact bytes; GPU: also the allocator's peak. The series' own cases, predicted against measured."""

from __future__ import annotations

import json
import tempfile
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..levers import NO_LEVERS, Levers
from ..mesh import build_mesh, shard_bounds
from ..models import conv_stack
from ..ranks.launch import init_distributed, run_job
from .inputs import DTYPES, fmt_bytes
from .planner import plan
from .records import ACCOUNTED, Plan, RankBytes
from .trace import nbytes
from .workspace import pinned_cudnn

# PhysicsNeMo and the measure layer are imported inside the functions that measure on ranks: planning runs in the
# notebook kernel and on a laptop, where their imports (seconds) buy nothing.


class _CollectiveSizes(TorchDispatchMode):
    """The bytes of the tensors a training step hands to broadcasts before its model's forward begins (the scatter;
    ``forward_began`` is set from outside, by a forward pre-hook) and to all-reduces in its backward (run by autograd's
    engine, as DDP's bucket all-reduces are: inside a graph task)."""

    def __init__(self):
        super().__init__()
        self.forward_began = False
        self.largest_broadcast = self.allreduce_total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d" and tensors:
            if name == "broadcast_" and not self.forward_began:
                self.largest_broadcast = max(self.largest_broadcast, max(nbytes(t) for t in tensors))
            elif name == "allreduce_" and torch._C._current_graph_task_id() != -1:
                self.allreduce_total += sum(nbytes(t) for t in tensors)
        return out


class _GatheredParameters(TorchDispatchMode):
    """FSDP2's all-gathered parameters alive at once, at their most (``most``), checked after every op.

    Three kinds of buffer hold them, each seen without private attributes: every all-gather's flat output (the
    ``c10d`` all-gather's output argument), the per-parameter copies ``split_with_sizes_copy`` makes of it, and the
    unsharded parameters the units hold in place of their sharded DTensors (with one ddp rank FSDP2 copies the shard
    straight into them). FSDP2 resizes a storage to 0 when it reshards, so only live bytes count."""

    def __init__(self, units):
        super().__init__()
        self.units, self.most = units, 0
        self._storages: dict[int, weakref.ref] = {}

    def _hold(self, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            self._storages.setdefault(storage._cdata, weakref.ref(storage))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name.startswith(("_allgather_base", "allgather_into_tensor")):
            self._hold(tree_flatten(args[0])[0])
        elif name == "split_with_sizes_copy":
            self._hold(tree_flatten((kwargs or {}).get("out", []))[0])
        self._hold(p for unit, names in self.units for p in map(unit.get_parameter, names)
                   if not hasattr(p, "to_local"))
        alive = [ref() for ref in self._storages.values()]
        self.most = max(self.most, sum(s.nbytes() for s in alive if s is not None))
        return out


def measure_rank(model, mesh, wrapper: str, samples=None, shard_dim: int = 2, levers: Levers = NO_LEVERS
                 ) -> RankBytes:
    """On every rank together: one training step of ``sl.train.Trainer`` with ``levers`` (after a warm-up step, so
    that gradients and optimizer state exist), its parts counted as the planner predicts them. Returns this rank's
    bytes.

    The measured step is ``Trainer.step`` itself, watched from outside (module hooks, dispatch modes): the scatter
    (largest tensor a broadcast handles before the model's forward begins), the forward (``SavedActivations`` from the
    model's forward pre-hook to its forward hook, also excluding the parameters FSDP2 gathers for each layer), the
    backward (DDP's bucket all-reduces), FSDP2's unsharded units at their most, then ``state_bytes``.
    ``peak`` is the allocator's peak over the measured step, taken apart from all that (``sl.measure.AllocatorPeak``:
    ``max_memory_allocated`` on a GPU, torch.profiler's memory events on a CPU rank, both counted from before the
    model is wrapped, plus the model's parameters and buffers less what the step frees of them, as FSDP2 frees the
    full parameters it shards: what earlier cells or cases left is not counted).
    Everything runs with cuDNN pinned (``pinned_cudnn``): on a GPU each convolution's workspace is inside
    ``max_memory_allocated`` but not in the plan (``records.LEFT_OUT``), and pinned it is the heuristics' engine's
    alone, the same on every run, with no benchmarking workspace on a shape's first call.
    """
    with pinned_cudnn():
        return _measure_rank(model, mesh, wrapper, samples, shard_dim, levers)


def _measure_rank(model, mesh, wrapper, samples, shard_dim, levers) -> RankBytes:
    import torch.distributed as dist

    from ..data import normalized_darcy
    from ..measure.memory import AllocatorPeak, SavedActivations, state_bytes
    from ..train import Trainer, fsdp_units

    samples = normalized_darcy() if samples is None else samples  # host data: loaded before the peak is counted
    # The model's storages: bytes held from the start, whose frees (FSDP2 frees the full parameters it shards) count.
    held = [*model.parameters(), *model.buffers()]
    with AllocatorPeak(next(model.parameters()).device, held=held) as allocator:
        del held
        trainer = Trainer(model, mesh, wrapper, samples=samples, levers=levers)
        trainer.step()
        saved = SavedActivations(exclude=trainer.model.parameters())
        sizes = _CollectiveSizes()
        gathered = _GatheredParameters(fsdp_units(trainer.model) if wrapper == "fsdp2" else [])

        def forward_begins(module, args):
            sizes.forward_began = True
            saved.__enter__()

        def forward_ends(module, args, out):
            saved.__exit__(None, None, None)

        # Before and after the root's other hooks (prepended, appended): all of its forward, the wrapper's included.
        hooks = [trainer.model.register_forward_pre_hook(forward_begins, prepend=True),
                 trainer.model.register_forward_hook(forward_ends, always_call=True)]
        hooks += [m.register_forward_pre_hook(lambda m, a: saved.exclude(m.parameters(recurse=False)))
                  for m in trainer.model.modules()]
        with allocator.window(), sizes, gathered:
            trainer.step()
        for h in hooks:
            h.remove()
    domain = mesh["domain"].size()
    _, start, stop = shard_bounds(samples[0].shape[shard_dim], domain)[mesh.get_coordinate()[1]]
    own = stop - start if domain > 1 else 0
    halos = sum(size * (shape[shard_dim] - own) / shape[shard_dim] for shape, size in saved.counted
                if len(shape) > shard_dim and shape[shard_dim] > own > 0)
    state = state_bytes(trainer.model, trainer.optimizer)
    buffers = {"ddp": sizes.allreduce_total, "fsdp2": gathered.most}.get(wrapper, 0)
    return RankBytes(dist.get_rank(), state["parameters"], state["gradients"], state["optimizer state"], saved.bytes,
                     round(halos), sizes.largest_broadcast if domain > 1 else 0, buffers, peak=allocator.peak,
                     rows=own or None)


def compare(predicted: Plan, measured: list[RankBytes]) -> list[dict]:
    """Per rank, predicted against measured: the byte accounting (exact on CPU ranks) and the step's peak against
    the allocator's (``measure_rank``'s ``peak``: CPU allocator on CPU ranks, ``max_memory_allocated`` on GPUs)."""
    rows = []
    for m in measured:
        p = predicted.rows[m.rank]
        row = {"rank": m.rank, "predicted": p.accounted, "measured": m.accounted,
               "error": (p.accounted - m.accounted) / m.accounted}
        off = [f"{c} {getattr(p, c) - getattr(m, c):+d}" for c in (*ACCOUNTED, "halos")
               if getattr(p, c) != getattr(m, c)]
        row["categories off"] = ", ".join(off) or "-"
        if m.peak is not None:
            row |= {"predicted peak": p.peak, "measured peak": m.peak, "peak error": (p.peak - m.peak) / m.peak}
        rows.append(row)
    return rows


# The series' own models and fields, measured on 4 ranks by ``python -m shardlab.plan --measure``.
SERIES_MODELS = {
    "04": {"width": 16, "layers": 3},  # notebook 04: conv_stack(width=16, layers=3)
    "05": {"seed": 0},  # notebook 05: conv_stack(seed=0)
}


def series_cases(world: int = 4) -> list[dict]:
    """The cases the planner is checked against: notebooks 04 and 05's model, N = 1, 2, 4 on the domain axis
    (ddp = world // N), DDP and FSDP2, on the 64×64 Darcy field; plus an uneven field without a wrapper. (07's U-Net
    pools and interpolates, which the meta trace does not model yet.)"""
    cases = []
    for notebook, kwargs in SERIES_MODELS.items():
        for n in (1, 2, 4):
            if world % n:
                continue
            for wrapper in ("ddp", "fsdp2"):
                cases.append({"name": f"nb{notebook} N={n} {wrapper}", "model": kwargs, "domain": n,
                              "ddp": world // n, "wrapper": wrapper, "field": None})
    if world % 4 == 0:
        cases.append({"name": "uneven 66x64 N=4 none", "model": {"width": 8, "layers": 3}, "domain": 4,
                      "ddp": world // 4, "wrapper": "none", "field": [1, 1, 66, 64]})
    return cases


def peak_cases(world: int = 4, scale: int = 1) -> list[dict]:
    """The configurations the planner's step peak is checked on, against the allocator's peak measured on ``world``
    ranks: 2-D and 3-D fields, even and uneven shards, DDP, FSDP2 and none, checkpointing, bf16 (autocast and
    FSDP2's param_dtype), reshard_after_forward False, domain 1, 2 and 4 where they divide ``world`` (ddp = the rest).

    Two are state-heavy (width 64 on a 32 x 32 field), so FSDP2's gathered units and gradients weigh in the peak; the
    others are activation-heavy, and only their spatial sizes are multiplied by ``scale`` (1: a few seconds on CPU
    ranks; ``make gpu-check`` takes 16: a 1024 x 1024 field and larger). Scaled, a state-heavy field's activations
    would bury its state (at 16: 257 MiB of activations beside 303 KiB of state), so those keep their field and
    widen instead, up to 4 times (256 channels: a peak of some 16 MiB, in which a GPU's fixed costs, a cuDNN
    workspace and 512-byte blocks, stay small)."""
    bf16 = "bfloat16"
    table = [  # name, domain, wrapper, width, spatial, levers, state-heavy (not scaled)
        ("2-D even", 4, "ddp", 16, (64, 64), {}, False),
        ("2-D uneven, checkpoint", 4, "ddp", 16, (66, 64), {"checkpoint": True}, False),
        ("2-D", 2, "fsdp2", 16, (96, 64), {}, False),
        ("2-D, checkpoint + param_dtype bf16", 2, "fsdp2", 16, (96, 64), {"checkpoint": True, "param_dtype": bf16},
         False),
        ("2-D, autocast bf16", 2, "ddp", 16, (96, 64), {"autocast": bf16}, False),
        ("2-D uneven, checkpoint + autocast bf16", 4, "none", 16, (130, 64), {"checkpoint": True, "autocast": bf16},
         False),
        ("2-D state-heavy", 1, "fsdp2", 64, (32, 32), {}, True),
        ("2-D state-heavy, no reshard after forward", 1, "fsdp2", 64, (32, 32), {"reshard_after_forward": False},
         True),
        ("3-D", 2, "fsdp2", 8, (20, 16, 16), {}, False),
        ("3-D uneven, checkpoint", 4, "ddp", 8, (18, 12, 12), {"checkpoint": True}, False),
    ]
    cases = []
    for name, domain, wrapper, width, spatial, levers, state_heavy in table:
        domain = max(n for n in (1, 2, 4) if n <= domain and world % n == 0)
        field = [1, 1, *(size * (1 if state_heavy else scale) for size in spatial)]
        width *= min(scale, 4) if state_heavy else 1
        cases.append({"name": f"{name}, {wrapper} N={domain}", "model": {"width": width, "layers": 3},
                      "domain": domain, "ddp": world // domain, "wrapper": wrapper, "field": field, "levers": levers})
    return cases


def conv_stack_kwargs(kwargs: dict) -> dict:
    """``conv_stack``'s keyword arguments with its defaults filled in (so equal models compare equal)."""
    return {"width": 16, "layers": 3, "kernel_size": 3, "seed": 0} | kwargs


def case_levers(case: dict) -> Levers:
    """A case's ``"levers"`` (JSON: dtypes by name, e.g. ``{"autocast": "bfloat16"}``) as ``sl.train.Levers``."""
    given = dict(case.get("levers") or {})
    for name in ("autocast", "param_dtype"):
        if given.get(name) is not None:
            given[name] = DTYPES[given[name]]
    return Levers(**given)


def _case_samples(case: dict, steps: int = 2):
    """Inputs and targets for a case: the series' Darcy fields, or random ones of the case's shape (CPU tensors,
    moved to the rank's device by the Trainer)."""
    if case.get("field") is None:
        return None
    shape = case["field"]
    generator = torch.Generator().manual_seed(0)
    n = steps * case["ddp"]
    return (torch.randn((n, *shape[1:]), generator=generator), torch.randn((n, 1, *shape[2:]), generator=generator))


def measure_cases(cases: list[dict], timeout_s: float = 120.0) -> dict:
    """On every rank of a launched job: each case measured once (cases with equal models share a run), one after
    another, with what each left freed before the next (``sl.measure.release_memory``) and cuDNN pinned while each
    runs (``measure_rank``)."""
    import torch.distributed as dist

    from ..measure.memory import release_memory

    state = init_distributed(timeout_s)
    results, done = [], {}
    for case in cases:
        key = json.dumps([conv_stack_kwargs(case["model"]), case["domain"], case["wrapper"], case["field"],
                          case.get("levers")])
        if key not in done:
            mesh = build_mesh(ddp=case["ddp"], domain=case["domain"])
            dims = len(case["field"]) - 2 if case.get("field") else 2
            model = conv_stack(**conv_stack_kwargs(case["model"]), dims=dims).to(state.device)
            mine = measure_rank(model, mesh, case["wrapper"], samples=_case_samples(case),
                                levers=case_levers(case)).as_dict()
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            done[key] = everyone
            del model, mesh
            release_memory(state.device)  # as each measurement also does on entry (AllocatorPeak)
        results.append(case | {"ranks": done[key]})
    return {"world_size": state.world_size, "backend": state.backend, "device": state.device,
            "threads": torch.get_num_threads(), "cases": results}


def predict_case(case: dict, device: str = "cuda", threads: int | None = None) -> Plan:
    """The planner's prediction for one of ``series_cases`` (or any case of that form, its ``"loading"`` scatter
    unless it says slab), for ``device``'s kernels (CPU: this CPU's, with ``threads`` intra-op threads, as the ranks
    ran)."""
    from .inputs import conv_model

    field_shape = case["field"] or [1, 1, 64, 64]  # the Darcy fields of data/
    kwargs = conv_stack_kwargs(case["model"])
    model = conv_model(len(field_shape) - 2, width=kwargs["width"], depth=kwargs["layers"],
                       kernel_size=kwargs["kernel_size"])
    return plan(model, field_shape, ddp=case["ddp"], domain=case["domain"], wrapper=case["wrapper"], device=device,
                levers=case_levers(case), threads=threads, loading=case.get("loading", "scatter"))


def comparison_table(measurement: dict) -> list[dict]:
    """Every case and rank of a ``measure_cases`` result against the planner: one row per rank."""
    rows = []
    for case in measurement["cases"]:
        measured = [RankBytes.from_dict(r) for r in case["ranks"]]
        device = "cpu" if str(measurement["device"]).startswith("cpu") else "cuda"  # CPU-only: as the ranks reported it
        predicted = predict_case(case, device, measurement.get("threads"))
        rows += [{"case": case["name"]} | row for row in compare(predicted, measured)]
    return rows


def peak_table(measurement: dict) -> list[dict]:
    """Per case of a ``measure_cases`` result: the planner's step peak against the allocator's, for the rank that
    needs the most (predicted), and the worst error over all ranks."""
    rows = comparison_table(measurement)
    table = []
    for case in measurement["cases"]:
        ranks = [r for r in rows if r["case"] == case["name"]]
        big = max(ranks, key=lambda r: r["predicted peak"])
        worst = max(ranks, key=lambda r: abs(r["peak error"]))
        table.append({"configuration": case["name"], "rank": big["rank"], "predicted peak": big["predicted peak"],
                      "measured peak": big["measured peak"], "error": big["peak error"],
                      "worst rank error": worst["peak error"]})
    return table


def measure_on_ranks(n: int, cases: list[dict] | None = None, timeout_s: float = 900.0):
    """Start ``n`` ranks (torchrun, through ``launch.run_job``) that measure ``cases`` (default:
    ``series_cases(n)``); the job, whose ``.result`` is rank 0's measurement and ``.placement`` says where it ran."""
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-") as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps(cases or series_cases(n)))
        return run_job("torchrun", n, "shardlab.plan", ["--measure", "--cases", str(spec)], timeout_s=timeout_s)


def gpu_check(gpus: int, timeout_s: float = 300.0, scale: int = 16) -> tuple[str, bool]:
    """For ``make gpu-check``: the planner's predicted step peak per rank against the allocator's on real GPUs
    (``max_memory_allocated`` above what was allocated before the step's measurement, plus the model: the quantity CPU
    ranks read from theirs), within 10 %, for ``peak_cases(gpus, scale)`` (the configurations CPU ranks check against
    their allocator, the activation-heavy ones ``scale`` times larger: a 1024 x 1024 field at 16), measured with
    cuDNN pinned (``pinned_cudnn``)."""
    job = measure_on_ranks(gpus, peak_cases(gpus, scale), timeout_s)
    measurement = job.result
    rows = comparison_table(measurement) if job.placement.device == "cuda" else []
    if not rows or not all(r.get("measured peak") is not None for r in rows):
        return f"no CUDA peak was measured (on {job.placement.label}, device {measurement['device']})", False
    worst = max(rows, key=lambda r: abs(r["peak error"]))
    cells = [f"{r['case']}: predicted {fmt_bytes(r['predicted peak'])}, max_memory_allocated "
             f"{fmt_bytes(r['measured peak'])} ({r['peak error']:+.1%})" for r in rows if r["rank"] == 0]
    ok = all(abs(r["peak error"]) <= 0.10 for r in rows)
    return f"on {job.placement.label}: " + "; ".join(cells) + f"; worst rank {worst['peak error']:+.1%}", ok
