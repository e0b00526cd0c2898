"""The steps of ``python -m shardlab.port`` that need more than the inputs: the audit and parity on CPU ranks (one
job, ``job.py``), the plan at the target for each candidate layout, and the choice of the smallest that fits."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..parity import HANDLERS, TOLERANCE
from ..plan import GiB, Planner, fmt_bytes, headroom, verdict
from .spec import PortError

_SYSTEM_HINT = "Read it, fix the model or the case, and port again."


def on_ranks(spec: dict, ranks: int, timeout_s: float) -> dict:
    """The audit, then parity, on ``ranks`` CPU ranks: the job's row (``job.run``)."""
    from ..ranks.launch import JobFailed, run_job

    with tempfile.TemporaryDirectory(prefix="shardlab-port-") as folder:
        path = Path(folder, "spec.json")
        path.write_text(json.dumps(spec))
        # The user's package is found where the command was started, as it is here.
        paths = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        try:
            result = run_job("torchrun", ranks, "shardlab.port.job", [str(path)], timeout_s=timeout_s,
                             env={"PYTHONPATH": paths}, check=False, show_output=True)
        except JobFailed as error:
            last = [line for line in str(error).splitlines() if line.strip()][-1:]
            raise PortError(f"the job of {ranks} ranks ended before it wrote a result: {' '.join(last)[:300]}. "
                            f"{_SYSTEM_HINT}") from None
    row = result.result
    if result.returncode and not row.get("parity"):
        row.setdefault("ended", f"the job ended with exit code {result.returncode}")
    return row


def audit_lines(row: dict, spec: dict) -> tuple[list[str], list[str]]:
    """(what the audit found, each with what to do; the problems that stop the port)."""
    audit = row.get("audit") or {}
    shown, stop = [], []
    for name, dim in spec["spatial"].items():
        shown.append(f"spatial parameter {name} follows the field along dim {dim}: split on domain as a DTensor "
                     "Shard, the rest fully_shard on ddp (spatial + FSDP2)")
    if "findings" not in audit:
        stop.append(f"the audit could not run the model on the ranks: {audit.get('error') or row.get('ended')}")
        return shown, stop
    for line in audit["unpatched"]:
        stop.append(line)
    for line in audit["findings"]:
        if "has no ShardTensor handler" in line:
            continue  # said with how to register a handler, above
        (stop if "raised" in line else shown).append(
            line + ("" if "raised" in line else " Find the op that gathered (sl.measure.audit.audit_model(...).table())"
                    f" and register a handler for it: {HANDLERS['function']}."))
    sent = audit.get("bytes", {})
    shown.append(f"collectives per step per rank: {sent.get('forward', 0):,} B forward + {sent.get('backward', 0):,} B "
                 f"backward (float64, size {spec['sizes'][0]}), {audit.get('seconds', 0):.1f} s")
    return shown, stop


def parity_lines(row: dict) -> tuple[list[str], bool]:
    """(one line per size, whether every size held within the bound)."""
    lines, held = [], bool(row.get("parity"))
    for run in row.get("parity", []):
        if "error" in run:
            lines.append(f"size {run['size']}: raised {run['error'][:300]}")
            held = False
            continue
        ok = run["output"] <= TOLERANCE and run["gradient"] <= TOLERANCE
        held &= ok
        lines.append(f"size {run['size']} ({run['split']} split): output {run['output']:.1e}, worst gradient "
                     f"{run['gradient']:.1e} ({run['worst parameter']}), {run['parameters']} parameters, "
                     f"{run['seconds']:.1f} s: {'within' if ok else 'OVER'} {TOLERANCE:.0e}")
    if not row.get("parity"):
        lines.append("not run: " + (row.get("ended") or "the audit stopped it"))
    return lines, held


@dataclass
class Target:
    size: int
    gpus: int
    capacity: int
    nodes: int = 1
    loading: str = "scatter"
    dtype: str = "float32"

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


def planner_for(case, spec: dict, target: Target, ranks: int):
    """The series' planner for this case at the target: the meta-device replay for a model of one field (fast, no
    ranks), else the planner's plan for any case (``sl.plan.Planner(case, size)``). PortError with the planner's own
    reason when it cannot plan this model."""
    from .. import model_cases
    from .spec import at

    split = [k for k, v in spec["inputs"].items() if v["shard"] is not None]
    one_field = (len(spec["inputs"]) == 1 and len(split) == 1 and not case.one_dict
                 and spec["inputs"][split[0]]["shard"] >= 2 and not spec["spatial"])
    try:
        if one_field:
            field = at(spec["inputs"][split[0]]["shape"], target.size)
            return Planner(case.model(case.sizes(1)[0]), field, target.dtype,
                           shard_dim=spec["inputs"][split[0]]["shard"], name=case.name, loading=target.loading)
        if not any(case is c for c in vars(model_cases).values()):
            raise ValueError("the planner plans a case it can load by module and name on its ranks: pass your case as "
                             "package.module:case (an sl.parity.Case defined at the top level)")
        return Planner(case, target.size, target.dtype, loading=target.loading, ranks=ranks)
    except (TypeError, ValueError, NotImplementedError) as error:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        raise PortError(f"the planner cannot plan {case.name} yet: {first[:400]}") from None


