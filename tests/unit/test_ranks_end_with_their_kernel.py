"""Ranks end with their kernel (shardlab.ranks.warden), with sleepers standing in for a cluster's processes (no
ranks, seconds): once the owner is gone what the cluster recorded ends, and nothing of another owner's is touched;
a stopped, handed-over or claimed cluster's warden follows its record. Real clusters killed:
tests/multirank/test_ranks_end_with_their_kernel_on_ranks.py."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gone import ENDS_WITHIN_S, running, wait_gone
from shardlab.ranks import folders, owned, records, warden

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


@pytest.fixture
def started():
    """Popen of a process this test starts; each is killed and reaped at the end, whatever happened."""
    children: list[subprocess.Popen] = []

    def start(cmd=SLEEP, **env) -> subprocess.Popen:
        children.append(subprocess.Popen(cmd, env=os.environ | owned.marked_environment() | env))
        return children[-1]

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)


def _cluster_of_sleepers(started, profile_dir: str, owner: subprocess.Popen) -> tuple[records.Record, list]:
    """A record owned by ``owner`` listing one sleeper, one more sleeper only marked with the cluster's id (a start cut
    short before recording it), and its warden: (record, identities of all three)."""
    recorded, marked = started(), started(**warden.marked_environment("shardlab-doomed"))
    record = records.Record("shardlab-doomed", *owned.identity(owner.pid), profile_dir,
                          [owned.identity(recorded.pid)])
    record.save()
    watcher = warden.start(record, os.environ | owned.marked_environment())
    return record, [owned.identity(recorded.pid), owned.identity(marked.pid), watcher]


def test_a_dead_owners_cluster_ends_and_nothing_else_does(registry, started):
    owner = started()
    profile = folders.make_profile_dir("shardlab-doomed")
    record, doomed = _cluster_of_sleepers(started, profile, owner)
    # Bystanders: another cluster's marked process, another live owner's recorded one, an unmarked process of ours.
    other_cluster, unmarked = started(**warden.marked_environment("shardlab-other")), started()
    other_record = started()
    records.Record("shardlab-alive", *owned.identity(), "/nonexistent", [owned.identity(other_record.pid)]).save()

    owner.send_signal(signal.SIGKILL)  # not reaped yet: a zombie owner is no owner
    killed = time.monotonic()
    left = wait_gone(doomed, killed)
    assert not left, f"still running {ENDS_WITHIN_S:.0f} s after the owner was killed: {left}"
    assert all(p.poll() is None for p in (other_cluster, unmarked, other_record))
    assert not record.path.exists() and not Path(profile).exists()
    assert [r.cluster_id for r in records.records_in()] == ["shardlab-alive"]


def test_a_cluster_stopped_by_its_owner_lets_its_warden_go(registry, started, tmp_path):
    record, (_, _, watcher) = _cluster_of_sleepers(started, str(tmp_path), started())
    record.clean_up(grace_s=1.0)  # what cluster.stop() does
    left = wait_gone([watcher], time.monotonic())
    assert not left, f"the warden outlived its cluster's record: {left}"


def test_a_cluster_handed_over_follows_its_new_owner(registry, started, tmp_path):
    """A cluster parked (its keeper the owner) or claimed (the claiming kernel): the old owner's end stops nothing,
    the new owner's does."""
    first, second = started(), started()
    record, doomed = _cluster_of_sleepers(started, str(tmp_path), first)
    record.owner_pid, record.owner_created = owned.identity(second.pid)
    record.save()
    first.kill()
    first.wait()
    time.sleep(4 * warden.POLL_S)  # the warden reads the record every POLL_S: let it see the first owner gone
    assert len(running(doomed)) == 3 and record.path.exists()
    second.kill()
    killed = time.monotonic()
    left = wait_gone(doomed, killed)
    assert not left, f"still running {ENDS_WITHIN_S:.0f} s after the new owner was killed: {left}"


def test_a_claimed_clusters_keeper_waits_until_the_record_names_the_claimant(registry, tmp_path):
    """warm.keep's last step: the keeper stays the owner until the claimant has saved itself as the new one, so the
    warden never sees a cluster without a live owner in between."""
    keeper = owned.identity()
    record = records.Record("shardlab-claimed", *keeper, str(tmp_path))
    record.save()

    def claimant_saves():
        time.sleep(0.5)
        record.owner_pid, record.owner_created = owned.identity(os.getppid())
        record.save()

    saver = threading.Thread(target=claimant_saves)
    saver.start()
    assert warden.handed_over(record.path, keeper, timeout_s=30)
    assert records.load_record(record.path).owner_pid == os.getppid()  # it returned only after the save
    saver.join()
    record.owner_pid, record.owner_created = keeper
    record.save()
    assert not warden.handed_over(record.path, keeper, timeout_s=0.3)  # a claimant that never saved: it gives up
