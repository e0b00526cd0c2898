"""What a learner sees in red, as JupyterLab shows it: a long %%px cell shows its progress bar, and what a rank writes
to file descriptor 2 (as a C library writes, past sys.stderr) reaches the outputs; run from pytest, neither. The check
that every stderr line of notebooks 00, 12 and 13 is on the allow-list runs with their notebook test
(tests/notebooks/test_notebooks.py, ``STDERR_CHECKED``), run as in JupyterLab (``as_in_jupyterlab``), so that those
notebooks run once in the suite, not twice.

Under pytest, ipykernel forwards only what Python writes to sys.stderr: what C libraries write to file descriptor 2 is
forwarded only when the kernel does not see PYTEST_CURRENT_TEST (ipykernel 7.4, iostream.py, OutStream). The same
variable decides whether a long %%px cell shows its progress bar (``shardlab.ranks.px.progress_wanted``): the test
checks both sides on a cell that sleeps past it."""

import re

import nbformat
import pytest

from notebook_runner import as_in_jupyterlab, run_notebook
from shardlab.ranks import px
from stderr_allowed import unexplained

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
