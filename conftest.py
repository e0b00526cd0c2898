"""Shared by every pytest run in this repository, `pytest --nbmake notebooks/` included: test
categories (markers), and the guard that fails a run which leaves cluster or launcher processes
behind. The guard only sees processes started from this run (they inherit its SHARDLAB_ORIGIN),
so a learner's open cluster or another user's MPI job is never reported, let alone killed.

Tests marked ``slurm`` need a Slurm, ``two_nodes`` its two-node mode, ``mpich`` MPICH's mpiexec, the browser test
Chromium. They run where the machine already has them (a Slurm of scripts/local-slurm.sh that is up, single-node or
two-node, ``mpiexec.mpich`` on PATH, a Chromium), and otherwise skip with one line that says how to enable them.
Only with SHARDLAB_SYSTEM_SETUP=1 (``make test-system``, what CI runs) does the run set the machine up:
the first such test starts the two-node Slurm with scripts/local-slurm.sh (which installs Debian's
packages where missing), once per run (a file lock keeps two xdist workers from doing it twice), and
the run stops it at the end, and fails if its namespaces, interfaces or mounts outlive the stop. Without it, a run
that changed the machine outside the checkout and the temp folder fails (tests/support/machine_changes.py).

Notebooks attach to warm ranks: each process that runs tests (each xdist worker) has a pool of warm clusters
(shardlab.ranks.warm) that tests/support/notebook_runner.py gives the notebooks it runs, so a notebook's
``sl.start_cluster()`` reuses, after a reset, the ranks the previous notebook of the same size stopped; the pool is
stopped at the end. ``SHARDLAB_TEST_WARM=off`` makes every notebook start its own ranks. Every other test (faults,
Slurm, MPICH, restarts, the cluster's start and stop, kernels started by tests) sees no pool: it starts fresh ranks."""

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from shardlab.ranks import folders, owned, records, warm

# Everything this session starts (kernels, clusters, launched jobs) inherits this origin; xdist workers
# share their controller's. shardlab.ranks.owned reads it whenever it is asked.
# What kernels, Jupyter, matplotlib and Warp would otherwise write into the user's home (IPython history, connection
# files, font and kernel caches) goes to a folder of the session in the temp folder, removed at its end.
USER_STATE = {"IPYTHONDIR": "ipython", "JUPYTER_RUNTIME_DIR": "jupyter-runtime", "MPLCONFIGDIR": "matplotlib",
              "WARP_CACHE_PATH": "warp"}
if not os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ[owned.ORIGIN] = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.environ["SHARDLAB_TEST_USER_STATE"] = tempfile.mkdtemp(prefix="shardlab-test-user-state-")
    for variable, folder in USER_STATE.items():
        os.environ.setdefault(variable, os.path.join(os.environ["SHARDLAB_TEST_USER_STATE"], folder))
SESSION_ORIGIN = os.environ[owned.ORIGIN]

sys.path.insert(0, str(Path(__file__).parent / "tests" / "support"))  # what the tests share
import fresh_python as fresh_python_module  # noqa: E402
import machine_changes  # noqa: E402
import tiers  # noqa: E402

collect_ignore_glob = ["tests/fixtures/*"]  # meant to fail: tests/notebooks/test_negative_notebooks.py runs them
CATEGORIES = ("unit", "multirank", "notebook", "browser", "bench", "gpu")
LOCAL_SLURM = Path(__file__).parent / "scripts" / "local-slurm.sh"
SLURM_STATE = Path("/run/shardlab-slurm")
MACHINE_BEFORE = pytest.StashKey[machine_changes.Snapshot]()
_needs: dict[str, str | None] = {}  # "slurm"/"mpich" -> None when usable, else why not (once per process)
_slurm_found: dict = {}  # nodes and shared folder of the Slurm found up or started (once per process)
WARM_POOL_FOR_NOTEBOOKS = "SHARDLAB_TEST_WARM_POOL"
ENABLE = f"`sudo make test-system` sets this machine up for them ({machine_changes.SYSTEM_SETUP}=1)"


def _local_slurm(*command: str) -> tuple[int, str, str]:
    """Run scripts/local-slurm.sh COMMAND: its exit code, stdout, and the last line of stderr."""
    out = subprocess.run(["bash", str(LOCAL_SLURM), *command], capture_output=True, text=True,
                         env=os.environ | {"SHARDLAB_ORIGIN": SESSION_ORIGIN}, timeout=600)
    said = (out.stderr.strip().splitlines() or ["(no message)"])[-1].removeprefix("local-slurm: ")
    return out.returncode, out.stdout.strip(), said


