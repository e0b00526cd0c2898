"""``python -m shardlab.plan``: one layout planned and judged from a terminal, or the series' cases measured."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from ..levers import Levers
from ..ranks.launch import detect_launch, shutdown_distributed, write_job_result
from ..report import Table
from ..train import WRAPPERS
from .inputs import DTYPES, GPUS, LOADINGS, OPTIMIZERS, GiB, conv_model, fmt_bytes, parse_field, parse_size
from .planner import Planner, Verdict, verdict
from .records import LEFT_OUT, Plan
from .validate import (
    comparison_table,
    measure_cases,
    measure_on_ranks,
    peak_cases,
    peak_table,
    series_cases,
)


def _print_plan(planner: Planner, result: Plan, capacity: int | None, gpu: str | None) -> Verdict | None:
    what = (f"at size {result.field_shape[2]} (planned by: {result.method})" if result.method != "meta replay" else
            f"on a {'x'.join(map(str, result.field_shape[2:]))} field ({result.field_shape[1]} channel(s), batch "
            f"{result.field_shape[0]} per domain group)")
    print(f"# memory plan: {result.model} {what}, {result.dtype}; "
          f"mesh (ddp={result.ddp}, domain={result.domain}), {result.wrapper}, {result.optimizer}; loading: "
          f"{result.loading} ({LOADINGS[result.loading]}); levers: {result.levers}")
    print(result.table())
    for note in result.notes:
        print(f"# {note}")
    big = result.largest()
    print(f"# largest rank: {big.rank}, {fmt_bytes(big.total)} (step peak {fmt_bytes(big.peak)}); planned in "
          f"{result.seconds:.2f} s ({result.method})")
    print("# left out (headroom the verdict keeps):")
    for item in LEFT_OUT:
        size = (f"{item['fraction']:.0%} of the need" if "fraction" in item
                else fmt_bytes(item["bytes"]) if item.get("bytes") else "in the 10 %")
        print(f"#   {item['what']}: {size}; typically {item['typical']} [{item['source']}]")
    if capacity is None:
        return None
    v = verdict(planner, result, capacity)
    print(f"verdict on {capacity / GiB:.1f} GiB GPUs (--gpu {gpu}): {v.text} (need {fmt_bytes(v.need)} + headroom "
          f"{fmt_bytes(v.headroom)})")
    return v


def _case_planner(args) -> Planner:
    """``--case module:name --size N``: the case planned from its ranks' measurements (``--calibration``)."""
    import importlib

    from .inputs import is_case

    module, _, name = args.case.partition(":")
    try:
        case = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        case = None
    if not is_case(case):
        raise ValueError(f"--case {args.case}: give a parity case as module:name, e.g. "
                         "shardlab.model_cases:transolver (sl.parity.Case).")
    if args.size is None or args.size < 1:
        raise ValueError("--case needs --size N: the target size (points, or rows of a field), e.g. --size 1000000.")
    stored = Path(args.calibration) if args.calibration else None
    calibration = json.loads(stored.read_text()) if stored and stored.exists() else None
    planner = Planner(case, args.size, DTYPES[args.dtype], args.optimizer, loading=args.loading,
                      ranks=args.ranks or 2, calibration=calibration)
    if stored and calibration is None:
        stored.write_text(json.dumps(planner.calibration(), indent=1))
    return planner


def _check_writable(path: str) -> None:
    """``--json``'s path, refused before any work if it cannot be written."""
    target = Path(path)
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK) or (
            target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"--json {path}: cannot write there; give a file in a folder that exists and that you can "
                         "write to.")


