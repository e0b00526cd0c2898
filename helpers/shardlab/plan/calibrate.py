"""On the ranks: one training step of a parity case measured at the two sizes ``cases.CasePlanner`` extrapolates from
(``python -m shardlab.plan.calibrate SPEC``, a job ``calibrate`` starts)."""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from ..levers import NO_LEVERS, Levers
from ..ranks.launch import run_job
from ..workarounds import exact_mean
from .inputs import DTYPES, calibration_sizes, case_ref


def _loss(case, out):
    if case.loss is not None:
        return case.loss(out)
    return sum(exact_mean(t.square()) for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _laid_out(case, model, mesh, levers: Levers):
    """The model as the case's strategy lays it out: DDP over ``ddp``; or its spatial parameters split on ``domain``
    as DTensors and ``fully_shard`` over ``ddp`` (with ``levers``' MixedPrecisionPolicy)."""
    from physicsnemo.domain_parallel import sync_module_over_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..train import shard_spatial

    if case.strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["ddp"].get_group(),
                                                         find_unused_parameters=True)
    sync_module_over_mesh(model, mesh["domain"], verify=True)
    shard_spatial(model, case.spatial, mesh["domain"])
    policy = MixedPrecisionPolicy(param_dtype=levers.param_dtype) if levers.param_dtype else MixedPrecisionPolicy()
    fully_shard(model, mesh=mesh["ddp"], mp_policy=policy, reshard_after_forward=levers.reshard_after_forward)
    return model


REPEATS = 3  # steps measured per size


def measure_step(case, size: int, mesh, dtype, optimizer: str, levers: Levers = NO_LEVERS) -> dict:
    """On every rank together: one training step of ``case`` at ``size``, measured (see the module's docstring)."""
    import contextlib

    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager
    from torch.distributed.tensor import Replicate, Shard

    from ..measure.memory import AllocatorPeak, SavedActivations
    from ..mesh import scatter
    from .inputs import OPTIMIZERS

    device = DistributedManager().device
    source = dist.get_global_rank(mesh["domain"].get_group(), 0)
    lower = torch.autocast(device.type, levers.autocast) if levers.autocast else contextlib.nullcontext()
    with AllocatorPeak(device) as peak:
        model = _laid_out(case, case.model(size).to(device, dtype), mesh, levers)
        opt = OPTIMIZERS[optimizer](model.parameters())
        whole = {k: v.to(device) for k, v in case.whole_inputs(size, dtype).items()}
        inputs = {k: scatter(v, source, mesh["domain"], (Shard(case.shard[k]) if k in case.shard else Replicate(),))
                  for k, v in whole.items()}
        del whole
        local = [t.to_local() if hasattr(t, "to_local") else t for t in inputs.values()]
        kept = sum(t.untyped_storage().nbytes() - t.numel() * t.element_size() for t in local)

        def step():
            opt.zero_grad()
            with lower:
                loss = _loss(case, model(inputs) if case.one_dict else model(**inputs))
            loss.backward()
            opt.step()

        step()  # the gradients and the optimizer's state, as a first step makes them
        held = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        with SavedActivations(exclude=held) as saved, peak.window():
            step()
    return {"peak": peak.peak, "saved": saved.bytes, "kept": kept}


def calibrate(cases, ranks: int, dtype=torch.float32, optimizer: str = "adam", levers: Levers = NO_LEVERS,
              timeout_s: float = 600.0) -> list[dict]:
    """Each case's step measured on ``ranks`` ranks (one job) at its two calibration sizes; one dict per case."""
    spec = {"cases": [case_ref(c) for c in cases], "dtype": str(dtype).removeprefix("torch."),
            "optimizer": optimizer, "levers": _levers_json(levers)}
    with tempfile.TemporaryDirectory(prefix="shardlab-plan-cases-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        return run_job("torchrun", ranks, "shardlab.plan.calibrate", [str(path)], timeout_s=timeout_s).result


def _levers_json(levers: Levers) -> dict:
    name = {v: k for k, v in DTYPES.items()}
    return {"checkpoint": levers.checkpoint, "autocast": name.get(levers.autocast),
            "param_dtype": name.get(levers.param_dtype), "reshard_after_forward": levers.reshard_after_forward}


def _main(path: str) -> None:
    import torch.distributed as dist

    from shardlab.mesh import build_mesh
    from shardlab.plan import calibrate as here  # the module, not this __main__ copy
    from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result
    from shardlab.workarounds import register_shard_ops_on_cpu

    spec = json.loads(Path(path).read_text())
    init_distributed(120)
    lv = spec["levers"]
    levers = Levers(lv["checkpoint"], lv["autocast"] and DTYPES[lv["autocast"]],
                    lv["param_dtype"] and DTYPES[lv["param_dtype"]], lv["reshard_after_forward"])
    mesh = build_mesh(ddp=1, domain=dist.get_world_size())
    out = []
    for ref in spec["cases"]:
        module, _, name = ref.partition(":")
        case = getattr(importlib.import_module(module), name)
        sizes = calibration_sizes(case, dist.get_world_size())
        if case.all_handlers and not torch.cuda.is_available():
            register_shard_ops_on_cpu(everything=True)
        row = {"case": case.name, "sizes": list(sizes), "device": str(mesh.device_type), "ranks": []}
        try:
            for size in sizes:
                # the least peak of three steps: other threads' allocations (gloo's, the profiler's) land in some
                # steps' windows, some 3 % of a few MiB either way, and the line through two sizes doubles that
                mine = min((here.measure_step(case, size, mesh, DTYPES[spec["dtype"]], spec["optimizer"], levers)
                            for _ in range(REPEATS)), key=lambda measured: measured["peak"])
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                row["ranks"].append(every)
        except Exception as error:  # the model's own failure is this case's answer
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        out.append(row)
    if dist.get_rank() == 0:
        write_job_result(out)
    shutdown_distributed()


if __name__ == "__main__":
    _main(sys.argv[1])
