"""Process records on a shared machine: shardlab stops only what it started, and trusts only its own records. The
session guard of a real run: tests/multirank/test_session_guard.py."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from shardlab.ranks import folders, owned, records, subprocesses

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(SLEEP)
    yield proc
    proc.kill()
    proc.wait()


def _record(sleeper, owner_pid, owner_created, profile_dir) -> records.Record:
    record = records.Record("shardlab-test", owner_pid, owner_created, str(profile_dir),
                          [owned.identity(sleeper.pid)])
    record.save()
    return record


def _dead_owner() -> tuple[int, float]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid, 0.0


def test_registry_is_owner_only_and_records_are_written_whole(registry):
    path = folders.registry()
    assert path == registry and path.stat().st_mode & 0o777 == 0o700
    record = records.Record("shardlab-x", 1, 2.0, "/nonexistent")
    record.save()
    assert record.path.stat().st_mode & 0o777 == 0o600
    assert json.loads(record.path.read_text())["cluster_id"] == "shardlab-x"
    assert not list(path.glob("*.tmp"))


def test_registry_open_to_others_is_refused_with_what_to_do(registry):
    registry.mkdir(mode=0o777)
    registry.chmod(0o777)
    with pytest.raises(folders.UnsafeFolder, match=r"open to other users \(mode 777\): run chmod 700"):
        folders.registry()


def test_registry_that_is_a_link_is_refused(registry, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    registry.symlink_to(target)
    with pytest.raises(folders.UnsafeFolder, match="not a plain folder"):
        folders.registry()


def test_cluster_of_a_dead_kernel_is_stopped_and_its_profile_removed(registry, sleeper):
    profile = Path(folders.make_profile_dir("shardlab-test"))
    record = _record(sleeper, *_dead_owner(), profile)
    assert records.clean_stale_clusters() == 1
    assert sleeper.wait(timeout=10) is not None
    assert not profile.exists() and not record.path.exists()


def test_cluster_of_a_live_kernel_is_left_alone(registry, sleeper, tmp_path):
    record = _record(sleeper, *owned.identity(), tmp_path)
    assert records.clean_stale_clusters() == 0
    assert sleeper.poll() is None and record.path.exists()  # what it stops has exited by the time it returns


def test_a_record_naming_someone_elses_folder_deletes_nothing(registry, tmp_path):
    """A stale or planted record points at a folder shardlab did not create: the folder survives."""
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("years of work")
    elsewhere_with_our_prefix = Path(tempfile.mkdtemp(prefix="not-ours-"))
    for target in (precious, elsewhere_with_our_prefix, tmp_path):
        records.Record("shardlab-test", *_dead_owner(), str(target)).save()
        assert records.clean_stale_clusters() == 1
        assert target.exists(), f"{target} was deleted"
    assert (precious / "chapter1.tex").read_text() == "years of work"
    elsewhere_with_our_prefix.rmdir()


def test_a_record_with_a_recycled_pid_kills_nothing(registry, sleeper):
    record = records.Record("shardlab-test", *_dead_owner(), "/nonexistent",
                          [(sleeper.pid, owned.identity(sleeper.pid)[1] - 100)])  # same pid, other process
    record.save()
    records.clean_stale_clusters()  # returns once whatever it stopped has exited
    assert sleeper.poll() is None


def test_files_in_the_registry_that_are_not_our_records_are_ignored(registry, sleeper):
    path = folders.registry()
    (path / "garbage.json").write_text("{not json")
    (path / "other.json").write_text(json.dumps({"owner_pid": 1, "processes": [[sleeper.pid, 0]]}))
    assert records.clean_stale_clusters() == 0
    assert sleeper.poll() is None


def test_leftovers_are_only_processes_started_from_this_origin(tmp_path):
    """An mpiexec-named process somebody else started is not ours, however it is called."""
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!{sys.executable}\nimport time; time.sleep(120)\n")
    fake.chmod(0o755)
    unrelated = subprocess.Popen([str(fake), "-n", "4", "ipengine"],
                                 env={k: v for k, v in os.environ.items() if k != owned.ORIGIN})
    ours = subprocess.Popen(SLEEP, env=os.environ | owned.marked_environment())
    try:
        deadline = time.monotonic() + 10
        while ours.pid not in {p.pid for p in owned.leftover_processes()} and time.monotonic() < deadline:
            time.sleep(0.1)  # the environment is readable once the process has started
        found = {p.pid for p in owned.leftover_processes()}
        assert ours.pid in found and unrelated.pid not in found
    finally:
        for proc in (unrelated, ours):
            proc.kill()
            proc.wait()


def test_a_process_group_past_its_time_is_stopped_whole_and_named(tmp_path):
    """The launcher and what it started (here a shell and its background sleep) go together; the error says what
    was waited for."""
    child_pid = tmp_path / "child"
    cmd = ["sh", "-c", f"sleep 600 & echo $! > {child_pid}; wait"]
    with pytest.raises(TimeoutError, match=r"the sleepers did not finish within 2 s.*sleep 600 &"):
        subprocesses.run_process_group(cmd, os.environ | owned.marked_environment(), 2, "the sleepers")
    with contextlib.suppress(psutil.NoSuchProcess):  # gone already, or ending: it was signalled with its shell
        psutil.Process(int(child_pid.read_text())).wait(timeout=15)


def test_a_process_group_that_finishes_gives_its_exit_code_and_output():
    done = subprocesses.run_process_group(["sh", "-c", "echo out; echo err >&2; exit 4"], dict(os.environ), 30,
                                          "a shell")
    assert (done.returncode, done.stdout, done.stderr) == (4, "out\n", "err\n")



def test_a_detached_child_is_reaped_when_it_exits_not_left_defunct(tmp_path):
    """A parked cluster's keeper is such a child: it exits when another kernel claims the cluster, while the kernel
    that started it runs on. Nothing of it may stay in the process table, not even a <defunct> entry."""
    go = tmp_path / "go"
    pid, created = subprocesses.start_detached([sys.executable, "-c", f"import os, time\nwhile not os.path.exists("
                                         f"{str(go)!r}): time.sleep(0.05)"], dict(os.environ))
    assert owned.same_process(pid, created) is not None
    assert psutil.Process(pid).ppid() == os.getpid() and os.getsid(pid) == pid  # a session of its own
    go.touch()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid), f"{pid} is {psutil.Process(pid).status()}, still a child of this process"

# -- profile folders elsewhere (a folder every node of a Slurm job reads) ------------------------------------


def test_a_profile_in_a_shared_folder_is_ours_and_cleaned_up(registry, tmp_path, sleeper):
    shared = tmp_path / "shared"
    profile = Path(folders.make_profile_dir("shardlab-test", shared))
    assert profile.parent == shared and profile.stat().st_mode & 0o777 == 0o700
    assert folders.created_profile_dir(profile)
    _record(sleeper, *_dead_owner(), profile)
    assert records.clean_stale_clusters() == 1
    assert not profile.exists() and shared.exists()


def test_our_prefix_alone_or_a_copied_marker_is_not_enough(registry, tmp_path):
    """Only the folder make_profile_dir created is deleted: the name prefix and the marker must both say so."""
    no_marker = tmp_path / f"{folders.profile_prefix()}lookalike"
    no_marker.mkdir()
    copied = tmp_path / f"{folders.profile_prefix()}copied"
    copied.mkdir()
    real = Path(folders.make_profile_dir("shardlab-test", tmp_path))
    (copied / folders.PROFILE_MARKER).write_text((real / folders.PROFILE_MARKER).read_text())  # names another folder
    linked = tmp_path / f"{folders.profile_prefix()}linked"
    linked.symlink_to(real)
    for target in (no_marker, copied, linked):
        assert not folders.created_profile_dir(target)
        records.Record("shardlab-test", *_dead_owner(), str(target)).save()
        records.clean_stale_clusters()
        assert target.exists(), f"{target} was deleted"
    assert real.exists()


# -- a second user on the same machine (needs root to become one) ---------------------------------------------

NOBODY = 65534
needs_root = pytest.mark.skipif(folders.user_id() != 0, reason="needs root, to run code as a second user (nobody)")


@pytest.fixture
def shared_tmp(monkeypatch):
    """A temp folder both users write to, like /tmp (sticky, world-writable), used as the temp folder by both."""
    path = Path(tempfile.mkdtemp(prefix="shardlab-two-users-"))
    path.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.delenv("SHARDLAB_REGISTRY", raising=False)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _become_nobody():
    os.setgid(NOBODY)
    os.setgroups([])
    os.setuid(NOBODY)


def _second_users_python() -> list[str] | None:
    """An interpreter the second user may run that imports shardlab.ranks.owned: this one, else the system's Python of
    the same version with this environment's packages (this one may sit in root's home, closed to others)."""
    import site
    import sysconfig

    paths = os.pathsep.join([str(Path(owned.__file__).parents[1]), sysconfig.get_paths()["purelib"],
                             *site.getsitepackages()])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python, env in ((sys.executable, {}), (shutil.which(version, path="/usr/bin:/usr/local/bin"),
                                                {"PYTHONPATH": paths})):
        if python is None:
            continue
        try:
            probe = subprocess.run([python, "-c", "from shardlab.ranks import owned"],
                                   env={"PATH": os.environ["PATH"]} | env,
                                   capture_output=True, timeout=60, preexec_fn=_become_nobody, cwd="/")
        except OSError:
            continue
        if probe.returncode == 0:
            return [python, env.get("PYTHONPATH", "")]
    return None


def as_nobody(code: str, tmp: Path) -> subprocess.CompletedProcess:
    python = _second_users_python()
    if python is None:
        pytest.skip("no Python here that a second user (nobody) may run with shardlab importable")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "TMPDIR": str(tmp), owned.ORIGIN: os.environ[owned.ORIGIN]}
    if python[1]:
        env["PYTHONPATH"] = python[1]
    return subprocess.run([python[0], "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=_become_nobody, cwd=tmp)


@needs_root
def test_another_users_registry_folder_is_refused_not_trusted(shared_tmp):
    """Another user creates the folder where this user's registry would go, with a record in it naming this
    user's folder: shardlab refuses to use it, says why, and deletes nothing."""
    precious = Path(folders.make_profile_dir("shardlab-mine"))  # a real profile of ours, a tempting target
    out = as_nobody(f"""
import json, os
path = os.path.join({str(shared_tmp)!r}, "shardlab-0-registry")
os.mkdir(path, 0o700)
with open(os.path.join(path, "evil.json"), "w") as f:
    json.dump({{"cluster_id": "evil", "owner_pid": 1, "owner_created": 0.0, "profile_dir": {str(precious)!r},
               "processes": []}}, f)
""", shared_tmp)
    assert out.returncode == 0, out.stderr
    theirs = rf"belongs to user id {NOBODY}, not to you \(0\).*SHARDLAB_REGISTRY"
    with pytest.raises(folders.UnsafeFolder, match=theirs):
        records.clean_stale_clusters()
    assert precious.exists()


@needs_root
def test_a_second_user_sees_none_of_our_processes_and_stops_nothing(shared_tmp, sleeper):
    """nobody runs what a test session or start_cluster runs: reading our processes' environments is denied
    (AccessDenied, handled), our processes are not theirs, and a record of theirs naming our process and our
    profile folder touches neither."""
    ours = subprocess.Popen(SLEEP, env=os.environ | owned.marked_environment())
    profile = Path(folders.make_profile_dir("shardlab-mine"))
    try:
        created = owned.identity(ours.pid)[1]
        out = as_nobody(f"""
import json
from shardlab.ranks import folders, owned, records, subprocesses
print(json.dumps([p.pid for p in owned.leftover_processes()]))
records.Record("shardlab-theirs", 1, 0.0, {str(profile)!r}, [({ours.pid}, {created})]).save()
print(records.clean_stale_clusters())
""", shared_tmp)
        assert out.returncode == 0, out.stderr[-2000:]
        found, cleaned = out.stdout.split()
        assert json.loads(found) == [] and cleaned == "1"  # it has returned: whatever it stopped has exited
        assert ours.poll() is None and profile.exists()
    finally:
        ours.kill()
        ours.wait()
