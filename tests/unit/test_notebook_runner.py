"""The notebook runner's bookkeeping (tests/support/notebook_runner.py), without a kernel: a file left in the temp
folder is reported (not the compile cache), the timing report names the slowest cells, kernel time is read from
nbclient's dates, and a failed or timed-out cell still counts. The notebooks themselves:
tests/notebooks/test_notebooks.py."""

import os
import time
from pathlib import Path

import nbformat
import pytest

from notebook_runner import NotebookRun, _timed, kernel_seconds, left_in_temp_folder
from shardlab.ranks import folders

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
OTHER_SIZES = {"02": (2,), "03": (2,), "04": (2, 8), "05": (2,)}
if os.environ.get("SHARDLAB_TEST_ALL_SIZES") == "1":
    OTHER_SIZES = {path.stem[:2]: (2,) for path in NOTEBOOKS} | {
        "02": (2, 8), "03": (2, 8), "04": (2, 8), "05": (2, 8), "07": (2, 8), "10": (2, 8), "11": (2, 8),
        "12": (2, 8), "13": (2, 8), "14": (2, 8)}


def test_a_file_left_in_the_temp_folder_is_reported_but_not_the_compile_cache(tmp_path):
    (tmp_path / "torchinductor_someone").mkdir()  # torch.compile's cache: kept on purpose
    registry = tmp_path / folders.registry_name()
    registry.mkdir()
    assert left_in_temp_folder(tmp_path) == []
    (tmp_path / "capstone-x1y2").mkdir()  # e.g. a checkpoint folder nobody removes
    (registry / "abc.json").write_text("{}")  # a cluster that was never stopped
    assert left_in_temp_folder(tmp_path) == ["capstone-x1y2", f"{registry.name}/abc.json"]


def test_the_timing_report_names_the_slowest_cells_and_the_time_outside_them(tmp_path):
    path = tmp_path / "stalls.ipynb"
    cells = ["import shardlab as sl", "%%px\nmeasured = sl.plan.measure_rank(model, mesh)",
             "x = 1\ny = 2"]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    # Cell 1 waited 290 s of which its kernel ran 14 s: the wait was on the client's side of the channels.
    run = NotebookRun(path, cell_seconds={0: 3.0, 1: 290.0, 2: 7.25}, kernel_seconds={0: 2.9, 1: 14.0},
                      seconds=310.0)
    lines = run.timing_report("failed (CellTimeoutError)").splitlines()
    assert lines[0] == "stalls.ipynb failed (CellTimeoutError) after 310 s; slowest cells:"
    assert lines[1].split() == ["cell", "1", "290.0", "s", "(in", "the", "kernel", "14.0", "s)", "%%px", "measured",
                                "=", "sl.plan.measure_rank(model,", "mesh)"]
    assert "(in the kernel       ?  )" in lines[2]  # no kernel time recorded for cell 2
    assert [line.split()[1] for line in lines[2:4]] == ["2", "0"] and lines[4].endswith(": 9.8 s")


def test_the_kernel_time_is_read_from_the_dates_nbclient_records():
    cell = nbformat.v4.new_code_cell("x = 1")
    assert kernel_seconds(cell) is None  # not run yet
    cell.metadata["execution"] = {"iopub.execute_input": "2026-12-02T20:36:57.250000Z",
                                  "shell.execute_reply": "2026-12-02T20:37:11.500000Z"}
    assert kernel_seconds(cell) == 14.25


def test_a_cell_that_fails_or_times_out_still_has_its_time_counted(tmp_path):
    class Stalling:
        def execute_cell(self, cell, index):
            time.sleep(0.05)
            raise TimeoutError("a cell that never ends")

    run = NotebookRun(tmp_path / "any.ipynb", cell_seconds={3: 1.0})
    with pytest.raises(TimeoutError):
        _timed(Stalling(), nbformat.v4.new_code_cell("while True: pass"), 3, run)
    assert run.cell_seconds[3] >= 1.05
