"""A class on one shared node (INSTRUCTORS.md, "A class on one shared node"): two learner accounts share one
environment (this checkout's .venv), each runs `make kernel-user` and starts ranks of its own from that kernel, both
clusters at once, their first starts through the class's start gate (one slot: the second waits, naming the first).

It creates two temporary Unix users, so it runs only as root with the opt-in (SHARDLAB_SYSTEM_SETUP=1, `sudo make
test-system`, CI), and removes them, their processes and their files whatever happens. Where the environment's
Python lies under a folder other users cannot enter (a Python installed in root's home: pyenv's), the two users are
granted passage through those folders only, by a POSIX ACL entry naming them, taken off again at the end: a class's
real shared environment is made from a Python every learner can run (/usr/bin/python3.11, /opt/...)."""

import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

import machine_changes
from shardlab.ranks import bringup

ROOT = Path(__file__).resolve().parents[2]
ACL = "system.posix_acl_access"
# The learner's side, run as each user: a kernel from the spec `make kernel-user` installed, a 2-rank cluster started
# in it, a collective on its ranks; then it waits for the test's go, stops the cluster and says what is left.
LEARNER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import start_new_kernel

    out, cells = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    spec = KernelSpecManager().get_kernel_spec("shardlab")
    km, kc = start_new_kernel(kernel_name="shardlab", startup_timeout=120)
    said = []

    def hear(msg):
        content = msg["content"]
        said.append(content.get("text") or content.get("data", {}).get("text/plain", "") or "")

    def run(code):
        reply = kc.execute_interactive(code, timeout=300, output_hook=hear)
        if reply["content"]["status"] != "ok":
            raise SystemExit(f"{code!r} failed: {reply['content'].get('evalue')}: {''.join(said)[-3000:]}")

    try:
        run(cells["start"])
        line = next(line for text in said for line in text.splitlines() if line.startswith("RESULT "))
        result = json.loads(line.removeprefix("RESULT "))
        result |= {"kernel": spec.argv[0], "spec": spec.resource_dir, "said": "".join(said)}
        (out / "ready.json").write_text(json.dumps(result))
        ends = time.monotonic() + 300
        while not (out / "go").exists() and time.monotonic() < ends:
            time.sleep(0.2)
        run(cells["stop"])
        (out / "stopped.txt").write_text("".join(said))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
""")
# What the learner's kernel runs: a notebook's first cell, a collective on the ranks, and the last cell.
CELLS = {"start": textwrap.dedent("""
    import json, shardlab as sl
    cluster = sl.start_cluster(2, keep_warm=False)
    cluster.run("import torch, torch.distributed as dist\\n"
                "t = torch.tensor([float(dist.get_rank() + 1)]); dist.all_reduce(t); total = t.item()")
    print("RESULT", json.dumps({"pids": [s["pid"] for s in cluster.states],
                                "totals": cluster.view.pull("total", block=True)}))
"""), "stop": "cluster.stop(); print('LEFT', cluster.alive_processes())"}

pytestmark = [pytest.mark.multirank, pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and machine_changes.setup_allowed()),
    reason="creates two temporary Unix users: runs as root with SHARDLAB_SYSTEM_SETUP=1 (`sudo make test-system`, "
           "what CI runs)")]


def _acl(entries: list[tuple[int, int, int]]) -> bytes:
    """A POSIX access ACL as the kernel stores it (linux/posix_acl_xattr.h): version 2, then (tag, perm, id)."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries)


def _closed_folders(*paths: Path) -> list[Path]:
    """The folders above ``paths`` (their real locations) that other users cannot pass through."""
    closed = []
    for path in paths:
        for folder in reversed(Path(os.path.realpath(path)).parents):
            if not os.stat(folder).st_mode & stat.S_IXOTH and folder not in closed:
                closed.append(folder)
    return closed


