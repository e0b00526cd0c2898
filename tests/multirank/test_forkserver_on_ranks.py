"""Engines forked from an imported parent (shardlab.ranks.forkserver), on a real server and a real mpiexec: the parent
never holds a thread, CUDA or a zmq context; a forked rank has exactly the environment its launcher gave it; signals,
exit codes and output reach the launcher as a launched rank's do; a rank's engine ends with its stub and with the
server; a cluster's forked engines leave nothing after stop() or a killed server. Every kill goes to a pid this test
started or found under a server it started."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from shardlab.ranks import commands, forkserver, forkstub, owned
from shardlab.ranks.cluster import RankCluster

pytestmark = pytest.mark.multirank
WAIT_S = 120.0

# A rank that says who it is, then waits for the word (a file) or a signal.
RANK = """
import json, os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
def said(sig, frame):
    print(f"rank got {sig}", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, said)
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "x")
(folder / f"env-{rank}-{os.getpid()}.json").write_text(json.dumps(dict(os.environ)))
print(f"out of rank {rank}", flush=True)
print(f"err of rank {rank}", file=sys.stderr, flush=True)
deadline = time.monotonic() + 120
while not (folder / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


@pytest.fixture
def server(no_leftovers):
    """A fork server in an owner-only folder of its own, its rank program written there: (folder, server process)."""
    folder = Path(tempfile.mkdtemp(prefix="sl-fork-"))  # short: a Unix socket's path stops at 107 bytes
    (folder / "rank.py").write_text(textwrap.dedent(RANK))
    pid, created = forkserver.start(folder, os.environ | owned.marked_environment() | {"CUDA_VISIBLE_DEVICES": ""})
    proc = owned.same_process(pid, created)
    assert proc is not None and forkserver.socket_path(folder).exists()
    try:
        yield folder, proc
    finally:
        owned.stop(owned.alive([(pid, created)]), 3.0)
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def _stub(folder: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([*forkserver.stub_command(folder), str(folder / "rank.py"), str(folder)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | env)


def _engines(server: psutil.Process) -> list[psutil.Process]:
    return [p for p in server.children() if p.status() != psutil.STATUS_ZOMBIE]


def _wait(what, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (found := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_the_parent_holds_no_thread_no_cuda_and_no_zmq_context_after_its_imports():
    """What the server imports, in a fresh interpreter, with its import settings: then one thread, CUDA not
    initialised (nor its driver loaded), no zmq context; else forking would copy locks no thread releases."""
    code = ("import os, sys, zmq; from shardlab.ranks import forkserver; print(forkserver.preload()); import torch; "
            "print(len(os.listdir('/proc/self/task')), torch.cuda.is_initialized(), zmq.Context._instance, "
            "all(m in sys.modules for m in forkserver.PRELOAD))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S,
                          env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert done.stdout.split("\n")[:2] == ["[]", "1 False None True"], (done.stdout, done.stderr[-2000:])


def test_a_forked_rank_has_exactly_its_launchers_environment_and_output(server):
    folder, proc = server
    job = subprocess.Popen([*commands.job_command("openmpi", 2, str(folder / "rank.py"), str(folder))], text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           env=os.environ | commands.mpi_environment() | {"CUDA_VISIBLE_DEVICES": ""})
    stubbed = subprocess.Popen(commands.job_command("openmpi", 2, *forkserver.stub_command(folder)[1:],
                                                    str(folder / "rank.py"), str(folder)),
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               env=os.environ | commands.mpi_environment() | {"CUDA_VISIBLE_DEVICES": ""})
    try:
        assert _wait(lambda: len(list(folder.glob("env-*.json"))) == 4), list(folder.iterdir())
        forked = {p.pid for p in _engines(proc)}
        assert len(forked) == 2
        stubs = [p for p in psutil.Process(stubbed.pid).children(recursive=True)
                 if "forkstub.py" in " ".join(p.cmdline())]
        given = {s.environ()["OMPI_COMM_WORLD_RANK"]: s.environ() for s in stubs}  # what the launcher gave each rank
        seen = {}
        for path in folder.glob("env-*.json"):
            _, rank, pid = path.stem.split("-")
            seen[(int(pid) in forked, rank)] = json.loads(path.read_text())
        for rank in ("0", "1"):
            assert seen[(True, rank)] == given[rank]  # forked: exactly its launcher's, OMPI_* and PMIX_* included
            direct = seen[(False, rank)]
            assert set(seen[(True, rank)]) == set(direct)  # the same variables as a rank launched directly
            for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"):
                assert seen[(True, rank)][name] == direct[name]
        (folder / "go").touch()
        outs = [p.communicate(timeout=WAIT_S) for p in (job, stubbed)]
        assert job.returncode == stubbed.returncode == 0
        for out, err in outs:
            assert sorted(out.split("\n"))[-2:] == ["out of rank 0", "out of rank 1"], out
            assert "err of rank 0" in err and "err of rank 1" in err, err
    finally:
        for p in (job, stubbed):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_exit_codes_and_signals_reach_the_launcher_as_a_launched_ranks_do(server):
    folder, proc = server
    (folder / "go").touch()
    ended = _stub(folder, EXIT_CODE="3")
    assert ended.wait(timeout=WAIT_S) == 3
    (folder / "go").unlink()
    told = _stub(folder)
    assert _wait(lambda: len(list(folder.glob("env-*.json"))) == 2)
    told.send_signal(signal.SIGTERM)  # forwarded: the engine's handler runs, and its exit code comes back
    out, _ = told.communicate(timeout=WAIT_S)
    assert told.returncode == 7 and f"rank got {signal.SIGTERM.value}" in out
    killed = _stub(folder)
    [engine] = _wait(lambda: _engines(proc))
    engine.send_signal(signal.SIGUSR1)  # an engine killed by a signal: its stub ends by the same signal
    assert killed.wait(timeout=WAIT_S) == -signal.SIGUSR1


def test_a_killed_stub_takes_its_engine_and_a_killed_server_its_engines(server):
    folder, proc = server
    stubs = [_stub(folder) for _ in range(2)]
    engines = _wait(lambda: found if len(found := _engines(proc)) == 2 else [])
    stubs[0].kill()  # SIGKILL: nothing forwarded, the engine sees its stub's end of the connection close
    stubs[0].wait()
    assert _wait(lambda: [e for e in engines if not e.is_running()], 10)
    proc.kill()  # the server: its engines die with it, and their stubs end
    assert psutil.wait_procs(engines, timeout=10)[1] == []
    assert stubs[1].wait(timeout=10) != 0


def test_a_clusters_engines_are_forked_and_nothing_is_left_after_stop_or_a_killed_server(no_leftovers, monkeypatch):
    monkeypatch.delenv(forkserver.FORK_ENGINES, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for kill_server in (False, True):
        cluster = RankCluster(n=2, keep_warm=False).start()
        try:
            rows = cluster.run("import os, psutil; from shardlab.ranks import forkchild; "
                               "_row = (os.getppid(), forkchild.started_environment()['OMPI_COMM_WORLD_RANK'], "
                               "os.environ['OMPI_COMM_WORLD_RANK'], psutil.Process().cmdline()[1:3])")
            assert rows is not None
            seen = cluster.view.pull("_row")
            [server] = {parent for parent, *_ in seen}
            assert "shardlab.ranks.forkserver" in " ".join(psutil.Process(server).cmdline())
            # The environment it started with is its launcher's (what a warm reset goes back to), not its server's.
            assert [list(row[1:]) for row in seen] == [["0", "0", ["-m", "ipyparallel.engine"]],
                                                 ["1", "1", ["-m", "ipyparallel.engine"]]]
            assert {"fork server", "rank 0 engine", "rank 1 engine"} <= {r["process"] for r in cluster.memory()}
            if kill_server:
                psutil.Process(server).kill()
                engines = [psutil.Process(s["pid"]) for s in cluster.states]
                assert psutil.wait_procs(engines, timeout=10)[1] == []
        finally:
            cluster.stop()
        assert not cluster.alive_processes()


JOB = """
import json, os, sys, time
import psutil
from shardlab.ranks import commands, launch
def done(path):
    try:
        return json.loads(open(path).read()) is not None
    except (OSError, ValueError):
        return False
info = launch.detect_launch()
if info.rank == 0:
    launch.write_job_result({"parent": psutil.Process(os.getppid()).cmdline(), "launcher": info.launcher,
                             "world": info.world_size})
if info.rank == info.world_size - 1:  # fails only once rank 0's result is in: torchrun stops the others at a failure
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not done(os.environ[commands.RESULT_FILE]):
        time.sleep(0.02)
    sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


@pytest.mark.parametrize("launcher", ["openmpi", "torchrun"])
def test_run_job_forks_its_ranks_and_its_launcher_reports_as_before(no_leftovers, monkeypatch, tmp_path, launcher):
    """A job's ranks come from a fork server of its own, launcher detection reads the launcher's variables, and a rank
    that fails makes the job fail with the exit code the launcher gives without the fork server."""
    from shardlab.ranks import launch

    monkeypatch.delenv(forkserver.FORK_ENGINES, raising=False)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = launch.run_job(launcher, 2, script, timeout_s=WAIT_S, device="cpu")
    assert "shardlab.ranks.forkserver" in done.result["parent"], done.result
    assert done.result["launcher"] == launcher and done.result["world"] == 2
    codes = {}
    for fork in ("1", "0"):
        monkeypatch.setenv(forkserver.FORK_ENGINES, fork)
        failed = launch.run_job(launcher, 2, script, timeout_s=WAIT_S, device="cpu", env={"EXIT_CODE": "3"},
                                check=False)
        codes[fork] = failed.returncode
        assert ("shardlab.ranks.forkserver" in failed.result["parent"]) == (fork == "1")
    assert codes["1"] == codes["0"] != 0, codes


def test_a_connection_the_launcher_hands_over_by_number_follows_the_rank(server):
    """MPICH's hydra hands each rank its PMI connection as an inherited file whose number is in PMI_FD: a forked rank
    has it under the same number."""
    folder, _ = server
    (folder / "pmi.py").write_text("import os; os.write(int(os.environ['PMI_FD']), b'from the rank')\n")
    read, write = os.pipe()
    try:
        stub = subprocess.Popen([*forkserver.stub_command(folder), str(folder / "pmi.py")], pass_fds=[write],
                                env=os.environ | {"PMI_FD": str(write)}, stderr=subprocess.PIPE, text=True)
        os.close(write)
        assert stub.wait(timeout=WAIT_S) == 0, stub.stderr.read()
        assert "without the fork server" not in stub.stderr.read()
        assert os.read(read, 100) == b"from the rank"
    finally:
        os.close(read)


# What a rank on a Slurm node runs: its parent's pid and command line, then it exits with the code it was given.
NODE_RANK = ("import os, sys, psutil; print(os.getppid(), psutil.Process(os.getppid()).cmdline()[2:]); "
             "sys.exit(int(sys.argv[1]))")


def test_on_a_slurm_node_the_first_stub_starts_the_nodes_server_which_ends_after_its_engines(tmp_path, no_leftovers):
    """What srun starts for a step on each node: stubs that ask ``@node``, with no process of the kernel's node to
    serve them. However many race to start the node's server, one serves: every rank is forked from it and exits with
    its own code; then the server ends by itself (the stub that started it may end first, and Slurm stop tracking
    it). The same with SLURM_STEP_ID of another step: a server of its own."""
    program = tmp_path / "rank.py"
    program.write_text(NODE_RANK)
    stub = forkserver.stub_command(tmp_path, on_other_nodes=True)
    for step in ("0", "1"):
        env = os.environ | owned.marked_environment() | {"SLURM_JOB_ID": f"test{os.getpid()}", "SLURM_STEP_ID": step,
                                                          "CUDA_VISIBLE_DEVICES": ""}
        name = forkstub.node_server_name(env)
        stubs = [subprocess.Popen([*stub, str(program), str(code)], env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE) for code in range(4)]
        done = [s.communicate(timeout=WAIT_S) for s in stubs]
        assert [s.returncode for s in stubs] == [0, 1, 2, 3], done
        parents = {out.strip() for out, _ in done}
        assert len(parents) == 1 and parents.pop().endswith(str(["shardlab.ranks.forkserver", name])), done
        assert not any(err for _, err in done), done  # no stub fell back
        assert _wait(lambda name=name: not _servers_named(name), 10.0), "the node's server outlived its engines"


def _servers_named(name: str) -> list[psutil.Process]:
    """Live processes whose last argument is ``name`` (read with the listing: one that ends meanwhile is skipped)."""
    return [proc for proc in psutil.process_iter(["cmdline", "status"])
            if (proc.info["cmdline"] or [])[-1:] == [name] and proc.info["status"] != psutil.STATUS_ZOMBIE]
