"""Process records on a shared machine: shardlab stops only what it started, and trusts only its own records."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from shardlab import procs

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A private registry for the test, so the user's real one is never touched."""
    path = tmp_path / "registry"
    monkeypatch.setenv("SHARDLAB_REGISTRY", str(path))
    return path


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(SLEEP)
    yield proc
    proc.kill()
    proc.wait()


def _record(sleeper, owner_pid, owner_created, profile_dir) -> procs.Record:
    record = procs.Record("shardlab-test", owner_pid, owner_created, str(profile_dir),
                          [(sleeper.pid, psutil.Process(sleeper.pid).create_time())])
    record.save()
    return record


def _dead_owner() -> tuple[int, float]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid, 0.0


def test_registry_is_owner_only_and_records_are_written_whole(registry):
    path = procs.registry()
    assert path == registry and path.stat().st_mode & 0o777 == 0o700
    record = procs.Record("shardlab-x", 1, 2.0, "/nonexistent")
    record.save()
    assert record.path.stat().st_mode & 0o777 == 0o600
    assert json.loads(record.path.read_text())["cluster_id"] == "shardlab-x"
    assert not list(path.glob("*.tmp"))


def test_registry_open_to_others_is_refused_with_what_to_do(registry):
    registry.mkdir(mode=0o777)
    registry.chmod(0o777)
    with pytest.raises(procs.UnsafeFolder, match=r"open to other users \(mode 777\): run chmod 700"):
        procs.registry()


def test_registry_that_is_a_link_is_refused(registry, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    registry.symlink_to(target)
    with pytest.raises(procs.UnsafeFolder, match="not a plain folder"):
        procs.registry()


def test_cluster_of_a_dead_kernel_is_stopped_and_its_profile_removed(registry, sleeper):
    profile = Path(procs.make_profile_dir("shardlab-test"))
    record = _record(sleeper, *_dead_owner(), profile)
    assert procs.clean_stale_clusters() == 1
    assert sleeper.wait(timeout=10) is not None
    assert not profile.exists() and not record.path.exists()


def test_cluster_of_a_live_kernel_is_left_alone(registry, sleeper, tmp_path):
    me = psutil.Process()
    record = _record(sleeper, me.pid, me.create_time(), tmp_path)
    assert procs.clean_stale_clusters() == 0
    time.sleep(0.2)
    assert sleeper.poll() is None and record.path.exists()


def test_a_record_naming_someone_elses_folder_deletes_nothing(registry, tmp_path):
    """A stale or planted record points at a folder shardlab did not create: the folder survives."""
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("years of work")
    elsewhere_with_our_prefix = Path(tempfile.mkdtemp(prefix="not-ours-"))
    for target in (precious, elsewhere_with_our_prefix, tmp_path):
        procs.Record("shardlab-test", *_dead_owner(), str(target)).save()
        assert procs.clean_stale_clusters() == 1
        assert target.exists(), f"{target} was deleted"
    assert (precious / "chapter1.tex").read_text() == "years of work"
    elsewhere_with_our_prefix.rmdir()


def test_a_record_with_a_recycled_pid_kills_nothing(registry, sleeper):
    record = procs.Record("shardlab-test", *_dead_owner(), "/nonexistent",
                          [(sleeper.pid, psutil.Process(sleeper.pid).create_time() - 100)])  # same pid, other process
    record.save()
    procs.clean_stale_clusters()
    time.sleep(0.2)
    assert sleeper.poll() is None


def test_files_in_the_registry_that_are_not_our_records_are_ignored(registry, sleeper):
    path = procs.registry()
    (path / "garbage.json").write_text("{not json")
    (path / "other.json").write_text(json.dumps({"owner_pid": 1, "processes": [[sleeper.pid, 0]]}))
    assert procs.clean_stale_clusters() == 0
    assert sleeper.poll() is None


def test_leftovers_are_only_processes_started_from_this_origin(tmp_path):
    """An mpiexec-named process somebody else started is not ours, however it is called."""
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!{sys.executable}\nimport time; time.sleep(120)\n")
    fake.chmod(0o755)
    unrelated = subprocess.Popen([str(fake), "-n", "4", "ipengine"],
                                 env={k: v for k, v in os.environ.items() if k != procs.ORIGIN})
    ours = subprocess.Popen(SLEEP, env=os.environ | procs.marked_environment())
    try:
        deadline = time.monotonic() + 10
        while ours.pid not in {p.pid for p in procs.leftover_processes()} and time.monotonic() < deadline:
            time.sleep(0.1)  # the environment is readable once the process has started
        found = {p.pid for p in procs.leftover_processes()}
        assert ours.pid in found and unrelated.pid not in found
    finally:
        for proc in (unrelated, ours):
            proc.kill()
            proc.wait()