def _let_through(folders: list[Path], uids: list[int], granted: list[tuple[Path, int]]) -> None:
    """Give ``uids`` passage (x) through ``folders`` with one ACL each, adding (folder, its mode before) to
    ``granted`` as each is done, to put back."""
    for folder in folders:
        mode = stat.S_IMODE(os.stat(folder).st_mode)
        if ACL in os.listxattr(folder):
            raise OSError(f"{folder} already has an ACL: not touched")
        entries = [(0x01, (mode >> 6) & 7, 0xFFFFFFFF), *((0x02, 1, uid) for uid in uids),
                   (0x04, (mode >> 3) & 7, 0xFFFFFFFF), (0x10, ((mode >> 3) & 7) | 1, 0xFFFFFFFF),
                   (0x20, mode & 7, 0xFFFFFFFF)]
        os.setxattr(folder, ACL, _acl(entries))
        granted.append((folder, mode))


def _take_back(granted: list[tuple[Path, int]]) -> None:
    for folder, mode in granted:
        try:
            os.removexattr(folder, ACL)
        except OSError:
            pass
        os.chmod(folder, mode)  # the group bits showed the ACL's mask meanwhile


def _processes_of(uids: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["uids"]):
        with_uids = proc.info["uids"]
        if with_uids is not None and with_uids.real in uids:
            found.append(proc)
    return found


def _files_of(uids: set[int], folder: Path, besides: Path) -> list[str]:
    """Files and folders of ``uids`` in ``folder``, outside ``besides`` (the test's own folder, their homes)."""
    found = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if os.path.join(parent, d) != str(besides)]
        for name in dirs + names:
            path = os.path.join(parent, name)
            try:
                if os.lstat(path).st_uid in uids:
                    found.append(path)
            except OSError:
                pass
    return found


def _pss_mib(pids) -> float:
    """The processes' proportional set size (PSS), summed from /proc/PID/smaps_rollup (INSTRUCTORS.md's command)."""
    total_kib = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total_kib += next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
    return total_kib / 1024


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.2):
    ends = time.monotonic() + timeout_s
    while time.monotonic() < ends:
        if (found := condition()):
            return found
        time.sleep(poll_s)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


