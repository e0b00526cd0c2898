"""A long %%px cell shows ipyparallel's progress bar in JupyterLab, and none in a notebook run from pytest (nbmake,
the suite), whose saved outputs must stay what the cells print; the bar never outlives the cell's deadline. On
hand-made stand-ins for the shell and the view; a real kernel on both sides: tests/notebooks/test_stderr.py."""

import time
from types import SimpleNamespace

import pytest

from shardlab.ranks import px


def test_pytest_is_what_turns_it_off():
    assert px.progress_wanted({"PATH": "/usr/bin"})  # JupyterLab's kernel: nobody set it
    assert not px.progress_wanted({"PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"})  # nbmake's kernel inherits it
    assert not px.progress_wanted()  # this test runs under pytest: so would a kernel it starts


class Shell:
    def __init__(self):
        self.magics, self.custom_exceptions, self.CustomTB = [], (), None

    def run_line_magic(self, name, line):
        self.magics.append((name, line))

    def set_custom_exc(self, exceptions, handler):
        self.custom_exceptions, self.CustomTB = exceptions, handler


class View:
    block = False

    def execute(self, *args, **kwargs):
        return None

    def activate(self):
        pass


@pytest.mark.parametrize("progress, environ, shown", [
    (None, {}, f"--progress-after {px.PROGRESS_AFTER_S}"),
    (None, {"PYTEST_CURRENT_TEST": "x"}, "--progress-after -1"),
    (True, {"PYTEST_CURRENT_TEST": "x"}, f"--progress-after {px.PROGRESS_AFTER_S}"),
    (False, {}, "--progress-after -1"),
])
def test_px_cells_configure_the_bar_as_chosen_else_as_the_kernel_is_run(monkeypatch, progress, environ, shown):
    shell = Shell()
    monkeypatch.setattr(px, "get_ipython", lambda: shell)
    monkeypatch.setattr(px.os, "environ", environ)
    px.PxCells(View(), [0, 1], progress=progress)
    assert shell.magics == [("pxconfig", f"--no-stream {shown}")]


class Result:
    """An ipyparallel AsyncResult that never finishes: what a rank stuck in a collective gives."""

    def __init__(self):
        self.waited = []

    def wait_interactive(self, interval=0.1, timeout=-1):
        self.waited.append(("wait_interactive", timeout))
        time.sleep(min(timeout, 0.3) if timeout is not None and timeout >= 0 else 0.3)

    def get(self, timeout=None):
        self.waited.append(("get", timeout))
        raise px.ipp.error.TimeoutError("not ready")

    def split(self):
        return [SimpleNamespace(ready=lambda: False), SimpleNamespace(ready=lambda: True)]


def test_the_bar_waits_until_the_cells_deadline_and_get_no_longer():
    """ipyparallel's %%px waits for the bar with no end of its own (wait_interactive, timeout -1), then calls get():
    the bar gets what is left of the deadline, and get() what is left after it, so a stuck rank still fails the cell
    at cell_timeout_s."""
    result = Result()
    execute = px.with_deadline(lambda *args, **kwargs: result, [0, 1], timeout_s=0.4)(
        "x = 1", silent=False, block=False)
    execute.wait_interactive()  # as parallel_execute calls it
    with pytest.raises(px.ClusterError, match=r"rank\(s\) \[0\] did not finish within 0 s"):
        execute.get()
    (_, bar), (_, rest) = result.waited
    assert 0 < bar <= 0.4 and rest <= 0.4 - 0.3 + 0.05, result.waited
