"""Each test asserts that an upstream bug behind a shardlab workaround is STILL there.

When one fails, upstream has fixed the bug: delete the workaround (and the test) as the
assertion message says. Every check runs in an interpreter of its own (a fork of one that
imported torch and PhysicsNeMo, fresh_python.py), because the bugs depend on import-time and
process-group state that a test process cannot undo.
"""

import json
import os
import subprocess
import sys

import pytest

from shardlab.ranks.launch import free_port

TIMEOUT_S = 120


def _single_rank_env() -> dict:
    # World size 1 is enough: the device_id check happens before any rendezvous with peers.
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def test_1936_cpu_process_group_init_still_fails_upstream(fresh_python):
    result = fresh_python.run(
        """
        from physicsnemo.distributed import DistributedManager
        DistributedManager.initialize()
        """,
        **_single_rank_env(),
    )
    assert result.returncode != 0, (
        "upstream fixed physicsnemo #1936: delete cpu_safe_process_group_init from shardlab/workarounds.py"
    )
    assert "ValueError" in result.stderr and "device_id" in result.stderr, (
        "DistributedManager.initialize() on CPU now fails differently than #1936; check it:\n" + result.stderr[-3000:]
    )


def test_1936_workaround_gives_a_gloo_group(fresh_python):
    result = fresh_python.run(
        """
        import datetime
        import torch.distributed as dist
        from physicsnemo.distributed import DistributedManager
        from shardlab.workarounds import cpu_safe_process_group_init
        with cpu_safe_process_group_init(datetime.timedelta(seconds=10)):
            DistributedManager.initialize()
        print("BACKEND", dist.get_backend())
        import os
        print("NCCL", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), os.environ.get("TORCH_NCCL_BLOCKING_WAIT"))
        """,
        **_single_rank_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BACKEND gloo" in result.stdout
    assert "NCCL 0 None" in result.stdout, (
        "upstream no longer sets TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in DistributedManager.initialize(): delete "
        "nccl_errors_raise from shardlab/workarounds.py (check that a skipped NCCL collective raises without it)"
    )


def test_nccl_workaround_is_in_place_when_the_group_is_created(fresh_python):
    result = fresh_python.run(
        """
        import datetime, os
        import torch.distributed as dist
        from physicsnemo.distributed import DistributedManager
        from shardlab import workarounds
        seen = {}
        real = dist.init_process_group
        def spy(*args, **kwargs):  # what the environment holds at the moment the group is created
            seen.update({k: os.environ.get(k) for k in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT")})
            return real(*args, **kwargs)
        dist.init_process_group = spy
        with workarounds.cpu_safe_process_group_init(datetime.timedelta(seconds=10)), workarounds.nccl_errors_raise():
            DistributedManager.initialize()
        print("SEEN", seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"], seen["TORCH_NCCL_BLOCKING_WAIT"])
        """,
        **_single_rank_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # CleanUpOnly (2): the watchdog aborts the communicator, the engine lives; no blocking wait, so the watchdog exists.
    assert "SEEN 2 0" in result.stdout, result.stdout


def test_shard_ops_still_unregistered_on_cpu_upstream(fresh_python):
    # torch.sum's handler is what register_custom_ops() adds (custom_ops/_reductions.py);
    # checking the registry rather than a module name survives upstream file moves.
    result = fresh_python.run(
        """
        import torch
        import physicsnemo.domain_parallel as dp
        before = torch.sum in dp.ShardTensor._function_registry
        from shardlab.workarounds import register_shard_ops_on_cpu
        register_shard_ops_on_cpu()
        after = torch.sum in dp.ShardTensor._function_registry
        print("REGISTERED", before, after)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REGISTERED" in result.stdout, result.stdout
    before, after = result.stdout.split("REGISTERED")[1].split()
    assert before == "False", (
        "upstream fixed physicsnemo.domain_parallel registering its custom ops only with CUDA: "
        "delete register_shard_ops_on_cpu from shardlab/workarounds.py"
    )
    assert after == "True", "register_shard_ops_on_cpu() no longer registers the ShardTensor handler for torch.sum"


REGISTERED = """
import importlib, json
import physicsnemo.domain_parallel as dp
from shardlab import workarounds
ST = dp.ShardTensor
registries = (ST._dispatch_registry, ST._function_registry, ST._named_function_registry)
name = lambda k: f"{getattr(k, '__module__', '')}.{getattr(k, '__qualname__', None) or getattr(k, '__name__', k)}"
keys = lambda: sorted(name(k) for registry in registries for k in registry)
workarounds.register_shard_ops_on_cpu()
print("SERIES", json.dumps(keys()))
for module in ("knn", "mesh_ops", "natten_patches", "point_cloud_ops"):
    importlib.import_module(f"physicsnemo.domain_parallel.shard_utils.{module}")
print("COVERED", json.dumps(keys()))
workarounds.register_shard_ops_on_cpu(everything=True)
print("FULL", json.dumps(keys()))
"""


def test_the_series_registers_every_handler_but_the_point_cloud_ones(fresh_python):
    """One interpreter registers the series' handlers, then the point-cloud ones the series skips, then everything
    upstream's register_custom_ops() registers: the last step must add nothing."""
    result = fresh_python.run(REGISTERED)
    assert result.returncode == 0, result.stderr[-3000:]
    keys = {line.split(" ", 1)[0]: set(json.loads(line.split(" ", 1)[1])) for line in result.stdout.splitlines()
            if line.startswith(("SERIES ", "COVERED ", "FULL "))}
    assert keys["SERIES"] and keys["COVERED"] == keys["FULL"], (
        "upstream's register_custom_ops() registers handlers that neither SERIES_SHARD_WRAPPERS nor the skipped "
        f"point-cloud modules cover: {sorted(keys['FULL'] - keys['COVERED'])}; add their module "
        "to SERIES_SHARD_WRAPPERS in shardlab/workarounds.py")


SUBMESH_HASH = """
import sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=int(sys.argv[1]), world_size=4, store=FakeStore())
domain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ddp", "domain"))["domain"]  # CPU-only: no comms
print("HASH", domain.mesh.tolist(), domain._stable_hash())
"""


def test_submeshes_of_different_ranks_still_share_a_cache_key_upstream(fresh_python):
    """Ranks 0 and 2 are in different domain groups ([0, 1] and [2, 3]): their submeshes should hash apart."""
    seen = []
    for rank in (0, 2):
        result = fresh_python.run(SUBMESH_HASH, [str(rank)], TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]
        seen.append(result.stdout.split("HASH", 1)[1].split())
    assert seen[0][:2] != seen[1][:2]  # different ranks...
    assert seen[0][-1] == seen[1][-1], (
        "upstream: submeshes of different ranks now hash apart (pytorch/pytorch#173789). Check ShardTensor's "
        "cache key too, then delete no_cross_rank_autograd_cache from shardlab/workarounds.py"
    )


def test_ipykernel_install_still_leaves_an_empty_folder_in_the_temp_folder(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run([sys.executable, "-m", "ipykernel", "install", "--prefix", str(tmp_path / "prefix"),
                             "--name", "probe"], env=os.environ | {"TMPDIR": str(temp)}, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name.endswith("_kernels") for p in temp.iterdir()] == [True], (
        "upstream: ipykernel install no longer leaves a tmp*_kernels folder behind: install the kernel without "
        "the temp folder of its own (install_kernel in the Makefile)")


def test_physicsnemo_still_puts_a_rank_on_cuda_local_rank():
    import inspect

    from physicsnemo.distributed import DistributedManager

    source = inspect.getsource(DistributedManager.setup)
    assert 'f"cuda:{manager.local_rank}"' in source, (
        "DistributedManager.setup no longer picks cuda:{local_rank}: check whether a rank with one visible GPU and "
        "local rank 1 (srun --gpus-per-task=1) now gets cuda:0, and if so delete gpu_of_this_rank from "
        "shardlab/workarounds.py")


def test_the_nccl_settings_mean_what_the_docstring_says():
    """The installed torch's ProcessGroupNCCL: 2 is CleanUpOnly (abort communicators, keep the process), and blocking
    wait turns the watchdog off; the messages the docstring and tests quote are in the library."""
    import mmap
    from pathlib import Path

    import torch

    root = Path(torch.__file__).parent
    header = (root / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp").read_text()
    assert "CleanUpOnly = 2" in header and "abort communicators without\n// tearing down process" in header
    library = root / "lib" / "libtorch_cuda.so"
    if not library.exists():
        pytest.skip("a CPU-only build of torch: no NCCL, nothing to check against")
    with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for text in (b"TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created.",
                     b"Watchdog caught collective operation timeout: ", b"NCCL communicator was aborted on rank ",
                     b" Original reason for failure was: ", b"NCCL communicator was aborted after a previous error"):
            assert data.find(text) >= 0, text


def test_shard_tensor_backward_still_turns_torch_functions_off_so_checkpoints_need_the_workaround(fresh_python):
    """A checkpointed block's recompute, inside ``ShardTensor.backward``: without the workaround it runs with torch
    functions off (ShardTensor's handlers skipped), with ``recompute_with_shard_tensor_handlers`` on."""
    result = fresh_python.run(
        """
        import json
        import torch
        import shardlab as sl
        from physicsnemo.domain_parallel import scatter_tensor
        from torch.distributed.tensor import Shard
        from torch.utils.checkpoint import checkpoint
        from shardlab.workarounds import recompute_with_shard_tensor_handlers
        sl.init_distributed(30)
        mesh = sl.build_mesh(ddp=1, domain=1)
        weight = torch.nn.Parameter(torch.ones(1))
        seen = {}
        for name, context in (("upstream", None), ("workaround", recompute_with_shard_tensor_handlers)):
            def block(t, name=name):  # called in forward, then again in backward's recompute
                seen.setdefault(name, []).append(torch._C._is_torch_function_enabled())
                return torch.nn.functional.gelu(t)
            x = scatter_tensor(torch.randn(1, 1, 8, 8), 0, mesh["domain"], (Shard(2),))
            kwargs = {"context_fn": context} if context else {}
            try:
                checkpoint(block, x * weight, use_reentrant=False, **kwargs).sum().backward()
            except RuntimeError as error:  # upstream: the recompute runs through DTensor, on mixed tensors
                seen[name + " error"] = str(error).splitlines()[0][:200]
        print("SEEN", json.dumps(seen))
        sl.ranks.launch.shutdown_distributed()
        """,
        **_single_rank_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.split("SEEN", 1)[1].splitlines()[0])
    assert seen["workaround"] == [True, True] and "workaround error" not in seen, seen
    assert seen["upstream"] == [True, False], (
        "ShardTensor.backward no longer runs backward with torch functions off: delete "
        f"recompute_with_shard_tensor_handlers from shardlab/workarounds.py and its use in levers.py ({seen})")


def test_the_cpu_memory_reporter_still_reports_frees_of_blocks_it_never_saw_allocated(fresh_python):
    result = fresh_python.run(
        """
        import json, torch
        from torch.profiler import ProfilerActivity, profile
        from shardlab.measure.allocations import cpu_allocator_changes

        size = 64 * 2**20  # mapped on its own: freed and allocated again, it comes back at the same address
        for _ in range(10):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                seen = torch.empty(size, dtype=torch.uint8)  # its size recorded
            address = seen.data_ptr()
            del seen  # freed with no profiler running: the size stays recorded
            unseen = torch.empty(size, dtype=torch.uint8)  # allocated with no profiler running
            if unseen.data_ptr() == address:
                break
            del unseen
        else:
            print(json.dumps(None))
            raise SystemExit
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            small = torch.ones(10)
            del unseen, small
        reported = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        print(json.dumps({"reported": reported, "counted": [n for _, n in cpu_allocator_changes(prof)]}))
        """
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    if seen is None:
        pytest.skip("this allocator never gave the same address twice: nothing to observe")
    assert seen["counted"] == [40, -40]  # the workaround counts what the run allocated and freed, nothing else
    assert -64 * 2**20 in seen["reported"], (
        "torch's profiler no longer reports the free of a block it never saw allocated: delete "
        "measure.allocations.cpu_allocator_changes (and this test) and read the '[memory]' events directly")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the boot time is read from /proc/stat on Linux")
def test_psutil_creation_times_still_move_with_the_wall_clock(monkeypatch):
    """psutil #2526/#2541: a creation time read after the wall clock crossed a second differs from one read before."""
    import psutil
    from psutil import _pslinux

    before, boot_time = psutil.Process().create_time(), _pslinux.boot_time
    monkeypatch.setattr(_pslinux, "boot_time", lambda: boot_time() + 1.0)  # NTP moved the clock by 1 s
    assert psutil.Process().create_time() != before, (
        "psutil's creation time no longer follows the wall clock (psutil #2526): delete process_started from "
        "shardlab/workarounds.py and use Process.create_time() in shardlab.ranks.owned")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the boot time is read from /proc/stat on Linux")
def test_a_running_process_is_still_itself_after_the_wall_clock_moved(monkeypatch):
    from psutil import _pslinux

    from shardlab.ranks import owned

    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        try:
            recorded = [owned.identity(), owned.identity(child.pid)]
            boot_time = _pslinux.boot_time
            monkeypatch.setattr(_pslinux, "boot_time", lambda: boot_time() + 1.0)
            assert owned.same_process(*recorded[0]) is not None
            assert [p.pid for p in owned.alive(recorded)] == [os.getpid(), child.pid]
            assert owned.same_process(child.pid, recorded[1][1] - 1.0) is None  # a later process with the pid
        finally:
            child.kill()


def test_a_shard_tensor_mean_still_scales_its_gradient_in_float32(fresh_python):
    """The gradient of a float64 ShardTensor's full mean over 1000 values: upstream's is float32's 1/1000, 5e-8 off;
    ``exact_mean``'s is float64's."""
    result = fresh_python.run(
        """
        import torch
        import shardlab as sl
        from torch.distributed.tensor import Shard
        sl.init_distributed(30)
        mesh = sl.build_mesh(ddp=1, domain=1)
        for name, mean in (("upstream", lambda t: t.mean()), ("workaround", sl.workarounds.exact_mean)):
            leaf = sl.mesh.scatter(torch.ones(1, 1000, 1, dtype=torch.float64), 0, mesh["domain"], (Shard(1),),
                                   requires_grad=True)
            mean(leaf).backward()
            print(name, abs(leaf.grad.to_local()[0, 0, 0].item() * 1000 - 1))
        sl.ranks.launch.shutdown_distributed()
        """,
        **_single_rank_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    off = dict(line.split() for line in result.stdout.splitlines() if line.startswith(("upstream", "workaround")))
    assert float(off["workaround"]) < 1e-15, off
    assert float(off["upstream"]) > 1e-9, (
        "a ShardTensor's mean now scales its gradient in its own dtype: delete exact_mean from shardlab/workarounds.py "
        f"and call .mean() in shardlab/points.py ({off})")
