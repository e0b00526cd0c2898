"""Run a notebook of the series top to bottom, as nbmake does, and rehearse its exercises on the way.

Before each solution cell runs, the check cell after it is run against the learner's possible
answers, in the same kernel and on the same ranks: the blank handout answer (``name = ...``) must
fail with "not answered yet", and every plausible wrong answer listed in the solution cell's
metadata (``shardlab.wrong_answers``) must fail too. Then the real solution and its check run, and
the notebook goes on. One run covers the instructor copy and the handout, with no work done twice.

Every cell's wall time is kept (rehearsals included, on the cell they ran), beside the time it ran in its kernel, and
the slowest cells are printed; a notebook slower than ``SLOW_S`` also warns with them, so that a stall says where it
was, and on which side of the kernel's channels. The client waits on those channels in short slices
(``morning.poll_in_slices``), so a reply that has arrived is never waited for until the cell's timeout. A cell that
times out is interrupted, and the kernel says where it waited, and which ranks of its clusters were still busy and
where.
"""

from __future__ import annotations

import ast
import copy
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from queue import Empty

import nbformat
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from shardlab.ranks import folders, px, warm
from shardlab.tools.handout import SOLUTION_TAG, blank_source, wrong_answers
from shardlab.tools.morning import CURVE_KERNELS, poll_in_slices


@dataclass
class Rehearsal:
    """What one learner answer did to an exercise's check."""

    cell: int
    answer: str  # "blank" or the wrong answer's reason
    ename: str | None
    evalue: str


# On 4 CPU ranks sharing 2 cores, under `make test`'s two workers, the notebooks took 40-170 s, the capstone 300 s:
# a notebook past this one is slower than the series has been, and says where the time went.
SLOW_S = 240.0
SLOWEST_SHOWN = 5


class SlowNotebook(UserWarning):
    """A notebook that passed, slowly: the warning lists its slowest cells."""


@dataclass
class NotebookRun:
    path: Path
    rehearsals: list[Rehearsal] = field(default_factory=list)
    cell_seconds: dict[int, float] = field(default_factory=dict)  # by cell index, every execution of it added up
    kernel_seconds: dict[int, float] = field(default_factory=dict)  # the same, as the kernel's clock saw them
    seconds: float = 0.0  # the whole run, kernel start and shutdown included
    last_cell: int = 0  # the cell run last: the one that failed or timed out, if one did
    rerun: range | None = None  # the cells run a second time in the same kernel, if any (``rerun_span``)
    rerun_seconds: float = 0.0  # how long that second pass took
    notebook: object = None  # the notebook as run, with every cell's outputs (a rehearsed answer's are not kept)
    first_pass: object = None  # with ``rerun``: the notebook's cells as the first pass left them, before the second

    def slowest_cells(self, count: int = SLOWEST_SHOWN) -> list[str]:
        """The ``count`` slowest cells: index, seconds (and the kernel's share of them), first line."""
        cells = nbformat.read(self.path, as_version=4).cells
        ranked = sorted(self.cell_seconds.items(), key=lambda item: -item[1])[:count]
        kernel = {i: f"{s:7.1f} s" for i, s in self.kernel_seconds.items()}
        return [f"cell {i:>3} {seconds:7.1f} s (in the kernel {kernel.get(i, '      ?  ')})  "
                f"{first_line(cells[i].source)[:70]}" for i, seconds in ranked]

    def timing_report(self, outcome: str) -> str:
        outside = self.seconds - sum(self.cell_seconds.values())
        return "\n".join([f"{self.path.name} {outcome} after {self.seconds:.0f} s; slowest cells:",
                          *("  " + line for line in self.slowest_cells()),
                          f"  outside cells (kernel start, shutdown, temp folder check): {outside:.1f} s",
                          *([f"  cells {self.rerun.start}..{self.rerun.stop - 1} run again in the same kernel: "
                             f"{self.rerun_seconds:.1f} s (in the cells' times above)"] if self.rerun else [])])


def first_line(source: str) -> str:
    """A cell's first line, with the line after a cell magic: "%%px" alone would not say which cell."""
    lines = source.splitlines() or [""]
    return " ".join(lines[:2]) if lines[0].startswith("%%") else lines[0]


def _timed(client: NotebookClient, cell, index: int, run: NotebookRun) -> None:
    """Execute one cell, adding its wall time to the cell's, also when it fails or times out, and the time the
    kernel's own messages say it ran (from its execute_input to its execute_reply) when both came."""
    t0, run.last_cell = time.perf_counter(), index
    try:
        client.execute_cell(cell, index)
    finally:
        run.cell_seconds[index] = run.cell_seconds.get(index, 0.0) + time.perf_counter() - t0
        if (seconds := kernel_seconds(cell)) is not None:
            run.kernel_seconds[index] = run.kernel_seconds.get(index, 0.0) + seconds


