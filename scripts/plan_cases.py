"""The planner for any model, checked: each model of docs/models.md that runs on CPU ranks, planned by
``sl.plan.Planner(case, size)`` (measured on the ranks at two sizes, extrapolated) at a third size it never measured,
against one training step measured at that size by this file's own code; then how long a plan of a 10⁷-point and a
40960² target takes once torch is imported.

    python scripts/plan_cases.py                 # 2 and 4 ranks, every model of the table; prints the ratios
    python scripts/plan_cases.py --ranks 2 --case transolver --no-timing

The measurement shares no code with the prediction: the model is laid out by the parity harness
(``parity._distributed``, ``parity._scattered``), its step is written here, and the peak is read from
torch.profiler's ``[memory]`` events (every CPU allocation and free, in time order, since before the model was built),
not through ``sl.measure`` or ``sl.plan``. Ranks are CPU ranks: a ratio here is no GPU figure.
"""

from __future__ import annotations

import argparse
import sys
import time

WINDOW = "plan_cases: the measured step"


REPEATS = 3


def measured_peak(ref: str, size: int, dtype: str = "float32") -> int:
    """On every rank together: one training step of the case at ``size`` (after a warm-up step), its peak bytes:
    everything this rank allocated since before building the model that is live at the step's high-water mark."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardlab import parity
    from shardlab.mesh import build_mesh

    case = parity.load(ref)
    mesh = build_mesh(ddp=1, domain=dist.get_world_size())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        whole, model, _ = parity._prepared(case, size, mesh, getattr(torch, dtype))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
        inputs = parity._scattered(case, whole, mesh)
        del whole
        for step in range(2):
            with record_function(WINDOW if step else "warm-up"):
                optimizer.zero_grad()
                parity._loss(case, parity._call(case, model, inputs)).backward()
                optimizer.step()
    events = list(prof.profiler.kineto_results.events())
    window = next(e for e in events if e.name() == WINDOW)
    live, peak = 0, 0
    for event in sorted((e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"),
                        key=lambda e: e.start_ns()):
        live += event.nbytes()  # an allocation (+) or a free (-)
        if window.start_ns() <= event.start_ns() <= window.end_ns():
            peak = max(peak, live)
    return peak


def _rank_program(refs: list[str], sizes: list[int]) -> None:
    import torch.distributed as dist

    from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result

    init_distributed(120)
    rows = []
    for ref, size in zip(refs, sizes):
        try:
            # the least of three: the step's own peak, without what other threads (gloo's, the profiler's) happened
            # to allocate meanwhile; at a few MiB that noise is some 3 % either way, run to run
            mine = min(measured_peak(ref, size) for _ in range(REPEATS))
        except Exception as error:  # the model's own failure: every rank raises it at the same op
            mine = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rows.append({"case": ref, "size": size, "ranks": every})
    if dist.get_rank() == 0:
        write_job_result(rows)
    shutdown_distributed()


def check_size(case, ranks: int) -> int:
    """A size the planner does not measure: ``memory_scale`` times the larger of its two (``calibration_sizes``)."""
    from shardlab.plan.inputs import calibration_sizes

    return calibration_sizes(case, ranks)[1] * case.memory_scale


def measure_on_ranks(cases: list, ranks: int, timeout_s: float = 600) -> list[dict]:
    """Each case's peak per rank at ``check_size``, measured by ``measured_peak`` in one job of ``ranks`` ranks."""
    from pathlib import Path

    from shardlab import model_cases
    from shardlab.ranks.launch import run_job

    refs = [model_cases.ref(c) for c in cases]
    sizes = [str(check_size(c, ranks)) for c in cases]
    return run_job("torchrun", ranks, Path(__file__).resolve(), ["--rank-program", *refs, "--sizes", *sizes],
                   timeout_s=timeout_s).result


def ratios(cases: list, ranks: int) -> list[dict]:
    """Per case: the planner's peak of the largest rank at the check size over the measured one."""
    from shardlab import plan

    measured = measure_on_ranks(cases, ranks)
    rows = []
    for case, got in zip(cases, measured):
        row = {"model": case.name, "ranks": ranks, "size": got["size"]}
        if any(isinstance(v, str) for v in got["ranks"]):
            rows.append(row | {"error": next(v for v in got["ranks"] if isinstance(v, str))})
            continue
        planner = plan.Planner(case, got["size"], ranks=ranks)
        wrapper = "fsdp2" if case.strategy == "fsdp_spatial" else "ddp"
        predicted = planner.plan(1, ranks, wrapper)
        rows.append(row | {"method": predicted.method, "measured at": planner.calibration()["sizes"],
                           "predicted": max(r.peak for r in predicted.rows), "measured": max(got["ranks"]),
                           "ratio": max(r.peak for r in predicted.rows) / max(got["ranks"])})
    return rows


def timings() -> list[dict]:
    """Seconds to plan and judge a 10⁷-point Transolver and a 40960² U-Net on 8 H100s, once torch is imported (the
    case's calibration, a job of ranks made once, is timed apart)."""
    import torch  # noqa: F401  (imported before the clock starts)

    from shardlab import model_cases, plan

    rows = []
    for case, size in ((model_cases.transolver, 10**7), (model_cases.unet, 40960)):
        start = time.perf_counter()
        planner = plan.Planner(case, size)
        built = time.perf_counter()
        planner.calibration()
        calibrated = time.perf_counter()
        result = planner.plan(1, 8, "ddp")
        text = plan.verdict(planner, result, plan.GPUS["H100 (80 GB)"]).text
        done = time.perf_counter()
        rows.append({"target": f"{case.name} at {size}", "seconds to plan": round(built - start + done - calibrated, 2),
                     "of which building the model on meta": round(built - start, 2),
                     "calibration on ranks (once)": round(calibrated - built, 1), "verdict on 8 H100": text})
    start = time.perf_counter()
    conv = plan.Planner(plan.conv_model(2), (1, 1, 40960, 40960))
    text = plan.verdict(conv, conv.plan(1, 8, "ddp"), plan.GPUS["H100 (80 GB)"]).text
    rows.append({"target": "conv_stack at 40960x40960 (meta replay)",
                 "seconds to plan": round(time.perf_counter() - start, 2), "verdict on 8 H100": text})
    return rows


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--rank-program":
        at = argv.index("--sizes")
        _rank_program(argv[1:at], [int(s) for s in argv[at + 1:]])
        return 0
    from shardlab import model_cases
    from shardlab.report import Table

    parser = argparse.ArgumentParser(prog="python scripts/plan_cases.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--case", nargs="+", help="names in shardlab.model_cases (default: the table's CASES)")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args(argv)
    cases = [getattr(model_cases, n) for n in args.case] if args.case else list(model_cases.CASES)
    for ranks in args.ranks:
        rows = []
        for case in cases:  # one job each: a model that ends its process takes no other row with it
            try:
                rows += ratios([case], ranks)
            except Exception as error:  # noqa: BLE001 (the row says what stopped it)
                rows.append({"model": case.name, "ranks": ranks, "error": str(error).splitlines()[-1][:200]})
        print(f"# planned peak / measured peak, largest rank, {ranks} CPU ranks (10 % is the bound)")
        print(Table([r | ({"ratio": f"{r['ratio']:.3f}"} if "ratio" in r else {}) for r in rows]))
    if not args.no_timing:
        print("# item 7: planning a large target once torch is imported")
        print(Table(timings()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
