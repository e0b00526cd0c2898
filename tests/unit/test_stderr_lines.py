"""The stderr allow-list of tests/notebooks/test_stderr.py, without a kernel: a line not on the list is reported
with its cell."""

import re

import nbformat

# (pattern a whole line must match, why a learner may see it)
ALLOWED = [
    (r"\[stderr:\d+\] ?", "ipyparallel's label over what one rank wrote to stderr: it names the rank, it says nothing"),
]


def stderr_lines(nb) -> list[tuple[int, str]]:
    """(cell index, line) of every non-blank line in the stderr stream outputs of ``nb``'s cells."""
    return [(index, line) for index, cell in enumerate(nb.cells) for output in cell.get("outputs", [])
            if output.get("output_type") == "stream" and output.get("name") == "stderr"
            for line in output["text"].splitlines() if line.strip()]


def unexplained(nb) -> list[str]:
    """The stderr lines of ``nb`` that no ALLOWED pattern matches, each with its cell: what the test fails on."""
    return [f"cell {index}: {line}" for index, line in stderr_lines(nb)
            if not any(re.fullmatch(pattern, line) for pattern, _ in ALLOWED)]


def test_a_line_not_on_the_list_is_reported_with_its_cell():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x"), nbformat.v4.new_code_cell("y")])
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text="[stderr:0] \nWarp CUDA warning: x\n"),
                           nbformat.v4.new_output("stream", name="stdout", text="[stdout:0] fine\n")]
    assert unexplained(nb) == ["cell 1: Warp CUDA warning: x"]
    assert all(reason.strip() for _, reason in ALLOWED)