def kernel_seconds(cell) -> float | None:
    """How long ``cell`` last ran in its kernel, by the kernel's clock (nbclient records both messages' dates)."""
    execution = cell.get("metadata", {}).get("execution", {})
    began, replied = execution.get("iopub.execute_input"), execution.get("shell.execute_reply")
    if not (began and replied):
        return None
    return (datetime.fromisoformat(replied) - datetime.fromisoformat(began)).total_seconds()


def _run(client: NotebookClient, cell, index: int, run: NotebookRun) -> tuple[str | None, str]:
    """Execute one cell; (exception name, message) if it failed, else (None, "")."""
    try:
        _timed(client, cell, index, run)
    except CellExecutionError as error:
        return error.ename, error.evalue
    return None, ""


STARTS_RANKS = ("start_cluster(", "RankCluster(")


def rerun_span(cells) -> range | None:
    """The cells a learner runs again without restarting the kernel (Run All Above from an exercise, or Run All a
    second time), less the cell that starts the ranks, so that the running cluster is reused: from the code cell after
    the first that starts ranks (else from the first code cell) to the last exercise's check, else to the last code
    cell before the cell that stops the ranks at the end. None when that leaves nothing."""
    code = [i for i, cell in enumerate(cells) if cell.cell_type == "code"]
    starts = [i for i in code if any(call in cells[i].source for call in STARTS_RANKS)]
    first = next((i for i in code if i > starts[0]), None) if starts else (code[0] if code else None)
    solutions = [i for i in code if SOLUTION_TAG in cells[i].metadata.get("tags", [])]
    if solutions:
        last = next(i for i in code if i > solutions[-1])  # the check after the last solution
    else:
        stops = [i for i in code if ".stop()" in cells[i].source]
        last = max((i for i in code if not stops or i < stops[-1]), default=None)
    return range(first, last + 1) if first is not None and last is not None and first <= last else None


def left_in_temp_folder(folder: Path) -> list[str]:
    """What a notebook run left in its temp folder besides torch.compile's kernel cache (kept on purpose) and an
    empty process registry (a record left in it is a cluster that was never stopped)."""
    left = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("torchinductor_"):
            continue
        if entry.name == folders.registry_name() and entry.is_dir():
            left += [f"{entry.name}/{record.name}" for record in entry.iterdir()]
            continue
        left.append(entry.name)
    return left


def as_in_jupyterlab() -> dict:
    """This environment without what pytest and the session's warm pool add: a kernel run with it forwards C
    libraries' stderr (ipykernel forwards file descriptor 2 only without PYTEST_CURRENT_TEST: ipykernel 7.4,
    iostream.py, OutStream), shows a long %%px cell's progress bar, and starts ranks of its own, as under `make lab`."""
    left_out = ("PYTEST_CURRENT_TEST", "SHARDLAB_TEST_WARM_POOL", warm.POOL)
    return {k: v for k, v in os.environ.items() if k not in left_out}


def run_notebook(path: Path, timeout_s: float = 300, rehearse: bool = True, env: dict | None = None,
                 slow_s: float = SLOW_S, rerun: bool = False) -> NotebookRun:
    """Execute every cell of ``path`` (a failing cell raises CellExecutionError, as under nbmake) and
    return what each rehearsed answer did to its check. The kernel, and all it starts, get a temp folder of
    their own; a run that leaves files in it fails. The kernel gets the session's pool of warm clusters
    (conftest.py): its ``sl.start_cluster()`` attaches to the ranks the previous notebook parked, reset.
    Every run prints its slowest cells (pytest shows them for a failure, a cell's ``timeout_s`` included, or with
    ``-rP``); a run slower than ``slow_s`` also warns with them (``SlowNotebook``, in pytest's warnings summary).
    ``rerun``: once the first pass has run the last cell of ``rerun_span``, those cells run again in the same kernel
    on the same ranks (as a learner's Run All Above does), then the rest of the notebook."""
    nb = nbformat.read(path, as_version=4)
    # CurveZMQ between this process and the kernel, as `make lab` has it: the kernel then prints no warning about TCP.
    # As configuration, not a kernel manager of ours: the client then owns its manager and shuts the kernel down.
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="shardlab", config=CURVE_KERNELS,
                            resources={"metadata": {"path": str(path.parent)}})
    run = NotebookRun(path, notebook=nb)
    env = os.environ if env is None else env
    # A %%px cell stuck on some rank fails naming the rank, before this client's own cell timeout cuts it blind.
    env = {px.CELL_TIMEOUT: f"{max(timeout_s - 60, timeout_s / 2):.0f}"} | env
    if pool := env.get("SHARDLAB_TEST_WARM_POOL"):
        env = env | {warm.POOL: pool}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-tmp-") as temp_folder:
        try:
            run.rerun = rerun_span(nb.cells) if rerun else None
            _execute(client, nb, run, rehearse, env | {"TMPDIR": temp_folder})
        except BaseException as error:
            run.seconds = time.perf_counter() - t0
            print(run.timing_report(f"failed ({type(error).__name__})"), flush=True)
            raise
        left = left_in_temp_folder(Path(temp_folder))
        assert not left, f"{path.name} left files in the temp folder: {left}"
    run.seconds = time.perf_counter() - t0
    slow = run.seconds > slow_s
    report = run.timing_report(f"passed, but slowly (over {slow_s:.0f} s)," if slow else "passed")
    print(report, flush=True)
    if slow:
        warnings.warn(SlowNotebook(report), stacklevel=2)
    return run


