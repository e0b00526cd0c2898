"""Every notebook of the series runs top to bottom on CPU ranks, and every exercise check rejects the
blank handout answer ("not answered yet") and each plausible wrong answer kept with its solution.

`pytest --nbmake notebooks/` runs the same notebooks without the rehearsals; this test is what
`make test` runs, so that no notebook executes twice."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import CellTimeoutError

from notebook_runner import SLOW_S, as_in_jupyterlab, run_notebook
from shardlab.tools.handout import SOLUTION_TAG
from stderr_allowed import unexplained
from world_sizes import NOTEBOOK_SIZES

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# The default world size is 4 CPU ranks (one per GPU on a GPU node); these also run at 2 and at 8 (on the GPUs where
# they can hold that many ranks, else on CPU ranks: tests/support/world_sizes.py). 10 to 15 run whole at 2 ranks in
# JupyterLab (tests/system/test_browser.py), which fails on any cell that fails, so not again here. The suite's
# budget holds 02 to 05, 07, 10 and 11 at 8 ranks (04: a domain of 8); `make test-sizes` adds 12, 13, 14 and 15 at 8
# (1 to 2 minutes each here) and every other notebook at 2.
# Every run at 4 and at 2 ranks also runs the notebook's cells a second time in the same kernel, as Run All Above from
# its last exercise does (notebook_runner.rerun_span); `make test-sizes` runs every notebook at 2 ranks too. At 4 ranks
# the capstone's second pass would train its 100 steps again (about 4 minutes here): it runs twice at 2 ranks only,
# with 20 steps.
ONCE_AT_THE_DEFAULT_SIZE = {"07"}
OTHER_SIZES = {"02": (2, 8), "03": (2, 8), "04": (2, 8), "05": (2, 8), "07": (8,), "10": (8,), "11": (8,)}
if os.environ.get("SHARDLAB_TEST_ALL_SIZES") == "1":
    OTHER_SIZES = {path.stem[:2]: (2,) for path in NOTEBOOKS} | {
        "02": (2, 8), "03": (2, 8), "04": (2, 8), "05": (2, 8), "07": (2, 8), "10": (2, 8), "11": (2, 8),
        "12": (2, 8), "13": (2, 8), "14": (2, 8), "15": (2, 8)}
OTHER_WORLD_SIZES = [(path, ranks) for path in NOTEBOOKS for ranks in OTHER_SIZES.get(path.stem[:2], ())]
# At the other sizes the capstone proves the program (the mesh, every step's loss against one process, the resume),
# in 20 steps; how far it learns in the default 100 is asserted at the default size.
AT_OTHER_WORLD_SIZES = {"07_capstone": {"CAPSTONE_STEPS": "20"}}


# What a learner sees in red: these notebooks run as JupyterLab runs them (``as_in_jupyterlab``), and every line they
# write to stderr, the kernel's and each rank's, in either pass, must be on the allow-list (tests/support/
# stderr_allowed.py) with the reason the series shows it; any other line fails the test, naming the cell. Under pytest,
# ipykernel forwards only what Python writes to sys.stderr: what C libraries write to file descriptor 2 (Warp, torch's
# profiler) is forwarded only when the kernel does not see PYTEST_CURRENT_TEST (ipykernel 7.4, iostream.py,
# OutStream). So these kernels start without it, and their ranks are new, not the session's warm ranks (started under
# pytest, they would not forward either). Messages upstream prints that the series knows are harmless are silenced
# at their source (``shardlab/quiet.py``, each with its reason), not allowed here. tests/notebooks/test_stderr.py
# checks a cell both ways.
STDERR_CHECKED = ("00_setup", "12_data_at_scale", "13_physicsnemo_models")


def solution_cells(path: Path) -> list[int]:
    cells = nbformat.read(path, as_version=4).cells
    return [i for i, cell in enumerate(cells) if SOLUTION_TAG in cell.metadata.get("tags", [])]


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_its_checks_reject_wrong_answers(path, no_leftovers):
    rerun = path.stem[:2] not in ONCE_AT_THE_DEFAULT_SIZE
    run = run_notebook(path, rerun=rerun, env=as_in_jupyterlab() if path.stem in STDERR_CHECKED else None)
    assert not rerun or run.rerun_seconds > 0, f"{path.name}: no cell ran a second time"
    if path.stem in STDERR_CHECKED:
        left = [line for done in (run.first_pass, run.notebook) if done is not None for line in unexplained(done)]
        assert not left, f"{path.name} shows stderr lines nobody explains:\n" + "\n".join(dict.fromkeys(left))
    assert {r.cell for r in run.rehearsals} == set(solution_cells(path)), "an exercise was not rehearsed"
    for r in run.rehearsals:
        where = f"{path.name} cell {r.cell} ({r.answer} answer)"
        assert r.ename == "NotSolved", f"{where}: the check accepted it or failed with {r.ename}: {r.evalue[:300]}"
        if r.answer == "blank":
            assert "not answered yet" in r.evalue, f"{where}: {r.evalue[:300]}"
        else:
            assert "not answered yet" not in r.evalue, f"{where}: a wrong answer is still an answer: {r.evalue[:300]}"


@pytest.mark.notebook
@pytest.mark.parametrize("path, ranks", OTHER_WORLD_SIZES, ids=lambda v: getattr(v, "stem", f"{v}ranks"))
def test_notebook_runs_at_other_world_sizes(path, ranks, no_leftovers):
    """Mesh shapes and sizes come from the world size: the lesson holds at 2 and 8 ranks too (no rehearsals:
    the exercises were rehearsed at the default size). Where the GPUs cannot hold that many ranks (8 on 2-7 GPUs), the
    kernel sees no GPU: sl.start_cluster() has no device setting, and a kernel without a GPU starts CPU ranks.
    At 2 ranks the notebook's cells also run a second time in the same kernel, on the same ranks (``rerun_span``)."""
    placed = NOTEBOOK_SIZES.ranks(ranks).or_skip()
    env = os.environ | {"SHARDLAB_RANKS": str(ranks)} | placed.env | AT_OTHER_WORLD_SIZES.get(path.stem, {})
    run = run_notebook(path, rehearse=False, env=env, timeout_s=600, slow_s=SLOW_S * max(1, ranks / 4),
                       rerun=ranks == 2)
    assert ranks != 2 or run.rerun_seconds > 0, f"{path.name}: no cell ran a second time"


@pytest.mark.notebook
def test_a_cell_that_never_ends_fails_saying_where_the_kernel_waited(tmp_path, capsys):
    path = tmp_path / "stalls.ipynb"
    cells = ["x = 1", "import time\n\ntime.sleep(600)  # waits for nothing that will come"]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    with pytest.raises(CellTimeoutError):
        run_notebook(path, timeout_s=5, rehearse=False)
    out = capsys.readouterr().out
    assert "cell 1 timed out after 5 s; where it waited:\nthe kernel was waiting in:" in out, out
    assert "time.sleep(600)" in out and "stalls.ipynb failed (CellTimeoutError)" in out, out
