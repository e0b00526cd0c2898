"""A start that failed on the controller's side says what failed there: the controller itself (how it ended, the
end of its log) or a process it forked (the traceback in its log), on real processes of our own that stand in for
the controller. A controller that runs and logged no traceback adds nothing: every other start error stays short."""

import signal
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from shardlab.ranks.bringup import controller_trouble

HEART_MONITOR_FAILED = """\
2026-12-04 16:34:03.941 [IPController] Heartmonitor beating every 1000ms
Process Process-8:
Traceback (most recent call last):
  File "ipyparallel/controller/heartmonitor.py", line 263, in _setup_heartmonitor
    bind(
zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:20078')
2026-12-04 16:34:33.781 [IPController] WARNING | registration::purging stalled registration 1:62fa416c
"""


@pytest.fixture
def controller(tmp_path):
    """A running stand-in for the controller and its log; stopped at the end, whatever the test did to it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tmp_path / "ipcontroller.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    yield SimpleNamespace(process=psutil.Process(child.pid), output_file=str(log), stop_data=None, child=child)
    child.kill()
    child.wait()


def test_a_controller_killed_during_the_start_is_named_with_its_signal_and_its_log(controller):
    controller.child.send_signal(signal.SIGKILL)
    controller.stop_data = {"exit_code": controller.process.wait(10)}
    said = controller_trouble(SimpleNamespace(controller=controller), lines=3)
    assert said.startswith(f"The controller (pid {controller.child.pid}) was killed by signal {int(signal.SIGKILL)}")
    assert said.endswith("line 27\nline 28\nline 29")


def test_a_forked_process_that_failed_is_shown_by_its_traceback(controller):
    with open(controller.output_file, "a") as log:
        log.write(HEART_MONITOR_FAILED)
    said = controller_trouble(SimpleNamespace(controller=controller))
    assert said.startswith("A process of the controller failed") and "line 29" not in said
    assert said.splitlines()[1] == "Traceback (most recent call last):"
    assert said.endswith("Address already in use (addr='tcp://127.0.0.1:20078')")


def test_a_running_controller_without_a_traceback_adds_nothing(controller):
    assert controller_trouble(SimpleNamespace(controller=controller)) is None
