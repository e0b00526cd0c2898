"""What a learner sees in red: every line 00, 12 and 13 write to stderr, the kernel's and each rank's, is on the
allow-list (tests/support/stderr_allowed.py) with the reason the series shows it; any other line fails the
test, naming the cell.

The notebooks run as JupyterLab runs them. Under pytest, ipykernel forwards only what Python writes to sys.stderr:
what C libraries write to file descriptor 2 (Warp, torch's profiler) is forwarded only when the kernel does not see
PYTEST_CURRENT_TEST (ipykernel 7.4, iostream.py, OutStream). So the kernel here starts without it, and so do its
ranks, which are new (the session's warm ranks were started under pytest and would not forward either). The same
variable decides whether a long %%px cell shows its progress bar (``shardlab.ranks.px.progress_wanted``): the second
test checks both sides on a cell that sleeps past it.

Messages upstream prints that the series knows are harmless are silenced at their source (``shardlab/quiet.py``, each
with its reason), not allowed here."""

import os
import re
from pathlib import Path

import nbformat
import pytest

from notebook_runner import run_notebook
from shardlab.ranks import px, warm
from stderr_allowed import unexplained

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CHECKED = ("00_setup", "12_data_at_scale", "13_physicsnemo_models")

def as_in_jupyterlab() -> dict:
    """This environment without what pytest and the session's warm pool add: the kernel then forwards C libraries'
    stderr and starts ranks of its own, as under `make lab`."""
    left_out = ("PYTEST_CURRENT_TEST", "SHARDLAB_TEST_WARM_POOL", warm.POOL)
    return {k: v for k, v in os.environ.items() if k not in left_out}


@pytest.mark.notebook
@pytest.mark.parametrize("name", CHECKED)
def test_every_stderr_line_is_one_the_series_explains(name, no_leftovers):
    run = run_notebook(NOTEBOOKS / f"{name}.ipynb", rehearse=False, env=as_in_jupyterlab())
    left = unexplained(run.notebook)
    assert not left, f"{name} shows stderr lines nobody explains:\n" + "\n".join(left)


RAW = "written to file descriptor 2 by a rank"  # as a C library writes, past sys.stderr
SLEEPS = [
    "import shardlab as sl\ncluster = sl.start_cluster(n=2)",
    f"%%px\nimport os, time\nos.write(2, b'{RAW}\\n')\ntime.sleep({3 * px.PROGRESS_AFTER_S})\nprint('slept')",
    "cluster.stop()",
]


@pytest.mark.notebook
def test_a_long_px_cell_shows_progress_in_jupyterlab_and_nothing_more_under_pytest(tmp_path, no_leftovers):
    """Run as in JupyterLab, a cell that sleeps past PROGRESS_AFTER_S shows the bar, and what a rank writes to file
    descriptor 2 reaches the outputs, where the test above would fail on it; run from pytest, as nbmake runs it, the
    cell's outputs are only what it printed."""
    path = tmp_path / "sleeps.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in SLEEPS]), path)
    interactive = run_notebook(path, rehearse=False, env=as_in_jupyterlab()).notebook.cells[1].outputs
    bars = [o for o in interactive if o.output_type == "display_data"]
    # ipyparallel's bar (tqdm's widget): "%px: 0%| | 0/2 [...]" as first shown, then updated in the browser.
    assert len(bars) == 1 and "application/vnd.jupyter.widget-view+json" in bars[0].data, interactive
    assert re.match(r"%px: .* \d/2 ", bars[0].data["text/plain"]), bars[0].data["text/plain"]
    cells = [nbformat.v4.new_code_cell(), nbformat.v4.new_code_cell(outputs=interactive)]
    shown = nbformat.v4.new_notebook(cells=cells)
    assert unexplained(shown) == [f"cell 1: {RAW}"] * 2, interactive
    saved = run_notebook(path, rehearse=False).notebook.cells[1].outputs  # pytest's environment, as nbmake's
    printed = [(o.output_type, o.get("name"), o.get("text")) for o in saved]
    assert printed == [("stream", "stdout", "[stdout:0] \nslept\n[stdout:1] \nslept\n")]  # what the cell printed
    assert printed == [(o.output_type, o.get("name"), o.get("text")) for o in interactive
                       if o.output_type == "stream" and o.name == "stdout"]
