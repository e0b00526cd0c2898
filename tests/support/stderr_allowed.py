"""What a learner may see in red, and why: each allowed line with its reason, and the lines of a notebook no reason
covers. tests/notebooks/test_notebooks.py runs the notebooks (``STDERR_CHECKED``); tests/unit/test_stderr_lines.py
checks the rule."""

import re

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
