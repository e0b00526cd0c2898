"""The class's start gate (shardlab.ranks.bringup.start_slot; INSTRUCTORS.md, "A class on one shared node"): off
unless SHARDLAB_START_GATE names a folder; with it, a start waits for a free slot, naming who holds them, and goes
ahead after its wait; a slot is let go when its holder exits. Two real accounts through the gate:
tests/system/test_class_node.py."""

import os
import pwd
import subprocess
import sys
import textwrap
import time

import pytest

from shardlab.ranks import bringup
from shardlab.ranks.px import ClusterError

ME = pwd.getpwuid(os.getuid()).pw_name
HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def hold(slot, seconds: float) -> subprocess.Popen:
    """Another process holding ``slot``, as another learner's starting kernel does, for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(slot), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_without_the_variable_there_is_no_gate(tmp_path, monkeypatch):
    monkeypatch.delenv(bringup.START_GATE, raising=False)
    said = []
    with bringup.start_slot(said.append):
        ran = True
    assert ran and not said


def test_a_start_waits_for_a_slot_naming_its_holder_and_goes_on_when_it_is_free(tmp_path, capsys):
    holder = hold(tmp_path / "slot-0", 1.5)
    said = []
    try:
        t0 = time.monotonic()
        with bringup.start_slot(said.append, folder=str(tmp_path), slots=1, wait_s=60, poll_s=0.1):
            waited = time.monotonic() - t0
            assert bringup.slot_holders([tmp_path / "slot-0"]) == [f"{ME} (pid {os.getpid()})"]
    finally:
        holder.kill()
        holder.wait()
    assert waited >= 1.0, "it did not wait for the slot"
    assert f"held by {ME} (pid {holder.pid})" in said[0]
    assert f"held by {ME} (pid {holder.pid})" in capsys.readouterr().out
    assert bringup.slot_holders([tmp_path / "slot-0"]) == [], "the slot is let go after the start"


def test_a_free_slot_is_taken_at_once(tmp_path):
    holder = hold(tmp_path / "slot-0", 30)
    said = []
    try:
        with bringup.start_slot(said.append, folder=str(tmp_path), slots=2, wait_s=5, poll_s=0.1):
            assert len(bringup.slot_holders([tmp_path / "slot-0", tmp_path / "slot-1"])) == 2
    finally:
        holder.kill()
        holder.wait()
    assert not said


def test_a_holder_that_dies_lets_go(tmp_path):
    holder = hold(tmp_path / "slot-0", 30)
    holder.kill()
    holder.wait()
    with bringup.start_slot(folder=str(tmp_path), slots=1, wait_s=5, poll_s=0.1):
        assert bringup.slot_holders([tmp_path / "slot-0"]) == [f"{ME} (pid {os.getpid()})"]


def test_past_its_wait_a_start_goes_ahead_without_a_slot_saying_whose_it_waited_for(tmp_path, capsys):
    holder = hold(tmp_path / "slot-0", 30)
    try:
        with bringup.start_slot(folder=str(tmp_path), slots=1, wait_s=0.5, poll_s=0.1):
            ran = True
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr().out
    assert ran and "starting without one" in out and f"held by {ME} (pid {holder.pid})" in out


def test_slots_are_open_to_every_learner_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        with bringup.start_slot(folder=str(tmp_path), slots=1, wait_s=5):
            pass
    finally:
        os.umask(old)
    assert oct((tmp_path / "slot-0").stat().st_mode & 0o777) == oct(0o644)


def test_a_gate_that_cannot_be_used_is_said_and_skipped(tmp_path, capsys):
    with bringup.start_slot(folder=str(tmp_path / "missing"), slots=1, wait_s=5):
        ran = True
    assert ran and "cannot be used" in capsys.readouterr().out


@pytest.mark.parametrize("slots", ["0", "two", "-1"])
def test_a_wrong_number_of_slots_is_refused_saying_what_to_set(tmp_path, monkeypatch, slots):
    monkeypatch.setenv(bringup.START_SLOTS, slots)
    with pytest.raises(ClusterError, match="SHARDLAB_START_SLOTS"):
        with bringup.start_slot(folder=str(tmp_path)):
            pass
