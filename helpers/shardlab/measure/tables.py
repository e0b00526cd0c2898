"""``python -m shardlab.measure``: the measurement tables, printed side by side in one run (the ones that need ranks
in one torchrun job it starts itself)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import field_store, load_darcy, open_store
from ..mesh import build_mesh
from ..models import conv_stack, unet
from ..ranks.launch import (
    JobFailed,
    default_device,
    detect_launch,
    init_distributed,
    run_job,
    shutdown_distributed,
    write_job_result,
)
from ..report import Table
from ..train import train
from . import (
    DevicePeak,
    activation_bytes_by_domain_size,
    fp32_precision,
    ideal_activation_ratio,
    state_bytes,
    synchronize,
    timeline,
)
from .host import LOADERS, measure_loading


def _gather_rows(rows: dict) -> list[dict]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    return everyone


def activation_memory_table(args) -> dict:
    """Bytes saved for backward on the largest rank, for each domain size, against 1/N + halo."""
    state = init_distributed(args.timeout)
    field = load_darcy(samples=1)["permeability"].to(state.device)
    model = conv_stack(width=args.width, layers=args.layers, kernel_size=args.kernel_size).to(state.device)
    peaks: dict = {}
    everyone = _gather_rows({"saved": activation_bytes_by_domain_size(model, field, sizes=args.sizes, peaks=peaks),
                             "peaks": peaks})
    base = max(r["saved"][args.sizes[0]] for r in everyone)
    rows = []
    for n in args.sizes:
        largest = max(r["saved"][n] for r in everyone)
        ideal = ideal_activation_ratio(n, field.shape[2], args.kernel_size) / ideal_activation_ratio(
            args.sizes[0], field.shape[2], args.kernel_size)
        rows.append({"N": n, "bytes_max_rank": largest, "ratio": largest / base, "ideal_1/N+halo": ideal,
                     "ideal_1/N": args.sizes[0] / n, "ratio/ideal": largest / base / ideal})
        if everyone[0]["peaks"][n]["measured"]:  # a GPU: the allocator's peak beside the byte count
            rows[-1]["cuda_peak_above_start_max_rank"] = max(r["peaks"][n]["peak above start"] for r in everyone)
    return {"title": f"activation memory per rank: bytes saved for backward by conv_stack(width={args.width}, "
                     f"layers={args.layers}, kernel_size={args.kernel_size}) on a 1x1x64x64 Darcy field, fp32; "
                     f"ratio = largest rank's bytes at N / at N={args.sizes[0]}",
            "rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "rows": rows}


def state_memory_table(args) -> dict:
    """Parameters + gradients + Adam state per rank, FSDP2 over DDP, for each ddp size."""
    state = init_distributed(args.timeout)
    rows = []
    for ddp in args.sizes:
        mesh = build_mesh(ddp=ddp, domain=-1)
        mine = {}
        for how in ("ddp", "fsdp2"):
            with DevicePeak(state.device) as peak:
                run = train(conv_stack(width=args.width, layers=args.layers, seed=0).to(state.device), mesh, how,
                            steps=2)
            mine[how] = sum(state_bytes(run.model, run.optimizer).values())
            mine[f"{how} peak"] = peak.peak_above_start if peak.measured else None  # the model is built inside
            del run  # the next case's DevicePeak starts by freeing what this one left (release_memory)
        everyone = _gather_rows(mine)
        ddp_bytes, fsdp_bytes = (max(r[k] for r in everyone) for k in ("ddp", "fsdp2"))
        rows.append({"ddp_size": ddp, "DDP_bytes_max_rank": ddp_bytes, "FSDP2_bytes_max_rank": fsdp_bytes,
                     "FSDP2/DDP": fsdp_bytes / ddp_bytes, "ideal_1/ddp": 1 / ddp,
                     "ratio/ideal": fsdp_bytes / ddp_bytes * ddp})
        if mine["ddp peak"] is not None:  # a GPU: the allocator's peaks over the two training steps
            rows[-1] |= {f"cuda_peak_{how}_max_rank": max(r[f"{how} peak"] for r in everyone)
                         for how in ("ddp", "fsdp2")}
    return {"title": f"parameters + gradients + Adam state per rank (local shards), conv_stack(width={args.width}, "
                     f"layers={args.layers}); FSDP2 on the ddp mesh vs DDP, domain = world / ddp",
            "rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "rows": rows}


def loading_memory_table(args) -> dict:
    """One sample's input and target loaded as ShardTensors by ``scatter_tensor`` and by slab (lesson 12), for each
    domain size: the largest rank's file bytes, host peak and bytes held after, against 1/N of the two fields."""
    state = init_distributed(args.timeout)
    store = [str(field_store(big=args.big)) if state.rank == 0 else None]  # written once (or found), read by all
    dist.broadcast_object_list(store, src=0)
    array = open_store(store[0]).field("permeability")
    fields = 2 * array.shape[2] * array.shape[3] * array.dtype.itemsize
    rows = []
    for n in args.sizes:
        everyone = _gather_rows(measure_loading(store[0], build_mesh(ddp=-1, domain=n)))
        for way in LOADERS:
            ranks = [r[way] for r in everyone]
            top = {k: max(r[k] for r in ranks) if all(r[k] is not None for r in ranks) else None
                   for k in ("file bytes", "host peak", "held after", "device peak")}
            rows.append({"N": n, "loading": way, "fields/N": fields // n, "held_after_max_rank": top["held after"],
                         "held/(fields/N)": top["held after"] * n / fields, "host_peak_max_rank": top["host peak"],
                         "file_bytes_max_rank": top["file bytes"]})
            if top["device peak"] is not None:  # a GPU: the allocator's peak during the load
                rows[-1]["cuda_peak_above_start_max_rank"] = top["device peak"]
    return {"title": f"loading one sample's input and target ({array.shape[2]}x{array.shape[3]} float32 each, "
                     f"{fields} B together) as ShardTensors: scatter_tensor against every rank reading its slab; "
                     "host peak: the rank's resident memory above its start (VmHWM)",
            "rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "rows": rows}


def compile_speed_table(args) -> dict:
    """One process: compiled / eager forward+backward step time of a conv stack, interleaved repeats."""
    device = default_device()
    model = conv_stack(width=args.width, layers=args.layers, seed=0).to(device)
    compiled = torch.compile(conv_stack(width=args.width, layers=args.layers, seed=0).to(device), dynamic=False)
    x = torch.randn(1, 1, 64, 64, device=device)

    def step(m) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        m(x).square().mean().backward()
        synchronize(device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    step(compiled)
    compile_s = time.perf_counter() - t0
    step(model)
    eager, comp = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both alike
        eager.append(step(model))
        comp.append(step(compiled))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    output = model(x)  # with autograd on, as timed: under no_grad the compiled graph would be compiled again
    diff = ((compiled(x) - output).norm() / output.norm()).item()
    rows = [{"eager_step_s": med(eager), "compiled_step_s": med(comp), "compiled/eager": med(comp) / med(eager),
             "first_call_s": compile_s, "repeats": args.repeats, "compiled_relative_diff": diff}]
    return {"title": f"compile speed, one process, conv_stack(width={args.width}, layers={args.layers}) on 1x1x64x64, "
                     "forward+backward, median of interleaved repeats"
                     + ("" if device.type == "cuda" else "; CPU timing, not a GPU claim"),
            "rank": 0, "world_size": 1, "backend": None, "device": str(device), "rows": rows}


def tf32_error_table(args) -> dict:
    """One process: relative error of a conv stack's fp32 forward against the same model in fp64, with TF32 allowed
    and inside ``strict_fp32``: what TF32 costs, and that ``strict_fp32`` removes it."""
    device = default_device()
    model = conv_stack(width=args.width, layers=args.layers, seed=0).to(device)
    reference_model = conv_stack(width=args.width, layers=args.layers, seed=0).to(device).double()
    x = torch.randn(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        reference = reference_model(x.double())
        errors = {}
        for precision in ("tf32", "ieee"):
            with fp32_precision(precision):
                errors[precision] = ((model(x).double() - reference).norm() / reference.norm()).item()
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    rows = [{"tf32_relative_error": errors["tf32"], "strict_fp32_relative_error": errors["ieee"],
             "tf32_hardware": capability is not None and capability >= (8, 0)}]  # TF32 came with Ampere (sm_80)
    return {"title": f"TF32 error, one process, conv_stack(width={args.width}, layers={args.layers}) on 1x1x64x64, "
                     "fp32 forward against fp64" + ("" if device.type == "cuda" else "; CPU: no TF32, not a GPU claim"),
            "rank": 0, "world_size": 1, "backend": None, "device": str(device), "rows": rows}


def scaling_table(args) -> dict:
    """Notebook 14's scaling, on every rank: the small U-Net's step (DDP on ``ddp``) at each domain size N, on one
    128 x 64 field (strong) and on 32 rows per rank (weak); per N the slowest rank's median step and the ranks' mean
    share with a collective in flight."""
    state = init_distributed(args.timeout)
    small_unet = lambda: unet(width=8, levels=3, seed=0)  # noqa: E731
    rows = []
    for name, heights in (("strong", {n: 128 for n in args.sizes}), ("weak", {n: 32 * n for n in args.sizes})):
        everyone = _gather_rows(timeline.scaling(small_unet, heights))
        rows += [{"scaling": name, **{k: v for k, v in r.items() if k != "kinds"}}  # the table keeps the total
                 for r in timeline.across_ranks(everyone, strong=name == "strong")]
    return {"title": "scaling: unet(width=8, levels=3) forward+backward+SGD, DDP on ddp, the field over N domain "
                     "ranks, 3 profiled steps after one" + ("" if state.device.startswith("cuda")
                                                           else "; CPU ranks: the shape, not a GPU claim"),
            "rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "rows": rows}


def timeline_table(args) -> dict:
    """Notebook 14's step on every rank (its U-Net, DDP on ``ddp``, one Darcy sample per domain group scattered over a
    domain of 2), two steps profiled after one: per rank the step times, the shares (summing to 1), the collectives
    of each kind and caller, and the collectives' kernels in the trace (NCCL's ``ncclDevKernel_*``; none on gloo)."""
    import tempfile

    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.tensor import Shard
    from torch.profiler import record_function

    from ..data import normalized_darcy, sample_index
    from ..mesh import domain_source
    from ..train import wrap

    state = init_distributed(args.timeout)
    device = torch.device(state.device)
    mesh = build_mesh(ddp=-1, domain=2)
    src, replica = domain_source(mesh), mesh.get_coordinate()[0]
    inputs, targets = normalized_darcy(samples=8)
    model = wrap(unet(seed=0).to(device), mesh, "ddp")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(i):
        j = sample_index(i, mesh["ddp"].size(), replica, len(inputs))
        with record_function("load + scatter"):
            x = scatter_tensor(inputs[j : j + 1].to(device), src, mesh["domain"], (Shard(2),))
            y = scatter_tensor(targets[j : j + 1].to(device), src, mesh["domain"], (Shard(2),))
        with record_function("forward"):
            loss = torch.nn.functional.mse_loss(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    step(0)
    with tempfile.TemporaryDirectory(prefix="shardlab-timeline-") as folder:
        summary = timeline.profile_steps(step, 2, folder)
        trace = json.loads(Path(folder, f"rank-{state.rank}.json").read_text())["traceEvents"]
    shares = timeline.shares(summary)
    kinds = [kind for kind, *_ in summary["collectives"]]
    mine = {"rank": state.rank, "steps_s": timeline.step_seconds(summary), "shares_sum": sum(shares.values()),
            "communication": timeline.communication_share(summary), "compute": shares[timeline.COMPUTE],
            "idle": shares[timeline.IDLE], "halo exchange": kinds.count("halo exchange"),
            "ShardTensor all-reduces": kinds.count(timeline.SHARD_ALL_REDUCE),
            "DDP all-reduces": kinds.count(timeline.DDP_ALL_REDUCE),
            "NCCL kernels": sum(e.get("cat") == "kernel" and e["name"].startswith(("ncclDevKernel", "ncclKernel"))
                                for e in trace)}
    return {"title": "notebook 14's step, 2 profiled steps per rank: shares, collectives by kind and caller, NCCL "
                     "kernels in the trace" + ("" if state.device.startswith("cuda") else
                                               "; CPU ranks: the program, not a GPU claim"),
            "rank": state.rank, "world_size": state.world_size, "backend": state.backend, "device": state.device,
            "rows": _gather_rows(mine)}


TABLES = {
    "activation-memory": (activation_memory_table, 4, {"sizes": [1, 2, 4], "width": 16, "layers": 3}),
    "state-memory": (state_memory_table, 4, {"sizes": [1, 2, 4], "width": 64, "layers": 4}),
    "loading-memory": (loading_memory_table, 4, {"sizes": [2, 4]}),
    "compile-speed": (compile_speed_table, 1, {"sizes": [1], "width": 16, "layers": 3}),
    "tf32-error": (tf32_error_table, 1, {"sizes": [1], "width": 16, "layers": 3}),
    "scaling": (scaling_table, 4, {"sizes": [1, 2, 4]}),
    "timeline": (timeline_table, 4, {"sizes": [4]}),
}


def job_ranks(names: list[str], sizes: list[int] | None) -> int:
    """Ranks the job for the tables ``names`` starts: the largest size asked for (``--sizes 1``: one rank, which
    one GPU can run), else the most any table's defaults need."""
    return max(sizes) if sizes else max(max(TABLES[n][1], *TABLES[n][2]["sizes"]) for n in names)


def format_table(report: dict) -> Table:
    """A stable plain-text table: comment lines saying what and where, a header, one line per row."""
    where = f"{report['world_size']} rank(s), backend {report['backend']}, device {report['device']}"
    return Table(report["rows"], title=[report["title"], where], floatfmt=".4f", tablefmt="plain")


def main(argv=None) -> int:
    """Print measurements as stable tables: ``python -m shardlab.measure TABLE [TABLE ...] | all``.

    Tables that need ranks run together in one torchrun job (one start-up, not one per table)."""
    parser = argparse.ArgumentParser(prog="python -m shardlab.measure", description=main.__doc__)
    parser.add_argument("what", nargs="+", choices=[*TABLES, "all"], help="tables, or all of them, in one run")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="domain sizes (activation-memory) or ddp sizes (state-memory); one table only")
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--kernel-size", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9, help="compile-speed: timed steps of each kind")
    parser.add_argument("--big", action="store_true", help="loading-memory: the 4096² store instead of the small one")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--json", help="also write the table (several: {name: table}) as JSON to this file")
    args = parser.parse_args(argv)
    names = list(TABLES) if "all" in args.what else list(dict.fromkeys(args.what))
    if len(names) > 1 and (args.sizes or args.width or args.layers):
        parser.error("--sizes, --width and --layers apply to one table at a time")
    on_ranks = [name for name in names if TABLES[name][1] > 1]
    reports = {}
    if on_ranks and detect_launch().launcher == "none":
        # Not under a launcher: start the ranks the tables need, with the same options, in one job.
        options = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("width", "layers", "kernel_size", "timeout") and v is not None]
        options += ["--big"] if args.big else []
        options += ["--sizes", *map(str, args.sizes)] if args.sizes else []
        ranks = job_ranks(on_ranks, args.sizes)
        try:
            job = run_job("torchrun", ranks, "shardlab.measure", [*on_ranks, *options], timeout_s=900,
                          show_output=True)
        except JobFailed as failed:
            return failed.returncode
        reports |= job.result
        names = [name for name in names if name not in on_ranks]
    for name in names:
        table, _, defaults = TABLES[name]
        table_args = argparse.Namespace(**vars(args))
        for option, value in defaults.items():
            if getattr(table_args, option) is None:
                setattr(table_args, option, value)
        report = table(table_args)
        if report["rank"] == 0:
            print(format_table(report), end="\n\n", flush=True)
        reports[name] = report
    if reports and next(iter(reports.values()))["rank"] == 0:
        write_job_result(reports)
        if args.json:
            Path(args.json).write_text(json.dumps(reports if len(reports) > 1 else next(iter(reports.values())),
                                                  indent=1))
    if dist.is_initialized():  # not for compile-speed alone, even under a launcher: it initialises nothing
        shutdown_distributed()
    return 0

