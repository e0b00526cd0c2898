"""``python -m shardlab.tools.models`` (``make models``): every model of ``model_cases`` checked by ``parity`` on 2
and 4 CPU ranks, one job per model and rank count (a model that ends its process, as FNO's defaults do, takes no
other row with it), and docs/models.md written from the results. Never edit that page by hand: its stamp says which
registry, harness and versions wrote it, and tests/unit/test_parity_cases.py fails when they changed since.

    python -m shardlab.tools.models                    # the whole table (about 10 minutes on 2 cores)
    python -m shardlab.tools.models --only Transolver --out /tmp/models.md
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path

from .. import model_cases, parity, workarounds
from ..measure import audit
from ..ranks.launch import JobFailed, run_job

RANKS = (2, 4)
STAMPED = (parity, model_cases, audit, workarounds, sys.modules[__name__])
PACKAGES = ("torch", "nvidia-physicsnemo")
STAMP_LINE = re.compile(r"^<!-- stamp: (\w+) -->$", re.M)


def stamp() -> str:
    """What wrote the table: the sources of the harness, the registry and this command, and the package versions."""
    digest = hashlib.sha256()
    for module in STAMPED:
        digest.update(Path(module.__file__).read_bytes())
    for package in PACKAGES:
        digest.update(f"{package}=={version(package)}".encode())
    return digest.hexdigest()[:16]


def short(error: str) -> str:
    """``Type at file:line (function): message`` with the message's first sentence only."""
    where, _, message = error.partition("): ")
    first = re.split(r"(?<=[.!?])\s", message.strip(), maxsplit=1)[0] if message else ""
    return f"{where}){': ' + first[:240] if first else ''}" if message else error[:300]


def _failure(stderr: str, step: str | None = None, returncode: int | None = None) -> str:
    """A job whose process ended: in which step rank 0 was, the C++ abort's ``what():`` (or the last error line), and
    what each rank had raised before (a rank that raised where the others did not leaves them in different
    collectives)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    what = [line.split("what():", 1)[1].strip() for line in lines if "what():" in line]
    errors = what or [line for line in lines if re.search(r"Error|abort|terminate", line)] or ["no error line"]
    said = dict.fromkeys(line[line.index(parity.RANK_SAYS) + len(parity.RANK_SAYS):] for line in lines
                         if parity.RANK_SAYS in line)
    ended = f"the process ended (exit code {returncode})" if returncode is not None else "the job failed"
    before = f"; before it, rank {'; rank '.join(said)}" if said else ""
    return (f"{ended}{' in ' + step if step else ''}: "
            f"{re.sub(r'/__w/pytorch/pytorch/|enforce fail at ', '', errors[-1])[:300]}{before}")


def check(case_name: str, ranks: int, timeout_s: float) -> dict:
    ref = model_cases.ref(next(case for case in model_cases.CASES + model_cases.SPATIAL if case.name == case_name))
    t0 = time.perf_counter()
    try:
        job = run_job("torchrun", ranks, "shardlab.parity", [ref], timeout_s=timeout_s, check=False)
        row = job.result[-1]
        if job.returncode:
            row = {key: row[key] for key in ("case", "ranks", "device", "strategy", "spatial") if key in row} | {
                "job": _failure(job.stderr, row.get("stopped in"), job.returncode)}
    except (JobFailed, TimeoutError) as error:
        row = {"case": case_name, "ranks": ranks, "job": _failure(str(error))}
    return row | {"seconds": round(time.perf_counter() - t0, 1)}


def _bytes(n) -> str:
    return f"{n / 2**20:.2f} MiB" if isinstance(n, int) else str(n)


def _parity_cell(row: dict) -> str:
    if "job" in row:
        return row["job"]
    if row.get("problems"):
        return "; ".join(row["problems"])
    cells, failed = [], {}
    for run in row["parity"]:
        if "error" in run:
            failed.setdefault(short(run["error"]), []).append(str(run["size"]))
        else:
            verdict = "" if max(run["output"], run["gradient"]) <= parity.TOLERANCE else " **over 1e-10**"
            cells.append(f"{run['split']} ({run['size']}): output {run['output']:.1e}, gradient {run['gradient']:.1e}"
                         f" ({run['worst parameter']}){verdict}")
    cells += [f"{', '.join(sizes)}: {error}" for error, sizes in failed.items()]
    return "<br>".join(cells)


def _audit_cell(row: dict) -> tuple[str, str]:
    audit = row.get("audit")
    if not audit:
        return "", ""
    if "findings" not in audit:
        failed = [short(run["error"]) for run in row["parity"] if "error" in run]
        said = short(audit["error"])
        return f"did not run: {'the forward raised, as in parity' if said in failed else said}", ""
    found = audit["unpatched"] + [f for f in audit["findings"] if "has no ShardTensor handler" not in f
                                  and not f.startswith("the backward raised")]
    found += [f"the backward raised {short(audit['error'])}"] if audit["error"] else []
    sent = f"{audit['bytes']['forward']:,} B + {audit['bytes']['backward']:,} B"
    return ("<br>".join(found) or "clean"), sent


def _spatial_cell(row: dict) -> str:
    cells = []
    for name, each in row.get("spatial", {}).items():
        held = f"{each['values'] * 8:,} B in float64"
        how = (f"Shard({each['dim']}) on domain (fsdp_spatial)" if each["split"] else
               f"replicated: every rank holds all {held}; split it: spatial={{{name.rsplit('.', 1)[-1]!r}: "
               f"{each['dim']}}}, strategy fsdp_spatial")
        cells.append(f"{name} follows dim {each['dim']} ({held} whole): {how}")
    return "<br>".join(cells) or "none"


def table(rows: list[dict]) -> str:
    lines = ["| model | ranks | strategy | parity, relative (split, size: output, worst gradient) | audit findings "
             "| spatial parameters | collectives per step per rank (forward + backward) "
             "| peak per rank (size: bytes) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        findings, sent = _audit_cell(row)
        memory = "<br>".join(f"{size}: {_bytes(peak)}" for size, peak in row.get("memory", {}).items())
        spatial = _spatial_cell(row)
        where = f" ({row['device']})" if "device" in row else ""
        lines.append(f"| {row['case']} | {row['ranks']}{where} | {row.get('strategy', '')} | {_parity_cell(row)} "
                     f"| {findings} | {spatial} | {sent} | {memory} |".replace("\n", " "))
    return "\n".join(lines)


HEADER = """# PhysicsNeMo's domain-parallel models, run here

