"""The upstream messages shardlab.quiet holds back: each is STILL printed by upstream (else delete its silencing, as
the assertion says), and with shardlab imported only that message is gone, nothing else written beside it.

Each upstream check runs in an interpreter of its own (fresh_python.py): what is printed depends on import-time and
process state a test process cannot undo."""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from shardlab import quiet
from shardlab.ranks.engine_launchers import engine_environment

WARP_LINE = quiet.WARP_WITHOUT_DRIVER.decode()


def _cuda_driver_loads() -> bool:
    for name in ("libcuda.so", "libcuda.so.1"):  # what Warp tries (warp/native/cuda_util.cpp, init_cuda_driver)
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


no_driver = pytest.mark.skipif(_cuda_driver_loads(), reason="a CUDA driver loads: no line to hold back")


def test_stderr_without_drops_that_line_only_and_keeps_the_rest_in_order(capfd):
    line = b"noise that is known to be harmless"
    with quiet.stderr_without(line):
        os.write(2, b"before\n" + line + b"\n" + line + b" but longer\nafter\n")
    os.write(2, b"outside\n")
    assert capfd.readouterr().err == f"before\n{line.decode()} but longer\nafter\noutside\n"


def test_a_pattern_drops_kinetos_lines_around_a_profile_and_nothing_else(capfd):
    from shardlab.measure import timeline

    usdt = b"USDT:12-04 21:49:01 4242 SyncActivityProfilerHandler.cpp:123] profiler_start\n"
    no_gpu = b"ERROR:12-04 21:49:01 4242 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
    with timeline.without_kineto_chatter():
        os.write(2, b"before\n" + usdt + no_gpu + b"ERROR: something else\n")
    assert capfd.readouterr().err == "before\nERROR: something else\n"


@no_driver
def test_warp_still_prints_its_missing_driver_line(fresh_python):
    result = fresh_python.run("import warp; warp.config.quiet = True; warp.init()")
    assert result.returncode == 0, result.stderr
    assert WARP_LINE in result.stderr, (
        "Warp no longer prints its missing-driver line: delete WARP_WITHOUT_DRIVER, quiet_first_init and "
        "_WhenWarpIsImported from shardlab/quiet.py\n" + result.stderr[-2000:])


@no_driver
def test_with_shardlab_imported_warp_starts_without_the_line_and_as_it_would(fresh_python):
    """Warp imported before shardlab (PhysicsNeMo's import does it on ranks): its first start is quiet, Warp's own
    init is back after it, and a PhysicsNeMo module that starts Warp at import says nothing either."""
    result = fresh_python.run("""
        import os, warp
        import shardlab
        from physicsnemo.nn.functional.interpolation import _warp_common  # calls wp.init() at import
        import warp._src.context as context
        assert context.runtime is not None and warp.init is context.init
        print("started")
    """)
    assert result.returncode == 0 and "started" in result.stdout, result.stderr[-2000:]
    assert WARP_LINE not in result.stderr, result.stderr[-2000:]


@no_driver
def test_warp_imported_after_shardlab_is_held_back_too():
    """A kernel imports shardlab first and Warp later (a PhysicsNeMo model): the import hook's path. A new interpreter,
    since fresh_python's has Warp imported already."""
    code = textwrap.dedent("""
        import sys
        import shardlab, warp
        from importlib.resources import files
        assert not any(type(f).__name__ == "_WhenWarpIsImported" for f in sys.meta_path)  # it left
        assert type(warp.__spec__.loader).__name__ != "_ThenQuiet" and files("warp").is_dir()  # warp's own loader
        warp.config.quiet = True
        warp.init()
        print("started")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0 and "started" in result.stdout, result.stderr[-2000:]
    assert WARP_LINE not in result.stderr, result.stderr[-2000:]


PROFILE = """
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        torch.ones(1000).sum()
"""


def test_kineto_still_prints_usdt_lines_unless_cpu_ranks_set_its_level(fresh_python):
    loud = fresh_python.run(PROFILE)
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert "profiler_start" in loud.stderr and "USDT" in loud.stderr, (
        "torch's profiler no longer prints its USDT lines: if no kineto message remains on CPU ranks, delete "
        "CPU_RANK_ENVIRONMENT from shardlab/quiet.py\n" + loud.stderr[-2000:])
    quiet_run = fresh_python.run(PROFILE, **quiet.CPU_RANK_ENVIRONMENT)
    assert quiet_run.returncode == 0 and quiet_run.stderr.strip() == "", quiet_run.stderr[-2000:]


def test_cpu_engines_start_with_it_and_gpu_engines_without():
    assert engine_environment("cpu").items() >= quiet.CPU_RANK_ENVIRONMENT.items()
    assert "KINETO_LOG_LEVEL" not in engine_environment("cuda")


ALLTOALL = """
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._collective_utils import shard_dim_alltoall
    {before}
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    out = shard_dim_alltoall(torch.ones(2, 2), 0, 1, mesh, 0)
    print("shape", tuple(out.shape))
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("imported", [False, True], ids=["upstream", "with shardlab"])
def test_torch_still_warns_that_gloo_has_no_alltoall_unless_shardlab_is_imported(fresh_python, imported):
    from shardlab.ranks.launch import free_port

    result = fresh_python.run(ALLTOALL.format(before="import shardlab" if imported else ""),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert result.returncode == 0 and "shape (2, 2)" in result.stdout, result.stderr[-2000:]
    said = quiet.GLOO_ALLTOALL[1] in result.stderr  # torch's own handler writes it (torch/_logging)
    if imported:
        assert not said, result.stderr[-2000:]
    else:
        assert said, ("torch no longer warns that gloo has no all-to-all: delete GLOO_ALLTOALL from "
                      "shardlab/quiet.py, and the sentence about it in notebook 13\n" + result.stderr[-2000:])
