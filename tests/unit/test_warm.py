"""Warm clusters (shardlab.ranks.warm), with records and keepers and no ranks: a parked cluster is claimed once, by
the next kernel of its pool only; expired or orphaned ones are stopped; the keeper stops its cluster when idle. Real
ranks taken over by the next notebook: tests/multirank/test_warm_next_notebook.py."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.ranks import folders, owned, rankstate, records, warm

SHAPE = warm.shape_of(2, "cpu", "mpi", "openmpi", "127.0.0.1", None)


def _parked(pool, cluster_id, parked_by, keeper, deadline_s=60.0, shape=SHAPE):
    """A parked marker and its (process-less) record, as ``warm.park`` leaves them."""
    records.Record(cluster_id, *keeper, profile_dir="", folder=str(pool.folder)).save()
    warm.Parked(str(pool.folder / f"{cluster_id}{warm.PARKED}"), cluster_id, shape, parked_by,
                time.time() + deadline_s, keeper).save()


def _me():
    return list(owned.identity())


def _other_kernel():
    return list(owned.identity(os.getppid()))


def test_a_cluster_parked_by_another_kernel_of_the_pool_is_claimed_once(pool):
    _parked(pool, "shardlab-a", _other_kernel(), keeper=_me())
    assert warm.claim(pool, SHAPE | {"n": 4}) is None  # another shape
    record = warm.claim(pool, SHAPE)
    assert record.cluster_id == "shardlab-a" and [record.owner_pid, record.owner_created] == _me()
    assert records.load_record(record.path).owner_pid == os.getpid()  # the claiming kernel owns it now
    assert pool.parked() == [] and warm.claim(pool, SHAPE) is None  # gone from the pool: nobody else gets it


def test_a_kernel_never_claims_what_it_parked_itself(pool):
    _parked(pool, "shardlab-own", _me(), keeper=_me())
    assert warm.claim(pool, SHAPE) is None  # stop() then start_cluster() in one notebook asks for new ranks
    warm.evict_own(pool, SHAPE)  # ...and the fresh start stops the ranks it will not use again
    assert pool.parked() == [] and not records.records_in(pool.folder)


def test_another_pool_or_another_users_pool_is_never_used(pool, tmp_path):
    _parked(pool, "shardlab-b", _other_kernel(), keeper=_me())
    other = warm.Pool.create("another-session", idle_s=60)
    try:
        assert warm.claim(other, SHAPE) is None  # another JupyterLab or test session of the same user
    finally:
        other.stop()
    assert [p.cluster_id for p in pool.parked()] == ["shardlab-b"]
    pool.folder.chmod(0o755)
    with pytest.raises(folders.UnsafeFolder, match="open to other users"):
        warm.Pool(pool.folder)
    pool.folder.chmod(0o700)
    if os.getuid() == 0:
        os.chown(pool.folder, 12345, 12345)
        with pytest.raises(folders.UnsafeFolder, match="belongs to user id 12345"):
            warm.Pool(pool.folder)
        os.chown(pool.folder, 0, 0)


def test_expired_or_orphaned_parked_clusters_are_stopped_by_the_next_start(pool):
    _parked(pool, "shardlab-expired", _other_kernel(), keeper=_me(), deadline_s=-1)
    _parked(pool, "shardlab-orphan", _other_kernel(), keeper=[1, 0.0])  # its keeper is gone
    _parked(pool, "shardlab-fresh", _other_kernel(), keeper=_me())
    assert pool.clean_up() == 2
    assert [p.cluster_id for p in pool.parked()] == ["shardlab-fresh"]
    assert [r.cluster_id for r in records.records_in(pool.folder)] == ["shardlab-fresh"]


def test_the_keeper_stops_its_cluster_when_the_idle_time_is_up_and_leaves_when_claimed(pool):
    _parked(pool, "shardlab-idle", _other_kernel(), keeper=_me(), deadline_s=0.5)
    warm.keep(pool.folder / f"shardlab-idle{warm.PARKED}", poll_s=0.1)  # returns once it stopped the cluster
    assert pool.parked() == [] and not records.records_in(pool.folder)
    _parked(pool, "shardlab-claimed", _other_kernel(), keeper=_me())
    assert warm.claim(pool, SHAPE) is not None
    keeper = subprocess.run([sys.executable, "-m", "shardlab.ranks.warm", "keep",  # a process of its own, as park's
                             str(pool.folder / f"shardlab-claimed{warm.PARKED}")], timeout=60)
    assert keeper.returncode == 0  # the marker is gone and the record names the claimant: it exits at once
    assert [r.cluster_id for r in records.records_in(pool.folder)] == ["shardlab-claimed"]  # the claimant's now


def test_run_gives_the_command_a_pool_and_removes_it_after(tmp_path):
    show = [sys.executable, "-c", f"import os; print(os.environ.get({warm.POOL!r}, 'none'))"]
    out = subprocess.run([sys.executable, "-m", "shardlab.ranks.warm", "run", "--idle-s", "60", "--", *show],
                         capture_output=True, text=True, timeout=60, env=os.environ | {"TMPDIR": str(tmp_path)})
    folder = Path(out.stdout.strip())
    assert out.returncode == 0 and folder.parent == tmp_path and not folder.exists(), out
    off = subprocess.run([sys.executable, "-m", "shardlab.ranks.warm", "run", "--idle-s", "0", "--", *show],
                         capture_output=True, text=True, timeout=60)
    assert off.stdout.strip() == "none"  # keeping warm off: no pool


def test_restore_registry_removes_new_handlers_and_puts_back_replaced_ones():
    """What a reset (and lesson 10's exercise check) does to ShardTensor's handler registries: a handler registered
    since the snapshot is gone, one it replaced is back, by function and by name, in every registry."""
    import torch
    from physicsnemo.domain_parallel import ShardTensor

    from shardlab.exercises.nb10 import registered_handler
    from shardlab.models import DIFFUSE

    before = rankstate.registry_snapshot()
    series_roll = ShardTensor._function_registry.get(torch.roll)

    def learner_patch(func, types, args, kwargs):
        return None

    ShardTensor.register_function_handler(DIFFUSE, learner_patch)
    ShardTensor.register_named_function_handler(str(DIFFUSE), learner_patch)
    ShardTensor.register_function_handler(torch.roll, learner_patch)  # replaces the series' handler, if any
    ShardTensor.register_dispatch_handler(DIFFUSE, learner_patch)
    assert registered_handler() is learner_patch
    rankstate.restore_registry(before)
    assert rankstate.registry_snapshot() == before
    assert registered_handler() is None
    assert ShardTensor._function_registry.get(torch.roll) is series_roll