# Run in the kernel after a cell timed out and was interrupted: where the kernel was, and for every cluster in its
# namespace the ranks still running their task 10 s later (%%px sends SIGINT to its engines when the kernel is
# interrupted: a rank that ignores it is stuck outside Python, e.g. in a C++ wait). A %%px cell waits for every rank:
# one stuck rank holds it until this runner's timeout, although the others raised after the collective timeout.
# The answer comes back in the shell reply (a user expression): nbclient leaves the timed-out cell's reader on the
# output channel, which would swallow printed text.
WHERE_IT_WAITED = """
import re as _re, sys as _sys, traceback as _traceback
import shardlab as _sl

def _tail(text, lines=6):
    return "\\n      ".join(_re.sub(r"\\x1b\\[[0-9;]*m", "", text).strip().splitlines()[-lines:])

_answer = []
if isinstance(getattr(_sys, "last_value", None), KeyboardInterrupt):
    _answer.append("the kernel was waiting in:\\n      " + _tail("".join(_traceback.format_tb(_sys.last_traceback))))
for _name, _cluster in list(globals().items()):
    if not isinstance(_cluster, _sl.RankCluster) or _cluster.client is None:
        continue
    _client = _cluster.client
    _client.wait(timeout=10)  # ranks interrupted by %%px answer with their KeyboardInterrupt
    _busy = sorted(r for r, s in _client.queue_status().items() if isinstance(r, int) and s.get("queue"))
    if _busy:
        _answer.append(f"{_name}: rank(s) {_busy} still run their task 10 s after the interrupt: stuck outside Python")
_answer = "\\n".join(_answer) or "no cluster was busy"
"""


def _shell_reply(client: NotebookClient, msg_id: str, timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            reply = run_sync(client.kc.get_shell_msg)(timeout=left)
        except Empty:
            return None
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply
    return None


def where_it_waited(client: NotebookClient) -> str:
    """After a cell timed out: interrupt the kernel, then ask it where it and the ranks of its clusters were."""
    run_sync(client.km.interrupt_kernel)()
    for _ in range(5):  # the kernel aborts what was queued behind the interrupted cell: ask again until it runs
        msg_id = client.kc.execute(WHERE_IT_WAITED, store_history=False, stop_on_error=False,
                                   user_expressions={"answer": "_answer"})
        reply = _shell_reply(client, msg_id, 60)
        if reply is None:
            return "the kernel did not answer within 60 s of the interrupt: it is stuck outside Python"
        content = reply["content"]
        if content["status"] == "ok":
            return ast.literal_eval(content["user_expressions"]["answer"]["data"]["text/plain"])
        if content["status"] != "aborted":
            return f"asking the kernel failed: {content.get('ename')}: {content.get('evalue')}"
        time.sleep(1)
    return "the kernel aborted every question after the interrupt"


def _execute(client: NotebookClient, nb, run: NotebookRun, rehearse: bool, env: dict) -> None:
    with client.setup_kernel(env=env):
        poll_in_slices(client)
        try:
            _execute_cells(client, nb, run, rehearse)
        except CellTimeoutError:
            print(f"cell {run.last_cell} timed out after {client.timeout} s; where it waited:\n"
                  + where_it_waited(client), flush=True)
            raise


def _execute_cells(client: NotebookClient, nb, run: NotebookRun, rehearse: bool) -> None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if rehearse and SOLUTION_TAG in cell.metadata.get("tags", []):
            check = nb.cells[index + 1]
            answers = [("blank", blank_source(cell.source))]
            answers += [(wrong["why"], wrong["source"]) for wrong in wrong_answers(cell)]
            for why, source in answers:
                attempt = copy.deepcopy(cell) | {"source": source}
                _run(client, nbformat.from_dict(attempt), index, run)
                ename, evalue = _run(client, copy.deepcopy(check), index + 1, run)
                run.rehearsals.append(Rehearsal(index, why, ename, evalue))
        _timed(client, cell, index, run)
        if run.rerun is not None and index == run.rerun[-1]:
            run.first_pass = copy.deepcopy(nb)  # the second pass replaces these cells' outputs
            t0 = time.perf_counter()
            try:
                for again in run.rerun:
                    if nb.cells[again].cell_type == "code":
                        _timed(client, nb.cells[again], again, run)
            except CellExecutionError as error:
                error.add_note(f"(in the second pass: cells {run.rerun.start}..{run.rerun.stop - 1} run again in the "
                               "same kernel, as Run All Above does)")
                raise
            run.rerun_seconds = time.perf_counter() - t0