def main(argv=None) -> int:
    """Predict every rank's memory for a field, a model and a (ddp, domain) layout; with --measure, measure the
    series' own cases on real ranks and compare."""
    parser = argparse.ArgumentParser(prog="python -m shardlab.plan", description=main.__doc__)
    parser.add_argument("--field", default="4096x4096", help="spatial size, e.g. 4096x4096 or 512x512x512")
    parser.add_argument("--domain", type=int, default=1, help="ranks that shard one sample (domain axis)")
    parser.add_argument("--ddp", type=int, default=1, help="replicas on the ddp axis")
    parser.add_argument("--wrapper", choices=WRAPPERS, default="ddp")
    parser.add_argument("--gpu", help="memory per GPU with its unit: 80GiB, 40GB (10^9 bytes), or a name: "
                        + ", ".join(GPUS))
    parser.add_argument("--model", choices=["conv_stack"], default="conv_stack",
                        help="conv_stack: the series' surrogate (Conv3d for a 3-D field)")
    parser.add_argument("--case", help="any model, as a parity case 'module:name' (e.g. "
                        "shardlab.model_cases:transolver): measured on --ranks ranks at two small sizes and "
                        "extrapolated to --size")
    parser.add_argument("--size", type=int, help="with --case: the target size (points, or rows of a field)")
    parser.add_argument("--calibration", help="with --case: a JSON file of the ranks' measurements: read when it "
                        "exists, else measured and written there")
    parser.add_argument("--channels", type=int, default=16, help="hidden channels (conv_stack width)")
    parser.add_argument("--depth", type=int, default=3, help="convolution layers")
    parser.add_argument("--kernel-size", type=int, default=3, help="an odd kernel size: 3, 5, 7, ...")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing, block by block")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], help="forward and loss under torch.autocast")
    parser.add_argument("--param-dtype", choices=["bfloat16", "float16"],
                        help="FSDP2's MixedPrecisionPolicy param_dtype (fp32 master weights and gradient reduction)")
    parser.add_argument("--no-reshard-after-forward", action="store_true",
                        help="FSDP2 keeps every unit gathered from its forward to its backward")
    parser.add_argument("--loading", choices=list(LOADINGS), default="scatter",
                        help="how each rank gets its batch: scatter (scatter_tensor, the whole field on every rank of "
                             "a domain group) or slab (each rank reads only its own rows: no full field anywhere)")
    parser.add_argument("--json", help="write the per-rank rows and the verdict to this file")
    parser.add_argument("--measure", action="store_true",
                        help="measure the series' cases (notebooks 04, 05, 07; N = 1, 2, 4; DDP, FSDP2) on 4 ranks")
    parser.add_argument("--measure-peaks", action="store_true",
                        help="measure the step peak of the planner's peak configurations (2-D, 3-D, DDP, FSDP2, "
                             "levers) on --ranks ranks: predicted vs the allocator's, per configuration; with "
                             "--measure, both in one job")
    parser.add_argument("--cases", help="with --measure: a JSON file of cases instead of the series' own")
    parser.add_argument("--ranks", type=int, help="ranks to start: with --measure (default 4), with --case (default 2)")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.measure or args.measure_peaks:
        args.ranks = args.ranks or 4
        return _measure_main(args)

    try:
        if args.json:
            _check_writable(args.json)
        capacity = parse_size(args.gpu) if args.gpu else None
        planner = _case_planner(args) if args.case else Planner(
            conv_model(len(parse_field(args.field)) - 2, args.channels, args.depth, args.kernel_size),
            parse_field(args.field), DTYPES[args.dtype], args.optimizer,
            name=f"conv_stack(width={args.channels}, depth={args.depth}, kernel={args.kernel_size})",
            loading=args.loading)
        levers = Levers(args.checkpoint, args.autocast and DTYPES[args.autocast],
                        args.param_dtype and DTYPES[args.param_dtype], not args.no_reshard_after_forward)
        result = planner.plan(args.ddp, args.domain, args.wrapper, levers)
    except ValueError as error:  # one line that says what to change, no traceback
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    v = _print_plan(planner, result, capacity, args.gpu)
    if args.json:
        out = result.as_json(capacity) | {"verdict": asdict(v) if v else None}
        try:
            Path(args.json).write_text(json.dumps(out, indent=1))
        except OSError as error:
            print(f"{parser.prog}: error: --json {args.json}: {error.strerror}", file=sys.stderr)
            return 2
    return 0


def series_and_peaks(measurement: dict, ranks: int) -> tuple[dict, dict]:
    """A measurement of both sets (``--measure --measure-peaks``) as two: the series' cases, the peak configurations."""
    names = {case["name"] for case in peak_cases(ranks)}
    series = [case for case in measurement["cases"] if case["name"] not in names]
    peaks = [case for case in measurement["cases"] if case["name"] in names]
    return measurement | {"cases": series}, measurement | {"cases": peaks}


def _print_comparison(measurement: dict) -> None:
    rows = comparison_table(measurement)
    print(f"# planner vs measured, {measurement['world_size']} rank(s), backend {measurement['backend']}, "
          f"device {measurement['device']}")
    print(Table([r | {"error": f"{r['error']:+.2%}"} | ({"peak error": f"{r['peak error']:+.2%}"}
                                                        if "peak error" in r else {}) for r in rows]))


def _print_peaks(measurement: dict) -> None:
    print(f"# step peak per rank, planner vs allocator (torch.profiler memory events on CPU, max_memory_allocated on "
          f"GPU); {measurement['world_size']} rank(s), backend {measurement['backend']}, device "
          f"{measurement['device']}, {measurement.get('threads', '?')} intra-op thread(s) per rank")
    print(Table([r | {"predicted peak": fmt_bytes(r["predicted peak"]), "measured peak": fmt_bytes(r["measured peak"]),
                      "error": f"{r['error']:+.1%}", "worst rank error": f"{r['worst rank error']:+.1%}"}
                 for r in peak_table(measurement)]))


def _measure_main(args) -> int:
    cases = json.loads(Path(args.cases).read_text()) if args.cases else None
    if args.measure_peaks and cases is None:
        cases = peak_cases(args.ranks) + (series_cases(args.ranks) if args.measure else [])
    if detect_launch().launcher == "none":  # not under a launcher: start the ranks, then compare here
        measurement = measure_on_ranks(args.ranks, cases, timeout_s=1800).result
        if args.measure and args.measure_peaks and not args.cases:  # one job, both tables
            series, peaks = series_and_peaks(measurement, args.ranks)
            _print_peaks(peaks)
            _print_comparison(series)
        else:
            (_print_peaks if args.measure_peaks else _print_comparison)(measurement)
        if args.json:
            Path(args.json).write_text(json.dumps(measurement, indent=1))
        return 0
    import torch.distributed as dist

    measurement = measure_cases(cases or series_cases(int(os.environ.get("WORLD_SIZE", "1"))), args.timeout)
    if dist.get_rank() == 0:
        write_job_result(measurement)
        if args.json:
            Path(args.json).write_text(json.dumps(measurement, indent=1))
    shutdown_distributed()
    return 0
