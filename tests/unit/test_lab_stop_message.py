"""Ctrl-C in `make lab`'s terminal: the terminal's last line names what stopped (``python -m shardlab.ranks.warm
run``, what `make lab` runs around JupyterLab). With warm ranks for real: tests/multirank/test_lab_stop.py."""

import signal

import pytest

from shardlab.ranks import warm


@pytest.mark.parametrize("command, code, stopped, said", [
    (["/x/.venv/bin/jupyter", "lab", "notebooks/"], 0, (1, 0), "shardlab: JupyterLab stopped; stopped 1 warm rank."),
    (["jupyter", "lab"], -signal.SIGTERM, (0, 0), "shardlab: JupyterLab stopped; no warm ranks were waiting."),
    (["jupyter", "lab"], 1, (8, 2), "shardlab: JupyterLab exited with code 1; stopped 8 warm ranks and 2 running "
                                    "cluster(s)."),
    (["/usr/bin/python3", "-c", "pass"], 0, (0, 0), "shardlab: python3 stopped; no warm ranks were waiting."),
])
def test_the_last_line_names_what_stopped(command, code, stopped, said):
    assert warm.stopped_message(command, code, *stopped) == said