def candidates(planner, target: Target, spatial: bool) -> list[dict]:
    """Every (ddp, domain) layout of the GPUs that splits the field, smallest domain first, with its wrapper: DDP
    where the parameters are plain, spatial + FSDP2 where some follow the field, FSDP2 where DDP's full copy of the
    state does not fit. Each with the largest rank's bytes and whether it fits (headroom kept)."""
    rows = []
    for domain in (d for d in range(1, target.gpus + 1) if target.gpus % d == 0):
        if not planner.valid_domain(domain):
            continue
        ddp = target.gpus // domain
        for wrapper in (("fsdp2",) if spatial else ("ddp", "fsdp2")):
            t0 = time.perf_counter()
            try:
                need = planner.largest(ddp, domain, wrapper).total
            except RuntimeError as error:  # a split the model's own ops refuse (odd rows into a pooling)
                rows.append({"ddp": ddp, "domain": domain, "wrapper": wrapper, "need": 0, "headroom": 0, "fits": False,
                             "across nodes": domain > target.per_node, "refused": str(error).splitlines()[0][:200],
                             "seconds": time.perf_counter() - t0})
                break
            room = headroom(need, target.gpus)
            fits = need + room <= target.capacity
            rows.append({"ddp": ddp, "domain": domain, "wrapper": wrapper, "need": need, "headroom": room,
                         "fits": fits, "across nodes": domain > target.per_node, "seconds": time.perf_counter() - t0})
            if fits:
                break  # FSDP2 only where DDP does not fit: plain parameters stay DDP's
    return rows


def choose(planner, rows: list[dict], target: Target) -> dict:
    """The smallest domain that fits, preferring a domain group inside one node; its verdict says why. PortError
    when none fits, with the smallest that would."""
    fitting = [r for r in rows if r["fits"]]
    inside = [r for r in fitting if not r["across nodes"]]
    if fitting:
        chosen = dict((inside or fitting)[0])
        result = planner.plan(chosen["ddp"], chosen["domain"], chosen["wrapper"])
        chosen["verdict"] = verdict(planner, result, target.capacity).text
        return chosen
    wrapper = rows[-1]["wrapper"] if rows else "ddp"
    smallest, stopped = smallest_domain(planner, target, wrapper)
    if smallest is not None:
        raise PortError(f"the target fits on no layout of {target.gpus} GPUs of {target.capacity / GiB:.1f} GiB: the "
                        f"smallest that would is a domain of {smallest} ({wrapper}): give --gpus {smallest} or more, "
                        "or GPUs with more memory" + (", or a zarr store (--zarr, slab loading)"
                                                      if target.loading == "scatter" else "") + ".")
    raise PortError(f"the target fits on no layout: no domain size fits {target.capacity / GiB:.1f} GiB GPUs "
                    f"before {stopped}: take a smaller target or GPUs with more memory.")


def smallest_domain(planner, target: Target, wrapper: str) -> tuple[int | None, str]:
    """The fewest domain ranks (ddp 1) with which a rank fits, or None and where the search stopped: doubling, then
    bisecting. A model can refuse a domain size the planner's split allows (a pooling that needs two rows a rank):
    that ends the search, as the most the model splits into."""
    def fits(domain: int) -> bool:
        need = planner.largest(1, domain, wrapper).total
        return need + headroom(need, domain) <= target.capacity

    extent = planner.field_shape[planner.dim]
    low, high = target.gpus, None
    while high is None:
        probe = next((d for d in range(low * 2, extent + 1) if planner.valid_domain(d)), None)
        if probe is None:
            return None, f"a domain of {low}, the most its {extent} rows split into"
        try:
            if fits(probe):
                high = probe
            else:
                low = probe
        except (RuntimeError, ValueError) as error:
            return None, f"a domain of {probe}, where the model itself refuses: {str(error).splitlines()[0][:200]}"
    while high - low > 1:  # bisect: a size the model refuses counts as one that does not fit
        middle = (low + high) // 2
        try:
            ok = planner.valid_domain(middle) and fits(middle)
        except (RuntimeError, ValueError):
            ok = False
        low, high = (low, middle) if ok else (middle, high)
    return high, ""


def layout_line(row: dict) -> str:
    if "refused" in row:
        return f"ddp {row['ddp']} x domain {row['domain']}, {row['wrapper']}: the model refuses it ({row['refused']})"
    where = " (domain group across nodes)" if row["across nodes"] else ""
    return (f"ddp {row['ddp']} x domain {row['domain']}, {row['wrapper']}: {fmt_bytes(row['need'])} + "
            f"{fmt_bytes(row['headroom'])} headroom per GPU: {'fits' if row['fits'] else 'does not fit'}{where}")
