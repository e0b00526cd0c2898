"""Run a notebook of the series top to bottom, as nbmake does, and rehearse its exercises on the way.

Before each solution cell runs, the check cell after it is run against the learner's possible
answers, in the same kernel and on the same ranks: the blank handout answer (``name = ...``) must
fail with "not answered yet", and every plausible wrong answer listed in the solution cell's
metadata (``shardlab.wrong_answers``) must fail too. Then the real solution and its check run, and
the notebook goes on. One run covers the instructor copy and the handout, with no work done twice.
"""

from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from shardlab.ranks import procs, warm
from shardlab.tools.handout import SOLUTION_TAG, blank_source, wrong_answers
from shardlab.tools.morning import CURVE_KERNELS


@dataclass
class Rehearsal:
    """What one learner answer did to an exercise's check."""

    cell: int
    answer: str  # "blank" or the wrong answer's reason
    ename: str | None
    evalue: str


@dataclass
class NotebookRun:
    path: Path
    rehearsals: list[Rehearsal] = field(default_factory=list)


def _run(client: NotebookClient, cell, index: int) -> tuple[str | None, str]:
    """Execute one cell; (exception name, message) if it failed, else (None, "")."""
    try:
        client.execute_cell(cell, index)
    except CellExecutionError as error:
        return error.ename, error.evalue
    return None, ""


def left_in_temp_folder(folder: Path) -> list[str]:
    """What a notebook run left in its temp folder besides torch.compile's kernel cache (kept on purpose) and an
    empty process registry (a record left in it is a cluster that was never stopped)."""
    left = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("torchinductor_"):
            continue
        if entry.name == procs.registry_name() and entry.is_dir():
            left += [f"{entry.name}/{record.name}" for record in entry.iterdir()]
            continue
        left.append(entry.name)
    return left


def run_notebook(path: Path, timeout_s: float = 300, rehearse: bool = True, env: dict | None = None) -> NotebookRun:
    """Execute every cell of ``path`` (a failing cell raises CellExecutionError, as under nbmake) and
    return what each rehearsed answer did to its check. The kernel, and all it starts, get a temp folder of
    their own; a run that leaves files in it fails. The kernel gets the session's pool of warm clusters
    (conftest.py): its ``sl.start_cluster()`` attaches to the ranks the previous notebook parked, reset."""
    nb = nbformat.read(path, as_version=4)
    # CurveZMQ between this process and the kernel, as `make lab` has it: the kernel then prints no warning about TCP.
    # As configuration, not a kernel manager of ours: the client then owns its manager and shuts the kernel down.
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="shardlab", config=CURVE_KERNELS,
                            resources={"metadata": {"path": str(path.parent)}})
    run = NotebookRun(path)
    env = os.environ if env is None else env
    if pool := env.get("SHARDLAB_TEST_WARM_POOL"):
        env = env | {warm.POOL: pool}
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-tmp-") as temp_folder:
        _execute(client, nb, run, rehearse, env | {"TMPDIR": temp_folder})
        left = left_in_temp_folder(Path(temp_folder))
        assert not left, f"{path.name} left files in the temp folder: {left}"
    return run


def _execute(client: NotebookClient, nb, run: NotebookRun, rehearse: bool, env: dict) -> None:
    with client.setup_kernel(env=env):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            if rehearse and SOLUTION_TAG in cell.metadata.get("tags", []):
                check = nb.cells[index + 1]
                answers = [("blank", blank_source(cell.source))]
                answers += [(wrong["why"], wrong["source"]) for wrong in wrong_answers(cell)]
                for why, source in answers:
                    attempt = copy.deepcopy(cell) | {"source": source}
                    _run(client, nbformat.from_dict(attempt), index)
                    ename, evalue = _run(client, copy.deepcopy(check), index + 1)
                    run.rehearsals.append(Rehearsal(index, why, ename, evalue))
            client.execute_cell(cell, index)
