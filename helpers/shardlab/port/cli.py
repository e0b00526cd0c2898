"""``python -m shardlab.port`` and ``sl.port.port``: the steps, each printed as it happens, stopping at the first that
fails with what to change. See ``shardlab/port/__init__.py`` and docs/port.md."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time

from ..plan import GiB, parse_size
from . import spec as specs
from . import steps
from .spec import PortError
from .write import check_free, write_run

STEPS = ("audit", "parity", "plan", "choice", "write")


def _target_size(field: str | None, points: str | None, size: int | None) -> int:
    given = [v for v in (field, points, size) if v is not None]
    if len(given) != 1:
        raise PortError("give the target once: --field HxW (a field), --points COUNT (a point cloud) or --size N.")
    if field is not None:
        dims = {int(d) for d in re.split(r"[x×,]", field) if d.strip().isdigit()}
        if len(dims) != 1:
            raise PortError(f"--field {field}: the case's inputs have one size N; give a field of equal sides "
                            "(4096x4096), or --size N.")
        return dims.pop()
    if points is not None:
        try:
            return int(float(points))
        except ValueError:
            raise PortError(f"--points {points}: give a count, e.g. 1000000 or 1e6.") from None
    return int(size)


def _step(number: int, name: str, text: str = "") -> float:
    print(f"[{number}/{len(STEPS)}] {name}{': ' + text if text else ''}", flush=True)
    return time.perf_counter()


def _done(t0: float, times: dict, name: str, lines=()) -> None:
    for line in lines:
        print(f"      {line}", flush=True)
    times[name] = time.perf_counter() - t0
    print(f"      ({times[name]:.1f} s)", flush=True)


def port(model: str, *, out, gpus: int, gpu: str, field: str | None = None, points: str | None = None,
         size: int | None = None, nodes: int = 1, inputs: dict | None = None, shard: dict | None = None,
         sizes: tuple | None = None, ranks: int = 4, domain: int | None = None, zarr: str | None = None,
         dtype: str = "float32", steps_: int = 100, global_batch: int | None = None, timeout_s: float = 600,
         skip_parity_gate: bool = False, command: str = "") -> dict:
    """Audit, parity, plan, choice, write (see the module's docstring); returns what each step found and took.
    Raises PortError, one line, at the first problem: nothing is written then."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    print(f"checking the inputs: {model}", flush=True)
    out = check_free(out)
    n = _target_size(field, points, size)
    capacity = parse_size(gpu) if isinstance(gpu, str) else int(gpu)
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise PortError(f"--gpus {gpus} over --nodes {nodes}: give a GPU count that the nodes share equally.")
    if domain is not None and (domain < 1 or gpus % domain):
        raise PortError(f"--domain {domain} does not divide --gpus {gpus}: give a divisor of {gpus}.")
    case, source = specs.resolve(model, inputs or {}, shard or {}, sizes)
    specs.built(case, case.sizes(ranks)[0])  # a factory that raises says so here
    spec = specs.describe(case, ranks) | {"source": source}
    target = steps.Target(n, gpus, capacity, nodes, "slab" if zarr else "scatter", dtype)
    model_py = specs.model_source(case, case.sizes(ranks)[0])
    planner, unplanned = None, None
    try:
        planner = steps.planner_for(case, spec, target, min(ranks, 2))
    except PortError as error:
        unplanned = str(error)
    if planner is not None and not hasattr(planner, "calibration"):  # the meta replay: cheap, before any rank
        t = time.perf_counter()
        try:
            steps.choose(planner, steps.candidates(planner, target, bool(spec["spatial"])), target)
        except PortError:
            raise  # fits on no layout: said before any rank starts
        except ValueError as error:  # the planner's refusal (an FFT along the split dim): the audit says more first
            planner, unplanned = None, f"the planner cannot plan {case.name}: {str(error).splitlines()[0][:300]}"
        times["plan (meta replay, before the ranks)"] = time.perf_counter() - t
    split = ", ".join(f"{k} {v['shape']} split on dim {v['shard']}" if v["shard"] is not None else f"{k} {v['shape']}"
                      for k, v in spec["inputs"].items())
    print(f"      {case.name}: {split}; target N = {n:,} on {gpus} GPU(s) of {capacity / GiB:.1f} GiB, {nodes} "
          f"node(s); written to {out}", flush=True)
    times["inputs"] = time.perf_counter() - t0 - sum(times.values())

    t = _step(1, "audit", f"the model on {ranks} CPU ranks, float64, size {spec['sizes'][0]} (findings, what to do)")
    row = steps.on_ranks(spec, ranks, timeout_s)
    shown, stop = steps.audit_lines(row, spec)
    _done(t, times, "audit and parity on the ranks", shown or ["clean: no op gathered, no silent gather"])
    if stop:
        raise PortError("the audit stopped the port: " + " | ".join(stop))

    _step(2, "parity", f"against one process, output and every gradient within {specs_tolerance()} (float64)")
    lines, held = steps.parity_lines(row)
    for line in lines:
        print(f"      {line}", flush=True)
    if not held and not skip_parity_gate:
        raise PortError("parity failed, so no run is written: fix the model or the case (docs/port.md, 'parity'); "
                        "--skip-parity-gate writes it anyway, marked as failing parity.")

    t = _step(3, "plan", f"N = {n:,} on {gpus} GPU(s), each layout ({target.loading} loading, {dtype})")
    rows = []
    if planner is not None:
        try:
            rows = steps.candidates(planner, target, bool(spec["spatial"]))
        except (ValueError, RuntimeError) as error:
            unplanned = f"the planner cannot plan {case.name} yet: {str(error).splitlines()[0][:300]}"
    caveat = getattr(planner, "handlers_note", "") if rows else ""  # what the plan leaves out, if anything
    _done(t, times, "plan", [*map(steps.layout_line, rows), *([caveat] if caveat else [])] if rows else [unplanned])

    t = _step(4, "choice", "the smallest domain that fits")
    if rows:
        chosen = steps.choose(planner, rows, target)
        if domain is not None and domain != chosen["domain"]:
            asked = [r for r in rows if r["domain"] == domain]
            if not asked:
                raise PortError(f"--domain {domain} is not a layout of {gpus} GPUs that splits N = {n}: the smallest "
                                f"that fits is {chosen['domain']}.")
            if not asked[-1]["fits"]:
                raise PortError(f"--domain {domain} does not fit ({steps.layout_line(asked[-1])}): the smallest that "
                                f"fits is {chosen['domain']}.")
            verdict = steps.verdict(planner, planner.plan(domain=domain, ddp=gpus // domain,
                                                          wrapper=asked[-1]["wrapper"]), capacity).text
            chosen = asked[-1] | {"verdict": f"as asked (--domain): {verdict}"}
        reason = chosen["verdict"]
    elif domain is not None:
        if gpus % domain:
            raise PortError(f"--domain {domain} does not divide --gpus {gpus}: give a divisor.")
        chosen = {"ddp": gpus // domain, "domain": domain, "wrapper": "fsdp2" if spec["spatial"] else "ddp"}
        reason = f"not planned: {unplanned}; the layout as given (--domain {domain})"
    else:
        raise PortError(f"{unplanned}. Choose the layout yourself with --domain D (the run is then written unplanned).")
    _done(t, times, "choice", [f"ddp {chosen['ddp']} x domain {chosen['domain']}, {chosen['wrapper']}: {reason}"])

    t = _step(5, "write", str(out))
    config = {
        "model": case.name, "settings": case.settings, "inputs": spec["inputs"], "target": spec["target"],
        "one_dict": spec["one_dict"], "spatial": spec["spatial"], "wrapper": chosen["wrapper"], "size": n,
        "domain": chosen["domain"], "gpus": gpus, "nodes": nodes, "dtype": dtype, "lr": 1e-3, "seed": 0,
        "global_batch": global_batch or chosen["ddp"], "steps": steps_,
        "samples": max(64, 4 * (global_batch or chosen["ddp"])), "zarr": zarr,
        # The sizes the case checks at each domain size a user may run test_parity.py at (the chosen one, each
        # divisor of the GPUs, README's 4 ranks): the written run cannot ask the case (a U-Net's pooling wants
        # rows a domain of 4 splits evenly, not 16·4 + 1).
        "parity_sizes": {str(d): [int(s) for s in case.sizes(d)] for d in sorted(
            {row.get("domain", ranks), chosen["domain"], 4, *(d for d in range(1, gpus + 1) if gpus % d == 0)})},
        "port": {"command": command or f"sl.port.port({model!r}, ...)", "audit": shown, "parity": lines,
                 "parity_held": held, "plan": reason + (f". {caveat}" if caveat else ""), "layouts": rows}}
    files = write_run(out, config, model_py)
    _done(t, times, "write", [f"{out}/: {', '.join(files)}", f"check it: cd {out} && torchrun --nproc-per-node "
                              f"{ranks} test_parity.py"])
    return {"out": str(out), "files": files, "config": config, "row": row, "times": times}


def specs_tolerance() -> str:
    from ..parity import TOLERANCE

    return f"{TOLERANCE:.0e}"


def _pairs(values, sep: str, what: str) -> dict:
    found = {}
    for text in values or []:
        key, _, value = text.partition(sep)
        if not key or not value:
            raise PortError(f"{what} {text!r}: write it as NAME{sep}VALUE.")
        found[key] = value
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardlab.port", description="From a model to a domain-parallel run that passes parity: "
        "audit and parity on CPU ranks, the plan at the target, the smallest layout that fits, the run written.")
    parser.add_argument("model", help="a model of docs/models.md (Transolver, U-Net...), package.module:factory, or "
                                      "package.module:case (an sl.parity.Case)")
    parser.add_argument("--input", action="append", metavar="NAME=SHAPE",
                        help="an input of a factory, its shape with N for the size: x=1x1xNxN, fx=1xNx3")
    parser.add_argument("--shard", action="append", metavar="NAME:DIM", help="an input split along DIM on domain")
    parser.add_argument("--sizes", type=int, nargs="+", help="sizes N of the audit and parity (small)")
    parser.add_argument("--field", help="target field, HxW with equal sides (e.g. 4096x4096)")
    parser.add_argument("--points", help="target point count (e.g. 1e6)")
    parser.add_argument("--size", type=int, help="target N")
    parser.add_argument("--gpus", type=int, required=True, help="how many GPUs")
    parser.add_argument("--gpu", required=True, help="memory of one GPU, as the planner's --gpu: 80GiB, 80GB, H100")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--domain", type=int, help="the domain size to write (checked against the plan)")
    parser.add_argument("--zarr", help="a zarr store the run reads each rank's rows from (slab loading)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks of the audit and parity")
    parser.add_argument("--steps", type=int, default=100, help="training steps of the written run")
    parser.add_argument("--global-batch", type=int, help="samples per step (default: the layout's ddp size)")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--skip-parity-gate", action="store_true",
                        help="write the run even though parity failed (it is marked so in README and run.json)")
    args = parser.parse_args(argv)
    try:
        shard = {k: int(v) for k, v in _pairs(args.shard, ":", "--shard").items()}
    except ValueError:
        print("port: --shard takes NAME:DIM with DIM a number, e.g. x:2.", file=sys.stderr)
        return 2
    try:
        result = port(args.model, out=args.out, gpus=args.gpus, gpu=args.gpu, field=args.field, points=args.points,
                      size=args.size, nodes=args.nodes, inputs=_pairs(args.input, "=", "--input"), shard=shard,
                      sizes=args.sizes, ranks=args.ranks, domain=args.domain, zarr=args.zarr, dtype=args.dtype,
                      steps_=args.steps, global_batch=args.global_batch, timeout_s=args.timeout_s,
                      skip_parity_gate=args.skip_parity_gate,
                      command="python -m shardlab.port " + shlex.join(sys.argv[1:] if argv is None else argv))
    except (PortError, ValueError) as error:
        print("port: " + " ".join(str(error).split()), file=sys.stderr, flush=True)  # one line, whatever it quotes
        return 1
    times = ", ".join(f"{k} {v:.1f} s" for k, v in result["times"].items())
    print(f"written: {result['out']} ({times})", flush=True)
    return 0
