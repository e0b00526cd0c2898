"""Shared by every pytest run in this repository, `pytest --nbmake notebooks/` included: test
categories (markers), and the guard that fails a run which leaves cluster or launcher processes
behind. The guard only sees processes started from this run (they inherit its SHARDLAB_ORIGIN),
so a learner's open cluster or another user's MPI job is never reported, let alone killed."""

import os
import time
import uuid

import pytest

# Everything this session starts (kernels, clusters, launched jobs) inherits this origin; xdist workers
# share their controller's. Set before shardlab is imported, so that shardlab.procs reads it.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["SHARDLAB_ORIGIN"] = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"

from shardlab import procs  # noqa: E402

collect_ignore_glob = ["tests/fixtures/*"]  # meant to fail: tests/test_negative_notebooks.py runs them
CATEGORIES = ("unit", "multirank", "notebook", "browser", "bench", "gpu")


def wait_for_no_leftovers(timeout_s: float = 15.0, of_origin: str | None = None) -> list:
    """This session's (or one test's) processes still alive after timeout_s (engines take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while (left := procs.leftover_processes(of_origin)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def no_leftovers(request, monkeypatch):
    """Fail the test if it leaves engine, controller or launcher processes behind.

    What the test starts gets an origin of its own, nested in the session's, so that tests running
    side by side (pytest -n 2) never count each other's processes."""
    mine = f"{os.environ[procs.ORIGIN]}/{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(procs.ORIGIN, mine)
    monkeypatch.setattr(procs, "_ORIGIN", mine)
    yield
    left = wait_for_no_leftovers(of_origin=mine)
    assert not left, f"processes left behind by {request.node.nodeid}: {[(p.pid, p.name()) for p in left]}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("notebook") is None and item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)  # nbmake's items
        marked = [name for name in CATEGORIES if item.get_closest_marker(name)]
        if not marked:
            if "no_leftovers" in getattr(item, "fixturenames", ()):
                raise pytest.UsageError(f"{item.nodeid} starts processes: mark it multirank, notebook, browser "
                                        "or bench")
            item.add_marker(pytest.mark.unit)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # under xdist only the controller checks, once every worker is done
    left = wait_for_no_leftovers()
    if left:
        names = [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
        procs.stop(left)
        print(f"\nFAILED: this run left processes behind (now stopped): {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