Written by `make models` (`python -m shardlab.tools.models`): never by hand. Each model of
`helpers/shardlab/model_cases.py` is checked by `helpers/shardlab/parity.py` on ranks (float64), one job per
model and rank count, the domain axis every rank; each row names the device its ranks ran on (`run_job` places them).
**CPU ranks rehearse the program; GPUs prove it**: a cpu row is no GPU figure.

- **parity**: the model on the ranks (inputs scattered as ShardTensors on `domain`) against one process on the whole
  input, same seed; relative error, max |difference| / max |reference|, of the output and of every parameter's
  gradient (the worst named), for each size (an *uneven* split: the domain size does not divide it). A gradient below
  a ten-thousandth of the model's largest is zero in exact arithmetic and measured against that share. Bound: 1e-10.
- **audit findings**: `sl.measure.audit.audit_model` on the distributed model: each op ShardTensor has no handler for
  (and how to register one), each silent gather, each plain tensor every rank holds whole along the split dim (a
  positional table left replicated, named with how to shard it; an activation built whole), a backward that raised (file
  and line of the installed package).
- **spatial parameters**: each parameter or buffer whose shape follows the field (the model built at two sizes: the
  dim that changed), its bytes, and whether the strategy splits it on `domain` or leaves it whole on every rank.
