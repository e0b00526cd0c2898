"""Notebook 10's FFT by transpose, its own cells, on a number of ranks that does not divide the field's 64 rows or
columns: uneven blocks (and, at 3 ranks, an odd world) must give one process's spectrum. The whole notebook runs at
the default size and at 8 ranks (tests/notebooks/test_notebooks.py), where every block is the same size.

    .venv/bin/python -m pytest tests/multirank/test_nb10_fft.py -q -p no:cacheprovider
"""

import json
import subprocess
from pathlib import Path

import nbformat
import pytest

from shardlab.ranks.launch import clean_environment, torchrun_command

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "10_beyond_halos.ipynb"
CELLS = ("10-03", "10-26", "10-32")  # the ranks' setup, the field scattered along H, the FFT by transpose

RANK = """
import json
import shardlab as sl

sl.init_distributed(120)
for source in json.loads({cells!r}):
    exec(source.removeprefix("%%px\\n"))
rows = [0] * n
rows[me] = transposed["rows held"]
dist.all_reduce(rows_t := torch.tensor(rows))  # every rank's rows, for the test to see the split was uneven
if me == 0:
    print("RESULT", json.dumps(transposed | {{"rows": rows_t.tolist(), "widths": widths}}))
sl.ranks.launch.shutdown_distributed()
"""


def notebook_cells(*ids: str) -> list[str]:
    cells = {cell.get("id"): cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells}
    return [cells[i] for i in ids]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [3])
def test_fft_by_transpose_matches_one_process_with_uneven_blocks(ranks, tmp_path, no_leftovers):
    script = tmp_path / "fft_by_transpose.py"
    script.write_text(RANK.format(cells=json.dumps(notebook_cells(*CELLS))))
    proc = subprocess.run(torchrun_command(ranks, str(script), log_dir=tmp_path / "torchrun-logs"), capture_output=True,
                          text=True, timeout=300, env=clean_environment(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert sum(result["rows"]) == 64 and len(set(result["rows"])) > 1, result  # the rows really were split unevenly
    assert sum(result["widths"]) == 64 and len(set(result["widths"])) > 1, result
    # The cell asserts the error against one process and the bytes handed to the all-to-all: a failure is a non-zero
    # exit above.
