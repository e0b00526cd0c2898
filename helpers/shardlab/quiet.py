"""Messages upstream prints that the series knows are harmless, silenced where they start, each with its reason.

A learner reads red text as "something broke". Each message here is silenced by the narrowest means that reaches
it, and only it; ``tests/unit/test_quiet.py`` fails as soon as upstream no longer prints it, so that its silencing
can be deleted. What the series cannot silence without hiding something real is said in the lesson instead
(``tests/notebooks/test_stderr.py`` holds the list of what may still appear, and why).

- ``CPU_RANK_ENVIRONMENT``: what CPU engines start with (``ranks.engine_launchers.engine_environment``).
- ``install()``: run when ``shardlab`` is imported, in kernels and on ranks alike: Warp's line about a missing CUDA
  driver, and torch's warning that gloo has no all-to-all.

Standard library only: ``import shardlab`` stays instant.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile

# Kineto, torch's profiler library (third_party/kineto in torch 2.14.1), prints to stderr at its default level
# (ERROR, libkineto/src/init.cpp, suppressLibkinetoLogMessages): "USDT: ... profiler_start" and "profiler_stop" at
# every profile (pytorch/kineto PR #1325 emits them for a USDT trace collector; Logger's destructor prints every message
# too), and on a process that sees no GPU "ERROR: ... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35".
# Both come from each rank that measures with torch.profiler (sl.measure). KINETO_LOG_LEVEL, read when kineto starts,
# sets the lowest severity printed; USDT is the highest (5), so 6 prints none. CPU ranks only: on GPU ranks an ERROR
# may be CUPTI's, and is left to be read.
CPU_RANK_ENVIRONMENT = {"KINETO_LOG_LEVEL": "6"}
# The same two lines, as ``stderr_without`` drops them around a profile on any rank (``measure.timeline``): on a GPU
# rank, where Kineto's level stays as it is, they are the USDT lines.
KINETO_CHATTER = re.compile(rb"^(USDT|ERROR):\S+ \S+ \S+ (SyncActivityProfilerHandler|DeviceProperties)\.cpp")

# Warp 1.19 (warp/native/cuda_util.cpp, init_cuda_driver) prints this with fprintf when it cannot load libcuda.so:
# on every process without a CUDA driver that imports a PhysicsNeMo module calling wp.init() (Transolver, FNO, the data
# loaders), kernel and ranks, once each. No setting of Warp turns it off. The series says where ranks run itself.
WARP_WITHOUT_DRIVER = (b"Warp CUDA warning: Could not find or load the NVIDIA CUDA driver. GPU execution will not be "
                       b"available.")

# torch 2.14.1, torch/distributed/tensor/_collective_utils.py, shard_dim_alltoall: on a CPU mesh (gloo has no
# all-to-all) a DTensor's Shard(i) -> Shard(j) redistribution becomes an all-gather and a local chunk, with this warning
# (once per process, so on every rank). The lesson that meets it (13, the FNO audit) says so once, in its text.
GLOO_ALLTOALL = ("torch.distributed.tensor._collective_utils",
                 "CPU process group does not support alltoall yet, falling back with allgather + chunk!")


@contextlib.contextmanager
def stderr_without(line: bytes | re.Pattern[bytes]):
    """While the block runs, what is written to file descriptor 2 (C libraries write there, not to ``sys.stderr``)
    goes to a file; at its end, everything but ``line`` (or the lines the pattern matches) is written on. Nothing
    else is lost, only held until then."""
    drop = line.match if isinstance(line, re.Pattern) else lambda text: text.rstrip(b"\r\n") == line
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:  # no name in the temp folder: nothing is left there
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [text for text in held.read().splitlines(keepends=True) if not drop(text)]
            if kept:
                os.write(2, b"".join(kept))


def quiet_first_init(warp) -> None:
    """Make the first ``warp.init()`` (what PhysicsNeMo's modules call at import) run under ``stderr_without``, then
    put Warp's own function back: when and how Warp starts does not change."""
    original = warp.init

    def init():
        warp.init = original
        with stderr_without(WARP_WITHOUT_DRIVER):
            return original()

    warp.init = init


class _WhenWarpIsImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the first ``import warp``, lets the usual finders find it, and once its module has
    run, wraps its ``init`` (``quiet_first_init``). Then it leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name != "warp":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenQuiet(spec.loader)
        return spec


class _ThenQuiet(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # resource readers and the like: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader  # the module keeps its own loader
        self.loader.exec_module(module)
        quiet_first_init(module)


class _Without(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record) -> bool:
        return record.getMessage() != self.message


def install() -> None:
    """What ``import shardlab`` runs: Warp's missing-driver line held back at Warp's first start (now, if Warp is
    imported and not yet started; else at its import), torch's gloo all-to-all warning filtered from its logger."""
    warp = sys.modules.get("warp")
    if warp is not None:
        runtime = getattr(sys.modules.get("warp._src.context"), "runtime", None)
        if runtime is None and hasattr(warp, "init"):
            quiet_first_init(warp)
    elif not any(isinstance(finder, _WhenWarpIsImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WhenWarpIsImported())
    logger, message = GLOO_ALLTOALL
    if not any(isinstance(f, _Without) and f.message == message for f in logging.getLogger(logger).filters):
        logging.getLogger(logger).addFilter(_Without(message))
