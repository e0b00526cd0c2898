"""`make test` changes nothing outside the checkout and the temp folder unless asked (`make test-system`).

conftest.py compares the machine before and after every run (tests/support/machine_changes.py). Here a run of the
real conftest plants, under a stand-in for ``/``, what the opt-in set-up does to a machine (a package in dpkg's
status file, /etc/slurm/slurm.conf, a daemon from sbin) and must fail, naming each; with the opt-in it passes and
lists them. The tests that need Slurm or MPICH, without the opt-in, run or skip and leave the machine as it was."""

import configparser
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

import machine_changes
from browser_support import find_chromium

ROOT = Path(__file__).resolve().parents[2]
PLANT = textwrap.dedent("""
    import os, subprocess
    from pathlib import Path

    def test_sets_the_machine_up():
        root = Path(os.environ["SHARDLAB_MACHINE_ROOT"])
        with open(root / "var/lib/dpkg/status", "a") as status:
            status.write("\\nPackage: slurm-wlm\\nStatus: install ok installed\\nArchitecture: amd64\\n"
                         "Version: 22.05\\n")
        (root / "etc/slurm").mkdir()
        (root / "etc/slurm/slurm.conf").write_text("ClusterName=planted\\n")
        (root / "etc/hosts").write_text("127.0.0.1 planted\\n")
        # as scripts/local-slurm.sh starts its daemons: a clean environment, a session of its own
        subprocess.Popen([str(root / "usr/sbin/planted-slurmd"), "300"], env={}, start_new_session=True)
""")


def plugins_turned_off() -> str:
    """``-p no:NAME`` for each plugin pytest.ini turns off: the inner runs start as fast as the outer one."""
    config = configparser.ConfigParser()
    config.read(ROOT / "pytest.ini")
    words = config["pytest"]["addopts"].split()
    return " ".join(f"-p {name}" for option, name in zip(words, words[1:]) if option == "-p" and name.startswith("no:"))


def inner_run(tmp: Path, test_source: str, env: dict, user: tuple | None = None) -> subprocess.CompletedProcess:
    """pytest, in a process of its own, over one test file, with this repository's conftest.py as its plugin."""
    (tmp / "test_inner.py").write_text(test_source)
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", "SHARDLAB_ORIGIN"))}  # a session of its own
    env |= {"PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_ADDOPTS": plugins_turned_off()}
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rs", "test_inner.py"]
    if user:
        command = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", *command]
        env |= {"HOME": str(tmp), "TMPDIR": str(tmp)}
    return subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def fake_root(tmp: Path) -> Path:
    root = tmp / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text("Package: bash\nStatus: install ok installed\nArchitecture: amd64\n"
                                              "Version: 5.2\n")
    (root / "usr/sbin").mkdir(parents=True)
    shutil.copy(shutil.which("sleep"), root / "usr/sbin/planted-slurmd")
    return root


def stop_planted(root: Path) -> None:
    for proc in psutil.process_iter(["exe"]):
        if (proc.info["exe"] or "").startswith(str(root)):
            proc.send_signal(signal.SIGKILL)


@pytest.fixture
def shared_tmp():
    """A temp folder another user can work in too (pytest's own are owner-only), removed at the end."""
    tmp = Path(tempfile.mkdtemp(prefix="shardlab-machine-changes-"))
    tmp.chmod(0o777)
    yield tmp
    shutil.rmtree(tmp)


AS_ROOT, AS_A_USER = "as this user", "as a normal user"


@pytest.mark.parametrize("who", [AS_ROOT, AS_A_USER])
def test_a_run_that_changes_the_machine_fails_and_says_what_changed(shared_tmp, who):
    user = None
    if who == AS_A_USER:
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            pytest.skip("runs the session as nobody: needs root and setpriv")
        user = (65534, 65534)
    root = fake_root(shared_tmp)
    if user:
        shutil.chown(root / "etc", *user)
        shutil.chown(root / "etc/hosts", *user)
        shutil.chown(root / "var/lib/dpkg/status", *user)
    env = {k: v for k, v in os.environ.items() if k != machine_changes.SYSTEM_SETUP}
    env[machine_changes.ROOT_VARIABLE] = str(root)
    try:
        out = inner_run(shared_tmp, PLANT, env, user)
    finally:
        stop_planted(root)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-3000:]
    assert "1 passed" in said, said[-3000:]  # the test itself passed: the session failed for what it changed
    failure = next(line for line in said.splitlines() if line.startswith("FAILED: this run changed the machine"))
    assert "without SHARDLAB_SYSTEM_SETUP=1" in failure
    assert "installed slurm-wlm:amd64" in failure
    assert f"created {root}/etc/slurm, {root}/etc/slurm/slurm.conf" in failure
    assert f"modified {root}/etc/hosts" in failure
    assert f"started daemons {root}/usr/sbin/planted-slurmd (pid " in failure


def test_with_the_opt_in_the_run_may_set_the_machine_up_and_lists_what_it_did(tmp_path):
    root = fake_root(tmp_path)
    env = os.environ | {machine_changes.ROOT_VARIABLE: str(root), machine_changes.SYSTEM_SETUP: "1"}
    try:
        out = inner_run(tmp_path, PLANT, env)
    finally:
        stop_planted(root)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "This run set the machine up (SHARDLAB_SYSTEM_SETUP=1): installed slurm-wlm:amd64" in said


NEEDS = textwrap.dedent("""
    import pytest

    @pytest.mark.slurm
    def test_needs_slurm():
        pass

    @pytest.mark.mpich
    def test_needs_mpich():
        pass
""")


def test_without_the_opt_in_slurm_and_mpich_tests_run_or_skip_saying_how_to_enable_them(tmp_path):
    """On the real machine: whatever it has is used, nothing is installed or started (the inner run's own
    before/after check would fail it), and what is missing is one skip line naming the opt-in."""
    env = {k: v for k, v in os.environ.items() if k not in (machine_changes.SYSTEM_SETUP, "SHARDLAB_TEST_SLURM")}
    def slurm_status():  # 0 when a Slurm of the script is up, its two nodes or its one
        return min(subprocess.run(["bash", str(ROOT / "scripts/local-slurm.sh"), "status", *nodes],
                                  capture_output=True).returncode for nodes in ([], ["--nodes", "2"]))

    for _ in range(3):  # under `make test-system` the other worker may be bringing the local Slurm up meanwhile
        slurm_up = slurm_status()
        out = inner_run(tmp_path, NEEDS, env)
        if slurm_status() == slurm_up:
            break
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    skipped = [line for line in said.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == (slurm_up != 0) + (shutil.which("mpiexec.mpich") is None), said[-3000:]
    assert all(line.endswith("`sudo make test-system` sets this machine up for them (SHARDLAB_SYSTEM_SETUP=1)")
               for line in skipped), skipped
    if slurm_up != 0:
        assert any("`sudo make slurm-start` starts one" in line for line in skipped)
    if not shutil.which("mpiexec.mpich"):
        assert any("MPICH's mpiexec.mpich is not installed: `sudo apt-get install mpich`" in line for line in skipped)


def test_without_a_chromium_the_browser_test_skips_saying_how_to_get_one(tmp_path, monkeypatch):
    class NoPlaywrightBrowser:
        class chromium:
            executable_path = str(tmp_path / "not-downloaded" / "chrome")

    monkeypatch.setattr("browser_support.CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv(machine_changes.SYSTEM_SETUP, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"no Chromium: `sudo apt-get install --no-install-recommends "
                                                    r"chromium`, or `.*playwright install chromium`, or "
                                                    r"`sudo make test-system`"):
        find_chromium(NoPlaywrightBrowser)
