"""Ranks end with their kernel (shardlab.ranks.warden), on real clusters: started in a child process that is then
killed (SIGKILL included), as the OOM killer or a crash kills a kernel, their controller, launcher and engines end
within 10 s; a parked cluster's ranks end with its keeper. Every kill here goes to a pid this test started. With
sleepers, no ranks: tests/unit/test_ranks_end_with_their_kernel.py."""

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gone import ENDS_WITHIN_S, wait_gone
from shardlab.ranks import owned, records, warden, warm

# -- real clusters, their owner killed ------------------------------------------------------------------------------

OWNER = """
import json, sys
from shardlab.ranks.cluster import RankCluster
cluster = RankCluster(n=int(sys.argv[1]), keep_warm=sys.argv[2] == "park").start()
record = {"cluster_id": cluster.cluster_id, "record": str(cluster._record.path),
          "profile": cluster.profile_dir, "processes": cluster._record.processes}
if sys.argv[2] == "park":
    cluster.stop()  # parked: its keeper owns it now, and this process exits
print("cluster:", json.dumps(record), flush=True)
if sys.argv[2] != "park":
    sys.stdin.read()  # until the test kills it
"""


def _start_owner(n: int, how: str, env: dict) -> tuple[subprocess.Popen, dict]:
    """A process that starts an ``n``-rank cluster (``how``: "own" keeps it, "park" parks it and exits) and prints
    what it started."""
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OWNER), str(n), how], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in owner.stdout] + [lines.put("")], daemon=True).start()
    deadline, said = time.monotonic() + 300, []
    with contextlib.suppress(queue.Empty):
        while line := lines.get(timeout=max(0.0, deadline - time.monotonic())):  # "": it exited
            if line.startswith("cluster: "):
                return owner, json.loads(line.removeprefix("cluster: "))
            said.append(line)
    owner.kill()
    owner.wait()
    pytest.fail(f"the {n}-rank cluster did not start within 300 s, or its owner exited ({owner.returncode}); it "
                f"said: {''.join(said)[-2000:]}")


def _everything_of(started: dict) -> list[tuple[int, float]]:
    """What must end: the processes the cluster recorded, and every process marked with its id (its warden too)."""
    marked = [owned.identity(p.pid) for p in warden.marked_processes(started["cluster_id"])]
    return sorted({tuple(p) for p in started["processes"]} | set(marked))


@pytest.mark.multirank
@pytest.mark.parametrize("ranks, sig", [(2, signal.SIGKILL), (4, signal.SIGKILL), (2, signal.SIGTERM)],
                         ids=["2-SIGKILL", "4-SIGKILL", "2-SIGTERM"])
def test_a_killed_kernels_ranks_end_within_10_s(no_leftovers, ranks, sig):
    env = {k: v for k, v in os.environ.items() if k != warm.POOL}
    owner, cluster = _start_owner(ranks, "own", env)
    try:
        everything = _everything_of(cluster)
        commands = [p.cmdline() for p in owned.alive(everything)]
        assert sum(c[1:3] == ["-m", "ipyparallel.engine"] for c in commands) == ranks, commands  # nannies aside
        for what in ("ipyparallel.controller", "shardlab.ranks.warden"):
            assert any(what in c for c in commands), (what, commands)
        assert any(Path(c[0]).name in ("mpiexec", "prterun") for c in commands), commands
        owner.send_signal(sig)
        killed = time.monotonic()
        owner.wait(timeout=30)
        left = wait_gone(everything, killed)
        assert not left, f"{ranks} ranks: still running {ENDS_WITHIN_S:.0f} s after {sig.name} to the owner: {left}"
        print(f"[measured] {len(everything)} processes of a {ranks}-rank cluster ended "
              f"{time.monotonic() - killed:.1f} s after {sig.name} to its owner")
        assert not Path(cluster["record"]).exists() and not Path(cluster["profile"]).exists()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@pytest.mark.multirank
def test_a_parked_clusters_ranks_end_with_its_keeper(no_leftovers, tmp_path):
    """A parked cluster's owner is its keeper: killed, the cluster ends as a kernel's does."""
    pool = warm.Pool.create(owned.origin(), idle_s=600)
    try:
        owner, cluster = _start_owner(2, "park", os.environ | {warm.POOL: str(pool.folder)})
        owner.wait(timeout=120)
        [parked] = pool.parked()
        keeper = owned.same_process(*parked.keeper)
        assert keeper is not None and records.load_record(Path(cluster["record"])).owner_pid == keeper.pid
        everything = _everything_of(cluster)
        assert len(owned.alive(everything)) > 2 + 2  # engines, controller, launcher, warden (the keeper is not of it)
        keeper.kill()  # the keeper is no child of this test: it ends, and its parent has exited, so nothing waits
        killed = time.monotonic()
        left = wait_gone(everything, killed)
        assert not left, f"still running {ENDS_WITHIN_S:.0f} s after the keeper was killed: {left}"
        print(f"[measured] a parked cluster ended {time.monotonic() - killed:.1f} s after its keeper was killed")
    finally:
        pool.stop()
