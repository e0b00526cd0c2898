"""The stderr allow-list (tests/support/stderr_allowed.py), without a kernel: a line not on the list is reported
with its cell."""

import nbformat

from stderr_allowed import ALLOWED, unexplained


def test_a_line_not_on_the_list_is_reported_with_its_cell():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x"), nbformat.v4.new_code_cell("y")])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text="[stderr:0] \nWarp CUDA warning: x\n"),
                           nbformat.v4.new_output("stream", name="stdout", text="[stdout:0] fine\n")]
    assert unexplained(nb) == ["cell 1: Warp CUDA warning: x"]
    assert all(reason.strip() for _, reason in ALLOWED)