@contextlib.contextmanager
def _setting_up():
    """Held while a worker looks for a Slurm and starts one: the other worker waits, then finds it up."""
    with open(Path(tempfile.gettempdir()) / f"shardlab-{folders.user_id()}-local-slurm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _slurm() -> tuple[int, str | None, str]:
    """(nodes, shared folder, why not) of the Slurm the tests use, once per process: scripts/local-slurm.sh's two
    nodes, else its single node, each when up; with the opt-in, two nodes started here (one where two cannot
    start); else (0, None, why not)."""
    if "slurm" in _needs:
        return _slurm_found.get("nodes", 0), _slurm_found.get("shared"), _needs["slurm"] or ""
    with _setting_up():
        code, shared, said = _local_slurm("status", "--nodes", "2")
        if code == 0:
            _slurm_found.update(nodes=2, shared=shared)
        elif _local_slurm("status")[0] == 0:
            _slurm_found.update(nodes=1, shared=None)
        elif machine_changes.setup_allowed():
            code, _, said = _local_slurm("start", "--nodes", "2")
            if code == 0:
                _slurm_found.update(nodes=2, shared=_local_slurm("status", "--nodes", "2")[1])
            else:  # e.g. no network namespaces here: one node still runs the other Slurm tests
                _slurm_found["two_nodes_why"] = f"scripts/local-slurm.sh could not start two nodes here: {said}"
                _local_slurm("stop")
                code, _, said = _local_slurm("start")
                if code == 0:
                    _slurm_found.update(nodes=1, shared=None)
                else:
                    said = f"no Slurm here: {said}"
        elif code != 3:
            said = f"{said}: `sudo make slurm-start` starts one, or {ENABLE}"
    _needs["slurm"] = None if "nodes" in _slurm_found else said
    return _slurm()


def _why_not(need: str) -> str | None:
    """None when this machine has what tests marked ``need`` use, else one line: why not, and how to enable it.
    Only with the opt-in does it install or start anything (scripts/local-slurm.sh start installs MPICH too)."""
    if os.environ.get("SHARDLAB_TEST_SLURM") == "off":
        return "SHARDLAB_TEST_SLURM=off"
    if need == "mpich":
        if "mpich" not in _needs:
            if not shutil.which("mpiexec.mpich") and machine_changes.setup_allowed():
                _slurm()  # scripts/local-slurm.sh start installs MPICH too
            _needs[need] = None if shutil.which("mpiexec.mpich") else (
                f"MPICH's mpiexec.mpich is not installed: `sudo apt-get install mpich`, or {ENABLE}")
        return _needs[need]
    nodes, _, why = _slurm()
    if need == "two_nodes" and nodes == 1:
        return _slurm_found.get("two_nodes_why") or (
            "the Slurm of scripts/local-slurm.sh that is up has one node: `sudo scripts/local-slurm.sh stop`, then "
            f"`sudo scripts/local-slurm.sh start --nodes 2` starts two, or {ENABLE}")
    return why or None


@pytest.fixture
def slurm_setup_lock():
    """Held for the test's length: no worker looks for or starts the session's Slurm meanwhile."""
    with _setting_up():
        yield


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A private cluster registry for the test, so the user's real one is never touched."""
    path = tmp_path / "registry"
    monkeypatch.setenv("SHARDLAB_REGISTRY", str(path))
    return path


def _left_of_the_nodes() -> list[str]:
    """The two-node Slurm's namespaces, interfaces and mounts still there (after its stop: none)."""
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout  # noqa: E731
    names = run("ip", "netns", "list").split() + run("ip", "-o", "link").replace("@", " ").replace(":", " ").split()
    mounts = Path("/proc/self/mounts").read_text().split()
    return sorted({n for n in names if n.startswith(("shardlab-node", "sh-node", "shardlab-br"))}
                  | {m for m in mounts if m.startswith(str(SLURM_STATE))})


def pytest_runtest_setup(item):
    for need in ("slurm", "two_nodes", "mpich"):
        if item.get_closest_marker(need) and (why := _why_not(need)):
            pytest.skip(why)


@pytest.fixture(autouse=True)
def _on_the_slurm(request, monkeypatch):
    """A test marked ``slurm`` on two nodes gets their shared folder (SHARDLAB_SHARED_DIR), as a user of a cluster
    sets it, and shares the nodes with the other worker's Slurm tests; one marked ``whole_slurm`` (a node taken
    down) has them to itself."""
    if not request.node.get_closest_marker("slurm"):
        yield
        return
    nodes, shared, _ = _slurm()
    if shared:
        monkeypatch.setenv("SHARDLAB_SHARED_DIR", shared)
    alone = request.node.get_closest_marker("whole_slurm") is not None
    with open(Path(tempfile.gettempdir()) / f"shardlab-{folders.user_id()}-slurm-nodes.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


def wait_for_no_leftovers(timeout_s: float = 15.0, of_origin: str | None = None) -> list:
    """This session's (or one test's) processes still alive after timeout_s (engines take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while (left := owned.leftover_processes(of_origin)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="session", autouse=True)
def warm_pool():
    """This process's pool of warm clusters, for the notebooks its tests run (``WARM_POOL_FOR_NOTEBOOKS`` names it to
    tests/support/notebook_runner.py), stopped at the end; its processes are marked as the session's, not any test's."""
    if os.environ.get("SHARDLAB_TEST_WARM") == "off":
        yield None
        return
    pool = warm.Pool.create(f"{SESSION_ORIGIN}/warm-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", idle_s=900)
    os.environ[WARM_POOL_FOR_NOTEBOOKS] = str(pool.folder)
    try:
        yield pool
    finally:
        del os.environ[WARM_POOL_FOR_NOTEBOOKS]
        pool.stop()


@pytest.fixture(scope="session")
def fresh_python():
    """A fresh CPU-only interpreter per probe, in a fraction of a second (tests/support/fresh_python.py), with none
    of the launcher variables of whatever runs pytest (mpirun, srun, torchrun)."""
    env = {k: v for k, v in os.environ.items() if k not in fresh_python_module.LAUNCH_VARIABLES
           and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PHYSICSNEMO_"))}
    with fresh_python_module.FreshPython(env | {"CUDA_VISIBLE_DEVICES": ""}) as server:
        yield server


def clusters_in_use(pool) -> list[records.Record]:
    """The pool's clusters that are not parked: a notebook that never stopped its cluster (a parked one is fine)."""
    if pool is None or not pool.folder.exists():
        return []
    parked = {p.cluster_id for p in pool.parked()}
    return [r for r in records.records_in(pool.folder) if r.cluster_id not in parked]


@pytest.fixture
def no_leftovers(request, monkeypatch, warm_pool):
    """Fail the test if it leaves engine, controller or launcher processes behind, or a cluster of the warm pool
    running that it did not stop (park).

    What the test starts gets an origin of its own, nested in the session's, so that tests running
    side by side (pytest -n 2) never count each other's processes."""
    mine = f"{os.environ[owned.ORIGIN]}/{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(owned.ORIGIN, mine)
    yield
    left = wait_for_no_leftovers(of_origin=mine)
    assert not left, f"processes left behind by {request.node.nodeid}: {_describe(left)}"
    in_use = clusters_in_use(warm_pool)
    for record in in_use:
        record.clean_up(grace_s=1.0)
    assert not in_use, f"{request.node.nodeid} left clusters of the warm pool running: {[r.cluster_id for r in in_use]}"


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """A warm pool of this test's own (shardlab.ranks.warm), in its temporary folder; stopped at the end."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the pool's folder goes there
    made = warm.Pool.create(owned.origin(), idle_s=60)
    yield made
    made.stop()


def _describe(processes) -> list:
    described = []
    for p in processes:
        try:
            described.append((p.pid, " ".join(p.cmdline())[:120]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            described.append((p.pid, "(gone)"))
    return described


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("notebook") is None and item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)  # nbmake's items
        marked = [name for name in CATEGORIES if item.get_closest_marker(name)]
        if not marked:
            if "no_leftovers" in getattr(item, "fixturenames", ()):
                raise pytest.UsageError(f"{item.nodeid} starts processes: mark it multirank, notebook, browser "
                                        "or bench")
            if tiers.in_a_slow_folder(item.path):
                raise pytest.UsageError(f"{item.nodeid} is a unit test (no ranks, seconds) in a folder of slower "
                                        "tests: move it to tests/unit/, or mark it multirank, notebook, browser "
                                        "or bench")
            item.add_marker(pytest.mark.unit)
    # The slowest kinds first: with several workers, the run then ends on short tests, not on one long tail. Among
    # them, tests of one world size next to each other: each worker runs a block, and a notebook attaches to the
    # ranks the previous one parked only when their sizes match.
    # The one-node Slurm's own lifecycle runs before the session's Slurm starts (it needs the machine to itself).
    first = ("slurm_lifecycle", "slurm", "notebook", "browser", "bench", "multirank")
    items.sort(key=lambda item: (next((i for i, name in enumerate(first) if item.get_closest_marker(name)), len(first)),
                                 getattr(item, "callspec", None) and item.callspec.params.get("ranks", 0) or 0))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[MACHINE_BEFORE] = machine_changes.snapshot()


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # under xdist only the controller checks, once every worker is done
    left = wait_for_no_leftovers()
    if left:
        names = _describe(left)
        owned.stop(left)
        print(f"\nFAILED: this run left processes behind (now stopped): {names}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(os.environ["SHARDLAB_TEST_USER_STATE"], ignore_errors=True)  # nothing of the session writes now
    try:
        started_here = (SLURM_STATE / "started-by").read_text().strip() == SESSION_ORIGIN
    except OSError:
        started_here = False
    if started_here:  # a Slurm this run started is stopped by it; one that was up before is left running
        code, _, said = _local_slurm("stop")
        if code != 0:
            print(f"\nscripts/local-slurm.sh stop failed: {said}")
        if left := _left_of_the_nodes():
            print(f"\nFAILED: scripts/local-slurm.sh stop left {left}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if MACHINE_BEFORE in session.config.stash:
        changed = machine_changes.compare(session.config.stash[MACHINE_BEFORE], machine_changes.snapshot())
        if changed and machine_changes.setup_allowed():
            print(f"\nThis run set the machine up ({machine_changes.SYSTEM_SETUP}=1): " + "; ".join(changed))
        elif changed:
            print(f"\nFAILED: this run changed the machine outside the checkout and the temp folder, without "
                  f"{machine_changes.SYSTEM_SETUP}=1: " + "; ".join(changed))
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
