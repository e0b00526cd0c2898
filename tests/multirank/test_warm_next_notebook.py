"""Warm clusters (shardlab.ranks.warm) on real ranks: the next notebook gets the same ranks with nothing of the
previous one visible. The pool's rules without ranks: tests/unit/test_warm.py."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import shardlab as sl
from shardlab.ranks import owned, records, warm

# -- on real ranks -----------------------------------------------------------------------------------------------

# The previous notebook: it leaves every kind of state behind on 2 ranks, notes what a rank held before a large
# tensor, then stops (parks) its cluster.
PREVIOUS_NOTEBOOK = textwrap.dedent("""
    import json, sys
    import shardlab as sl
    cluster = sl.start_cluster(n=2, device="cpu", activate=False)
    cluster.run('''
    import os, sys, psutil, torch, torch.distributed as dist
    fresh_draw = torch.rand(3).tolist()
    from physicsnemo.domain_parallel import ShardTensor
    series_handlers = {name: len(getattr(ShardTensor, name)) for name in ("_dispatch_registry",
                       "_named_function_registry", "_function_registry")}
    x = 41
    sys.shardlab_old_groups = [dist.group.WORLD, dist.new_group([0, 1])]
    def f(t):
        return t * 2 + 1
    compiled = torch.compile(f, backend="eager")
    compiled(torch.ones(3))
    sys.shardlab_compiled_code = f.__code__
    compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ShardTensor.register_named_function_handler("shardlab.test.extra", lambda *args: None)
    torch.rand(5)
    os.environ["SHARDLAB_TEST_LEFTOVER"] = "1"
    rss_before_tensor = psutil.Process().memory_info().rss
    big = torch.ones(128 * 2**20)  # 512 MiB
    rss_with_tensor = psutil.Process().memory_info().rss
    ''')
    pull = ["fresh_draw", "series_handlers", "compiled_graphs", "rss_before_tensor", "rss_with_tensor"]
    print(json.dumps({"pids": [s["pid"] for s in cluster.states], **{k: cluster.view.pull(k) for k in pull}}))
    cluster.stop()
    assert cluster.parked and not cluster.alive_processes()
""")

AFTER_RESET = """
import os, sys, tempfile, psutil, torch, torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
defined = dir()
variables_left = [name for name in ("x", "big", "f", "compiled") if name in defined]
old_groups_unknown = []
for group in sys.shardlab_old_groups:
    try:
        dist.get_process_group_ranks(group)
        old_groups_unknown.append(False)
    except KeyError:
        old_groups_unknown.append(group is not dist.group.WORLD)
world = torch.ones(1)
dist.all_reduce(world)
counters = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if v}
cache_entries = len(torch._dynamo.eval_frame._debug_get_cache_entry_list(sys.shardlab_compiled_code))
handlers = {name: len(getattr(ShardTensor, name)) for name in ("_dispatch_registry", "_named_function_registry",
            "_function_registry")}
extra_handler = "shardlab.test.extra" in ShardTensor._named_function_registry
leftover_variable = "SHARDLAB_TEST_LEFTOVER" in os.environ
# mpiexec's own variables (PMIX_SYSTEM_TMPDIR) keep naming the folder it started in: the ranks never initialise MPI.
old_temp_folder = [name for name, value in os.environ.items() if PREVIOUS_TEMP in value and not name.startswith(
    ("PMIX_", "OMPI_", "PRTE_"))]
temp_folder = tempfile.gettempdir()
first_draw = torch.rand(3).tolist()
rss = psutil.Process().memory_info().rss
"""


@pytest.mark.multirank
def test_the_next_notebook_gets_the_same_ranks_with_nothing_of_the_previous_one(no_leftovers, tmp_path, capsys):
    pool = warm.Pool.create(os.environ[owned.ORIGIN], idle_s=30)  # the processes count as this test's
    previous_temp = tmp_path / "previous-notebook"  # the previous kernel's temp folder, removed after it
    previous_temp.mkdir()
    env = os.environ | {warm.POOL: str(pool.folder), "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(previous_temp)}
    try:
        out = subprocess.run([sys.executable, "-c", PREVIOUS_NOTEBOOK], env=env, capture_output=True, text=True,
                             timeout=400)
        assert out.returncode == 0, out.stderr[-3000:]
        before = json.loads(out.stdout.strip().splitlines()[-1])
        assert [p.shape["n"] for p in pool.parked()] == [2]
        other = warm.Pool.create(os.environ[owned.ORIGIN], idle_s=30)
        try:
            assert warm.claim(other, pool.parked()[0].shape) is None  # another session's pool does not see it
        finally:
            other.stop()

        os.environ[warm.POOL] = str(pool.folder)  # this process is the next notebook's kernel
        try:
            cluster = sl.start_cluster(n=2, device="cpu", activate=False, timeout_s=20)
        finally:
            del os.environ[warm.POOL]
        with capsys.disabled():
            print(f"\n[measured] second start_cluster(n=2): ranks ready in {cluster.start_seconds:.1f} s, attached "
                  f"({cluster.timings}); the target is 5 s on a quiet 2-core machine")
        assert cluster.attached and [s["pid"] for s in cluster.states] == before["pids"]  # the same processes
        assert [s["rank"] for s in cluster.states] == [0, 1] and {s["timeout_s"] for s in cluster.states} == {20}
        cluster.view.push({"PREVIOUS_TEMP": str(previous_temp)})
        cluster.run(AFTER_RESET, 120)
        got = {name: cluster.view.pull(name) for name in ("variables_left", "old_groups_unknown", "counters",
               "cache_entries", "handlers", "extra_handler", "leftover_variable", "old_temp_folder", "temp_folder",
               "first_draw", "world.item()", "rss")}
        assert got["variables_left"] == [[], []]
        # torch.distributed no longer knows the old groups (world and subgroup); the new world works.
        assert got["old_groups_unknown"] == [[True, True]] * 2 and got["world.item()"] == [2.0, 2.0]
        assert min(before["compiled_graphs"]) >= 1  # there was a compiled graph to forget
        assert got["counters"] == [{}, {}] and got["cache_entries"] == [0, 0]
        assert got["handlers"] == before["series_handlers"] and got["extra_handler"] == [False, False]
        assert got["leftover_variable"] == [False, False]
        assert got["old_temp_folder"] == [[], []]  # e.g. torch's compile cache folder, set at import
        assert got["temp_folder"] == [tempfile.gettempdir()] * 2  # files go where this kernel expects them
        assert got["first_draw"] == before["fresh_draw"]  # what a new rank draws first
        # The 512 MiB tensor is given back: every rank within 64 MiB of what it held before it.
        for rank, (held, with_tensor, now) in enumerate(zip(before["rss_before_tensor"], before["rss_with_tensor"],
                                                            got["rss"])):
            assert with_tensor - held > 500 * 2**20, "the tensor was not resident: the check would prove nothing"
            assert now - held < 64 * 2**20, f"rank {rank}: {(now - held) / 2**20:.0f} MiB more than before the tensor"

        # Parked again, the cluster stops by itself once its idle time (30 s here) is up.
        processes = cluster._record.processes
        cluster.stop()
        assert cluster.parked and pool.parked() and owned.alive(processes)
        deadline = time.monotonic() + 120
        while (owned.alive(processes) or records.records_in(pool.folder)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not owned.alive(processes), "the parked cluster outlived its idle time"
        assert not pool.parked() and not records.records_in(pool.folder)
        assert [p.name for p in pool.folder.iterdir()] == [warm.SETTINGS]  # its profile went with it
    finally:
        pool.stop()
