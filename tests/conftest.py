import time

import pytest

import shardlab as sl

# Fixture notebooks are meant to fail; tests/test_negative_notebooks.py runs them in their own pytest.
collect_ignore_glob = ["fixtures/*"]


def wait_for_no_leftovers(timeout_s: float = 15.0) -> list:
    """Cluster processes still alive after timeout_s (engines take a moment to exit after a stop)."""
    deadline = time.monotonic() + timeout_s
    while (left := sl.leftover_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves engine, controller or MPI processes behind."""
    yield
    left = wait_for_no_leftovers()
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # under xdist only the controller checks, once every worker is done
    left = wait_for_no_leftovers()
    if left:
        names = [(p.pid, " ".join(p.cmdline())[:120]) for p in left]
        for p in left:
            p.kill()
        print(f"\nFAILED: the suite left cluster processes behind (now killed): {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