def test_two_accounts_share_one_environment_each_with_ranks_of_their_own(no_leftovers):
    base = Path(tempfile.mkdtemp(prefix="shardlab-class-node-"))
    os.chmod(base, 0o755)
    gate = base / "start-gate"
    gate.mkdir(mode=0o1777)
    os.chmod(gate, 0o1777)
    (base / "learner.py").write_text(LEARNER)
    (base / "cells.json").write_text(json.dumps(CELLS))
    names = [f"shl{uuid.uuid4().hex[:8]}" for _ in range(2)]
    made, granted, drivers = [], [], {}
    try:
        for name in names:
            home = base / name
            subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/usr/sbin/nologin",
                            "--user-group", name], check=True, capture_output=True, timeout=60)
            made.append(name)
            home.mkdir(mode=0o700)
            shutil.chown(home, name, name)
        users = {name: _uid(name) for name in names}
        try:
            _let_through(_closed_folders(ROOT / ".venv" / "bin" / "python", ROOT), list(users.values()), granted)
        except OSError as error:
            pytest.skip(f"this checkout's environment lies under a folder other users cannot enter, and passage "
                        f"could not be granted ({error}): a class's shared environment needs a Python every learner "
                        "can run")

        def as_user(name: str, *cmd: str, **kwargs):
            env = {"HOME": str(base / name), "USER": name, "LOGNAME": name, "PATH": os.environ["PATH"],
                   "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "", "JUPYTER_PREFER_ENV_PATH": "0",
                   bringup.START_GATE: str(gate), bringup.START_SLOTS: "1",
                   "SHARDLAB_ORIGIN": os.environ["SHARDLAB_ORIGIN"]}  # the test's: the leftover guard sees them
            uid = users[name]
            return dict(args=list(cmd), cwd=ROOT, env=env, user=uid, group=uid, extra_groups=[], umask=0o022, **kwargs)

        probe = subprocess.run(**as_user(names[0], str(ROOT / ".venv/bin/python"), "-c", "import shardlab, torch"),
                               capture_output=True, text=True, timeout=120)
        if probe.returncode != 0:
            pytest.skip(f"another user cannot use this checkout's environment: {probe.stderr.strip()[-500:]} "
                        "(a class's shared checkout must be readable by every learner: chmod -R o+rX)")
        for name in names:  # each learner installs the kernel spec into their own home, from the shared checkout
            out = subprocess.run(**as_user(name, "make", "-s", "kernel-user"), capture_output=True, text=True,
                                 timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
            (base / name / "out").mkdir()
            shutil.chown(base / name / "out", name, name)

        def start(name: str) -> subprocess.Popen:
            log = open(base / f"{name}.log", "w")
            command = [str(ROOT / ".venv/bin/python"), str(base / "learner.py"), str(base / name / "out"),
                       str(base / "cells.json")]
            return subprocess.Popen(**as_user(name, *command, stdout=log, stderr=subprocess.STDOUT))

        first, second = names
        drivers[first] = start(first)
        # The second learner starts once the first holds the only start slot: it must wait, and say for whom.
        slot = gate / "slot-0"
        _wait_for(lambda: slot.exists() and any(h.startswith(f"{first} ") for h in bringup.slot_holders([slot])),
                  240, f"start slot held by {first}")
        drivers[second] = start(second)
        ready = {name: _wait_for(lambda n=name: _ready(base / n / "out", drivers[n], base / f"{n}.log"), 420,
                                 f"cluster of {name}") for name in names}
        # Both clusters are up at once, every engine owned by its learner, each cluster's collective its own.
        for name in names:
            engines = [psutil.Process(pid) for pid in ready[name]["pids"]]
            assert [e.uids().real for e in engines] == [users[name]] * 2, name
            assert all(e.is_running() for e in engines), name
            assert ready[name]["totals"] == [3.0, 3.0], ready[name]
            assert Path(ready[name]["spec"]) == base / name / ".local/share/jupyter/kernels/shardlab"
            assert Path(ready[name]["kernel"]) == ROOT / ".venv/bin/python"
        assert not set(ready[first]["pids"]) & set(ready[second]["pids"])
        assert f"held by {first} (pid" in ready[second]["said"], ready[second]["said"][-2000:]
        for name in names:
            print(f"{name}: kernel and 2 ranks, PSS {_pss_mib(p.pid for p in _processes_of({users[name]})):.0f} MiB "
                  "(summed from /proc/PID/smaps_rollup)")
        for name in names:
            (base / name / "out" / "go").touch()
        for name in names:
            assert drivers[name].wait(timeout=180) == 0, (base / f"{name}.log").read_text()[-3000:]
            assert "LEFT []" in (base / name / "out" / "stopped.txt").read_text()
        uids = set(users.values())
        left = _wait_for(lambda: not _processes_of(uids) and ["none"], 30, "end of the learners' processes")
        assert left == ["none"]
        # What stays by design, as for any user: the (empty) registry of their clusters, and PyTorch's compile cache.
        temp = Path(tempfile.gettempdir())
        registries = {str(temp / f"shardlab-{uid}-registry") for uid in uids}
        caches = tuple(str(temp / f"torchinductor_{name}") for name in names)
        left_files = [f for f in _files_of(uids, temp, base)
                      if f not in registries and not f.startswith(caches)]  # a record left in a registry counts
        assert not left_files, f"the learners' ranks left files in the temp folder: {left_files[:10]}"
    finally:
        for proc in drivers.values():
            if proc.poll() is None:
                proc.kill()
        uids = {_uid(name) for name in made}
        for proc in _processes_of(uids):  # only processes of the two users this test made
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(_processes_of(uids), timeout=10)
        for path in _files_of(uids, Path(tempfile.gettempdir()), base):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else Path(path).unlink(missing_ok=True)
        _take_back(granted)
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
    for name in made:
        assert subprocess.run(["id", name], capture_output=True).returncode != 0, f"user {name} is still there"


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def _ready(out: Path, driver: subprocess.Popen, log: Path):
    if (out / "ready.json").exists():
        return json.loads((out / "ready.json").read_text())
    if driver.poll() is not None:
        raise AssertionError(f"the learner's kernel exited with {driver.returncode}: {log.read_text()[-3000:]}")
    return None
