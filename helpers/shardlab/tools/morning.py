"""The machine check for the morning of a workshop: ``python -m shardlab.tools.morning`` (``make morning``).

A few minutes instead of ``make test``'s twenty and more: the environment, notebooks 00 and 02 on ranks of their own,
and ``make gpu-check``'s quick rows where there are GPUs; ``ready`` (exit 0) or what to fix (exit 1). Its steps and
limits: docs/operations.md#the-morning-check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from traitlets.config import Config

from ..ranks import owned, subprocesses

CHECKOUT = Path(__file__).resolve().parents[3]  # helpers/shardlab/tools/morning.py in a checkout of the repository
KERNEL = "shardlab"
IMPORTS = ("torch", "physicsnemo", "ipyparallel", "shardlab")
NOTEBOOKS = ("00_setup", "02_device_mesh")
HANDOUT = Path("build", "handout")  # the Makefile's HANDOUT_DIR: a learner's kit has the notebooks only there
# The widgets front end a JupyterLab needs for ipywidgets 8 (the lock's): jupyterlab_widgets 3's extension, v5.
WIDGETS, WIDGETS_MAJOR = r"@jupyter-widgets/jupyterlab-manager v(\d+)\.\S* +enabled +OK", 5
# Seconds each step may take, and the whole check (``--deadline-s``): on the 2-core CPU machine the check took 104 s
# with other work on its cores, 189 s beside a full test run; a notebook's includes its kernel's start and stop.
LIMITS_S = {"imports": 120, "00_setup": 150, "02_device_mesh": 210, "gpu": 240}
DEADLINE_S = 300
KERNEL_START_S = 60
# CurveZMQ between a notebook client and its kernel, as `make lab` has it: no warning about TCP. Configuration, not a
# kernel manager of ours: nbclient shuts down only a kernel whose manager it made itself.
CURVE_KERNELS = Config({"KernelManager": {"transport_encryption": "auto"}})
# A notebook client's waits on the kernel's channels, in slices of this many seconds (see poll_in_slices).
POLL_SLICE_S = 1.0
MIN_STEP_S = 20  # a step given less than this is not started
GPU_ROWS = {"smoke": 120, "tf32-error": 120}  # gpu-check's quick rows, and the budget each gets here
OK, SKIPPED, FAILED = "ok", "skipped", "FAILED"
THOROUGH = "`make test` (20+ minutes) runs every test; `make gpu-check` every GPU row on a GPU node."


@dataclass
class Result:
    """What one step found: its status, one line of detail, and for a failed step what to do about each problem."""

    step: str
    status: str
    detail: str
    fixes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def verdict(results: list[Result]) -> tuple[str, int]:
    """The last words and exit code: "ready" (0) when no step failed (skipped ones say why), else what to fix (1)."""
    failed = [r for r in results if r.status == FAILED]
    notes = [f"note: {r.step} skipped: {r.detail}" for r in results if r.status == SKIPPED]
    if not failed:
        return "\n".join([*notes, "ready"]), 0
    fixes = [f"- {r.step}: {fix}" for r in failed for fix in (r.fixes or [f"{r.detail}. {THOROUGH}"])]
    return "\n".join([*notes, f"NOT READY: {len(fixes)} thing(s) to fix:", *fixes]), 1


# --- step 1: the environment -------------------------------------------------------------------------------------


def _lock_files() -> list[Path]:
    lock = "container/requirements.txt" if os.environ.get("SHARDLAB_CONTAINER") == "1" else "requirements.txt"
    made_from = (CHECKOUT / lock, CHECKOUT / "helpers" / "pyproject.toml", CHECKOUT / "lab-config" / "overrides.json")
    return [p for p in made_from if p.is_file()]  # what the Makefile's stamp depends on


def environment_problems(prefix: Path, base_prefix: Path, version: tuple[int, int], kernel_argv0: str | None,
                         lock_files: list[Path]) -> list[str]:
    """Problems of the environment as "what: what to do" lines (none: fine). ``kernel_argv0``: the program the
    ``shardlab`` kernel spec starts, None when Jupyter finds no such spec."""
    container = os.environ.get("SHARDLAB_CONTAINER") == "1"
    if prefix == base_prefix:
        return [f"this Python ({sys.executable}) is not a venv's: run the check as `make morning`, which uses .venv "
                "(`make env` creates it; learners' `make lab` does too)"]
    problems = []
    if version != (3, 11) and not (container and version >= (3, 11)):
        problems.append(f"{prefix.name} runs Python {version[0]}.{version[1]}, and the lock is for 3.11: "
                        "`make clean-env` then `make env PYTHON=python3.11`")
    stamp = prefix / ".installed"
    if not stamp.exists():
        problems.append(f"{prefix.name} was not installed to the end (no {stamp.name} stamp): `make env` makes it "
                        "again")
    elif stale := [p.name for p in lock_files if p.stat().st_mtime > stamp.stat().st_mtime]:
        problems.append(f"{' and '.join(stale)} changed since {prefix.name} was installed: `make env` updates it")
    if kernel_argv0 is None:
        problems.append(f"Jupyter finds no '{KERNEL}' kernel spec: `{prefix.name}/bin/python -m ipykernel install "
                        f"--sys-prefix --name {KERNEL}` puts it back into {prefix.name} (`make kernel-user`: for "
                        "JupyterHub)")
    elif Path(os.path.abspath(kernel_argv0)).parent.parent.resolve() != prefix.resolve():  # one venv, by any link
        problems.append(f"the '{KERNEL}' kernel spec starts {kernel_argv0}, not this environment's Python: `make "
                        "kernel-user` points it here (`jupyter kernelspec list` shows the other one)")
    return problems


def lesson_folder(checkout: Path = CHECKOUT) -> Path:
    """The notebooks: the instructor copy, else a learner's kit's handout (`make learner-kit`)."""
    return checkout / "notebooks" if (checkout / "notebooks" / "00_setup.ipynb").is_file() else checkout / HANDOUT


def widgets_problems(lab_python: str | None = None, timeout_s: float = 60) -> list[str]:
    """What to fix (none: fine) in the widgets front end of a hub's JupyterLab (``lab_python``), or `make lab`'s."""
    python, where = lab_python or sys.executable, f"the JupyterLab of {lab_python}" if lab_python else "`make lab`'s"
    env = {k: v for k, v in os.environ.items() if not (lab_python and k.startswith("JUPYTER"))}
    try:
        listed = subprocess.run([python, "-m", "jupyterlab.labextensions", "list"], capture_output=True, text=True,
                                timeout=timeout_s, env=env)
        said = re.sub(r"\x1b\[[0-9;]*m", "", listed.stdout + listed.stderr)
    except (OSError, subprocess.TimeoutExpired) as error:
        said = str(error)
    if (found := re.search(WIDGETS, said)) and int(found.group(1)) == WIDGETS_MAJOR:
        return []
    return [f"{where} has no widgets front end for ipywidgets 8 ({' '.join(said.split())[-300:]}): `{python} -m pip "
            "install 'jupyterlab_widgets>=3,<4'` and restart it (LAB_PYTHON: the Python the hub's JupyterLab runs)"]


def kernel_argv0() -> str | None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        return KernelSpecManager().get_kernel_spec(KERNEL).argv[0]
    except NoSuchKernel:
        return None


def check_environment(limit_s: float = LIMITS_S["imports"], lab_python: str | None = None) -> Result:
    prefix, base = Path(sys.prefix), Path(sys.base_prefix)
    problems = environment_problems(prefix, base, sys.version_info[:2], kernel_argv0(), _lock_files())
    problems += widgets_problems(lab_python)
    if prefix != base:  # the imports, in a process of their own: an import that hangs is stopped and named
        found = child(["imports"], limit_s, f"importing {', '.join(IMPORTS)}")
        problems += found.fixes if found.status == FAILED else []
        detail = found.detail
    else:
        detail = "not a venv"
    if problems:
        return Result("environment", FAILED, "; ".join(p.split(":")[0] for p in problems), problems)
    return Result("environment", OK, f"{prefix.name}, Python {sys.version.split()[0]}, {detail}, {KERNEL}, widgets")


def step_imports() -> Result:
    import importlib

    versions = []
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # any import error is what this step reports
            return Result("imports", FAILED, f"import {name} failed", [
                f"import {name} fails ({type(error).__name__}: {str(error)[:200]}): `make clean-env` then `make env` "
                "installs the lock again"])
        versions.append(f"{name} {getattr(module, '__version__', '')}".strip())
    return Result("imports", OK, ", ".join(versions))


# --- step 2: the notebooks -----------------------------------------------------------------------------------------


def poll_in_slices(client) -> None:
    """Make ``client`` (an nbclient NotebookClient whose kernel is set up) wait on its shell and IOPub channels in
    slices of ``POLL_SLICE_S``. Why: one long zmq.asyncio poll can sleep through a message that has arrived, and find
    it only in the ``poll(0)`` at its timeout (pyzmq's ``_AsyncPoller.poll``; pyzmq #2173): a cell of notebook 09 that
    takes seconds once waited nbclient's whole 300 s for its reply, then passed. In slices, that costs one slice."""
    from queue import Empty

    def sliced(channel):
        get_msg = channel.get_msg

        async def get_msg_in_slices(timeout=None):
            ends = None if timeout is None else time.monotonic() + timeout
            while True:
                left = POLL_SLICE_S if ends is None else max(0.0, min(POLL_SLICE_S, ends - time.monotonic()))
                try:
                    return await get_msg(timeout=left)
                except Empty:
                    if ends is not None and time.monotonic() >= ends:
                        raise

        channel.get_msg = get_msg_in_slices

    sliced(client.kc.shell_channel)
    sliced(client.kc.iopub_channel)


def step_notebook(path: Path, limit_s: float) -> Result:
    """Run one notebook top to bottom as tests/notebooks/test_notebooks.py does, in a temp folder of its own, without
    the learner's warm pool; a cell still running when ``limit_s`` is spent (less a margin) is stopped and named."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    from ..ranks.warm import POOL

    nb = nbformat.read(path, as_version=4)
    ends = time.monotonic() + limit_s - 20  # the last 20 s: for the kernel's stop and the report
    client = NotebookClient(nb, timeout=int(limit_s), startup_timeout=min(KERNEL_START_S, int(limit_s) // 2),
                            kernel_name=KERNEL, config=CURVE_KERNELS,
                            resources={"metadata": {"path": str(path.parent)}})
    see = f"open {path.parent.name}/{path.name} in `make lab` and run it to see the whole error"
    index = None
    with tempfile.TemporaryDirectory(prefix=f"morning-{path.stem}-", ignore_cleanup_errors=True) as temp_folder:
        env = {k: v for k, v in os.environ.items() if k != POOL} | {"TMPDIR": temp_folder}
        env |= {"SHARDLAB_CHECKS": "report"} if path.parent.name == HANDOUT.name else {}  # as its `make lab` has it
        try:
            with client.setup_kernel(env=env):
                poll_in_slices(client)
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        client.timeout = max(int(ends - time.monotonic()), 1)  # what is left of the notebook's time
                        client.execute_cell(cell, index)
        except CellTimeoutError:
            return Result(path.stem, FAILED, f"cell {index} still running when {limit_s:.0f} s were spent", [
                f"cell {index} of {path.name} did not finish within the notebook's {limit_s:.0f} s: a rank that never "
                f"started or a collective that hangs; {see} (INSTRUCTORS.md, 'A hung cell mid-workshop')"])
        except CellExecutionError as error:
            return Result(path.stem, FAILED, f"cell {index} raised {error.ename}", [
                f"cell {index} of {path.name} raised {error.ename}: {' '.join(str(error.evalue).split())[:300]}; "
                f"{see}"])
        except DeadKernelError:
            return Result(path.stem, FAILED, f"the kernel died in cell {index}", [
                f"the kernel running {path.name} died in cell {index} (out of memory?): {see}"])
        except Exception as error:  # the kernel did not start, or anything else: reported
            return Result(path.stem, FAILED, f"{type(error).__name__} before the cells ran", [
                f"{path.name}: {type(error).__name__}: {str(error)[:300]} (the '{KERNEL}' kernel did not start "
                f"within {KERNEL_START_S} s?); {see}"])
    cells = sum(c.cell_type == "code" for c in nb.cells)
    return Result(path.stem, OK, f"{cells} code cells ran")


# --- step 3: GPUs --------------------------------------------------------------------------------------------------


def step_gpu() -> Result:
    from ..ranks.devices import unusable_gpus, visible_gpus
    from . import gpucheck

    gpus = visible_gpus()
    if problem := unusable_gpus(gpus):
        return Result("gpu", FAILED, "GPUs CUDA cannot use", [f"{problem}; `make gpu-check` says the same"])
    if gpus == 0:
        return Result("gpu", SKIPPED, "no GPU visible here (CUDA counts none): the notebooks run on "
                                      "CPU ranks; on a GPU node this step runs gpu-check's quick rows")
    rows = [row | {"budget_s": GPU_ROWS[row["name"]]} for row in gpucheck.plan(gpus)
            if row["name"] in GPU_ROWS and row["runs"]]
    results, fixes = [], []
    for row in rows:
        try:
            said, ok = gpucheck.run_row(row, gpus)
        except Exception as error:  # a row that breaks is a failed row
            said, ok = f"{type(error).__name__}: {str(error)[-300:]}", False
        results.append(f"{row['name']} {'passed' if ok else 'FAILED'}")
        if not ok:
            fixes.append(f"gpu-check's {row['name']} row failed: {said[:300]}; `make gpu-check` runs every row")
    detail = f"{gpus} GPU(s): " + ", ".join(results)
    return Result("gpu", FAILED, detail, fixes) if fixes else Result("gpu", OK, detail)


# --- running the steps ---------------------------------------------------------------------------------------------


def child(args: list[str], limit_s: float, what: str) -> Result:
    """Run ``python -m shardlab.tools.morning --step ARGS`` in a process group of its own, at most ``limit_s`` seconds
    (then it and all it started are stopped, and the Result names ``what`` it waited for): the Result it wrote. Its
    output goes to a file, never to a pipe, which a rank that outlived it would hold open."""
    step = args[1] if args[0] == "notebook" else args[0]
    own = f"{owned.origin()}/{step}-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="shardlab-morning-", ignore_cleanup_errors=True) as folder:
        cmd = [sys.executable, "-m", "shardlab.tools.morning", "--step", *args, "--out", folder]
        try:
            proc = subprocesses.run_process_group(cmd, os.environ | {owned.ORIGIN: own}, limit_s, what, capture=False,
                                           grace_s=10)
        except TimeoutError:
            return Result(step, FAILED, f"still {what} after {limit_s:.0f} s", [
                f"{what} did not finish within {limit_s:.0f} s, so it was stopped: run it alone "
                f"(`python -m shardlab.tools.morning --step {' '.join(args)}`) to see where it waits"])
        finally:
            owned.stop(owned.leftover_processes(own))
        try:
            return Result(**json.loads((Path(folder) / "result.json").read_text()))
        except (OSError, ValueError, TypeError):
            log = Path(folder) / "log"
            tail = ((log.read_text(errors="replace").strip().splitlines() if log.exists() else []) or ["(no output)"])
            return Result(step, FAILED, f"{what} exited with {proc.returncode}", [
                f"{what} exited with {proc.returncode} and no result: {tail[-1][:300]}"])


def steps(lab_python: str | None = None) -> list[tuple[str, float, object]]:
    """(name, time limit, how to run it within a given limit) of every step, in order."""
    folder = lesson_folder()
    runs = [("environment", LIMITS_S["imports"], lambda limit_s: check_environment(limit_s, lab_python))]
    for name in NOTEBOOKS:
        runs.append((f"notebook {name}", LIMITS_S[name],
                     lambda limit_s, name=name: child(["notebook", str(folder / f"{name}.ipynb"), f"{limit_s:.0f}"],
                                                      limit_s, f"running {folder.relative_to(CHECKOUT)}/{name}.ipynb")))
    runs.append(("GPUs", LIMITS_S["gpu"], lambda limit_s: child(["gpu"], limit_s, "running gpu-check's quick rows")))
    return runs


def run_steps(runs, deadline_s: float = DEADLINE_S, out=print) -> list[Result]:
    """Run every step within its own limit and all within ``deadline_s``, printing each as it starts and ends. A step
    that raises fails; one that no longer fits before the deadline is not run, and fails."""
    results, ends = [], time.monotonic() + deadline_s
    for i, (name, limit_s, run) in enumerate(runs, 1):
        t0 = time.monotonic()
        granted = min(limit_s, ends - t0)
        if granted < MIN_STEP_S:
            result = Result(name, FAILED, f"not run: the check's {deadline_s:.0f} s were spent before it", [
                f"not run: the {deadline_s:.0f} s of the whole check were spent before it. On a busy machine give it "
                "more: `.venv/bin/python -m shardlab.tools.morning --deadline-s 600`"])
            out(f"[{i}/{len(runs)}] {name}: {result.detail}", flush=True)
            results.append(result)
            continue
        out(f"[{i}/{len(runs)}] {name} (at most {granted:.0f} s) ...", flush=True)
        try:
            result = run(granted)
        except Exception as error:  # the check reports, it does not crash
            result = Result(name, FAILED, f"{type(error).__name__}: {str(error)[:300]}")
        result.seconds = round(time.monotonic() - t0, 1)
        out(f"      {result.status} in {result.seconds:.0f} s: {result.detail}", flush=True)
        results.append(result)
    return results


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_one_step(step: list[str], out: Path | None) -> int:
    """``--step``: one step here; its Result as JSON to stdout, or (``--out``) to OUT/result.json, output to OUT/log."""
    if out is not None:
        log = open(out / "log", "w")  # open until this process exits
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    signal.signal(signal.SIGTERM, _raise_exit)  # so that the clean-up below runs when the parent stops this step
    try:
        kind = step[0]
        result = (step_notebook(Path(step[1]), float(step[2])) if kind == "notebook"
                  else step_imports() if kind == "imports" else step_gpu())
    finally:
        owned.stop(owned.leftover_processes())  # a failed notebook's kernel and ranks
    if out is not None:
        (out / "result.json").write_text(json.dumps(result.__dict__))
    print(json.dumps(result.__dict__), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlab.tools.morning", description=__doc__.splitlines()[0])
    parser.add_argument("--step", nargs="+", help="run one step in this process and print its result as JSON "
                                                  "(imports | notebook PATH LIMIT_S | gpu)")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="seconds for the whole check; a step "
                        f"that no longer fits is not run, and fails (default {DEADLINE_S})")
    parser.add_argument("--out", help="with --step: write the result and the output into this folder")
    parser.add_argument("--lab-python", help="a hub's JupyterLab's Python: its widgets front end is checked")
    args = parser.parse_args(argv)
    if args.step:
        return run_one_step(args.step, Path(args.out) if args.out else None)
    runs = steps(args.lab_python)
    print(f"# shardlab morning check, {time.strftime('%Y-%m-%d %H:%M')}: {len(runs)} steps, at most "
          f"{args.deadline_s:.0f} s")
    handler = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        with owned.own_origin("morning"):  # what the steps start: stopped at the end, and nothing else
            results = run_steps(runs, args.deadline_s)
    except KeyboardInterrupt:
        print("morning check: interrupted; the processes it started are stopped too.", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, handler)
    text, code = verdict(results)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