- **collectives**: the bytes this rank handed to collectives in one forward and backward, as the audit counts them
  (ShardTensor's and DTensor's; the ddp axis has one rank here, so DDP's gradient all-reduce adds nothing).
- **peak**: `measure.AllocatorPeak` over one forward and backward on each rank, parameters and input shards counted
  (the whole input each rank builds before `scatter_tensor` is not), the largest rank; at two sizes.
- A model that cannot run keeps its row, with where it stopped.
"""


SPATIAL = """## Spatial parameters, measured: DiT's positional table

DiT adds a learned table, `pos_embed` (1, tokens, C), to its tokens (`tokens = ... + self.pos_embed`,
physicsnemo/nn/module/dit_layers.py:1115): its length follows the field. The field is split along H, so each rank's
rows of patches are a run of tokens. Two layouts of the same tokenizer (the part of DiT that holds the table; its
attention runs only on GPUs here), the same inputs and checks as the table above:

- **replicated**: a plain parameter. The sum is right: ShardTensor promotes the table to `Replicate` and adds this
  rank's rows of it. But every rank holds the whole table, and its gradient is all-reduced whole; the audit names it.
- **sharded**: a DTensor `Shard(1)` on `domain`, the rest `fully_shard` on `ddp`, as PhysicsNeMo's DiT test and
  StormCast recipe lay it out: each rank holds its rows.
- **a model that slices the table by the local shape** (`table[:, :tokens]` with a rank's own token count, as code
  written for one process does when it runs on a rank's block): every rank reads the first rows, and only rank 0's
  are its own. The last column says which rows each rank reads and which it should, from each rank's split.
"""


def _spatial_rows(rows: list[dict]) -> str:
    lines = ["| layout | ranks | table bytes on each rank (whole) | parity (output, worst gradient) | audit findings "
             "| collectives per step per rank (forward + backward) | peak per rank | rows read if sliced by the local "
             "shape (should read) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        findings, sent = _audit_cell(row)
        held = row.get("audit", {}).get("held", {})
        whole = {name: each["values"] * 8 for name, each in row.get("spatial", {}).items()}
        length = max((each["length"] for each in row.get("spatial", {}).values()), default=0)
        tokens = [len(part) for part in torch_split(length, row["ranks"])]  # each rank's run of the table's rows
        starts = [sum(tokens[:r]) for r in range(len(tokens))]
        split = any(each["split"] for each in row.get("spatial", {}).values())
        read = ("each rank holds its own rows: " if split else "") + "; ".join(
            f"rank {r}: {s}..{s + n}" if split else f"rank {r}: 0..{n} ({s}..{s + n})"
            for r, (n, s) in enumerate(zip(tokens, starts)))
        memory = "<br>".join(f"{size}: {_bytes(peak)}" for size, peak in row.get("memory", {}).items())
        lines.append(f"| {row['case']} | {row['ranks']} | "
                     f"{'; '.join(f'{n}: {b:,} B ({whole[n]:,} B)' for n, b in held.items())} | {_parity_cell(row)} "
                     f"| {findings} | {sent} | {memory} | {read} |")
    return "\n".join(lines)


def torch_split(length: int, parts: int) -> list[range]:
    """``torch.tensor_split``'s parts of ``range(length)``: DTensor's and scatter_tensor's chunks."""
    import torch

    return [range(int(p[0]), int(p[-1]) + 1) if len(p) else range(0) for p in torch.arange(length).tensor_split(parts)]


def page(rows: list[dict]) -> str:
    settings = "\n".join(f"- **{case.name}**: {case.settings}." for case in model_cases.CASES + model_cases.SPATIAL)
    versions = ", ".join(f"{package} {version(package)}" for package in PACKAGES)
    spatial = {case.name for case in model_cases.SPATIAL}
    return (f"{HEADER}\n{table([r for r in rows if r['case'] not in spatial])}\n\n{SPATIAL}\n"
            f"{_spatial_rows([r for r in rows if r['case'] in spatial])}\n\n"
            "## Settings (what differs from each model's defaults, and why)\n\n"
            f"{settings}\n\nVersions: {versions}.\n\n<!-- stamp: {stamp()} -->\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/models.md")
    parser.add_argument("--only", action="append", help="a model's name (repeatable); default: every model")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args(argv)
    names = args.only or [case.name for case in model_cases.CASES + model_cases.SPATIAL]
    rows = []
    for name in names:
        for ranks in args.ranks:
            rows.append(check(name, ranks, args.timeout_s))
            print(f"{name} on {ranks} ranks: {rows[-1]['seconds']} s", flush=True)
    Path(args.out).write_text(page(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
