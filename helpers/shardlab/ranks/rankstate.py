"""A rank's own state, on the rank: set up at its first start (``init_rank``), reset to that for the next notebook
(``reset_rank``), and released while it waits parked (``park_rank``).

What every engine runs first is ``init_rank``; a parked cluster's ranks run ``park_rank`` before they wait, and
``reset_rank`` once a kernel claims them (``warm``: the pool on the host that parks and claims them; ``bringup`` calls
these on the ranks).
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

from . import beacon, devices, forkchild, launch

_SERIES_STATE: dict = {}  # on a rank: what its first initialisation left, to go back to at every reset
SHARD_REGISTRIES = ("_dispatch_registry", "_dispatch_registry_by_name", "_function_registry",
                    "_named_function_registry")  # ShardTensor's class-level handler tables, shared by the process


def registry_snapshot() -> dict:
    """A copy of ShardTensor's handler registries as they are now: what ``restore_registry`` puts back."""
    from physicsnemo.domain_parallel import ShardTensor

    return {name: dict(getattr(ShardTensor, name)) for name in SHARD_REGISTRIES}


def restore_registry(snapshot: dict) -> None:
    """Make ShardTensor's registries what ``snapshot`` holds: a handler registered since is gone, one it replaced is
    back. In place, because ShardTensor reads the class attributes at every call."""
    from physicsnemo.domain_parallel import ShardTensor

    for name in SHARD_REGISTRIES:
        registry = getattr(ShardTensor, name)
        registry.clear()
        registry.update(snapshot[name])


def init_rank(rendezvous: dict[str, str], timeout_s: float, threads: int) -> dict:
    """What a cluster engine runs first: where rank 0 listens, how many threads, then ``launch.init_distributed``,
    then the rank's ``beacon`` (started once per process, pointed at this start on a warm rank's reset).

    At a rank's first initialisation, it also notes the series' own state: ShardTensor's handler registries (the
    handlers PhysicsNeMo and ``init_distributed`` registered), the RNG states and the environment the rank was
    started with (before any import wrote into it: torch sets its compile cache folder there, inside the temp folder
    of the kernel that started the rank)."""
    os.environ.update(rendezvous)
    devices.limit_rank_threads(threads)  # ranks sharing a machine's cores must not each take all of them (nor compile)
    state = launch.init_distributed(timeout_s).as_row()
    if (folder := beacon.engine_status_folder()) is not None:  # what the kernel's rank panel reads
        beacon.start(folder, state["rank"], state["device"])
    if not _SERIES_STATE:
        import torch
        from physicsnemo.domain_parallel import ShardTensor

        _SERIES_STATE["registries"] = registry_snapshot()
        _SERIES_STATE["_enable_shard_patches"] = getattr(ShardTensor, "_enable_shard_patches", None)
        _SERIES_STATE["rng"] = torch.random.get_rng_state()
        _SERIES_STATE["cuda_rng"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        _SERIES_STATE["environ"] = forkchild.started_environment()  # a forked rank's: its launcher's
    return state


def reset_rank(rendezvous: dict[str, str], timeout_s: float, threads: int, environment: dict[str, str]) -> dict:
    """What a claimed rank runs (after ``%reset -f`` emptied its namespace): tear down every process group, forget
    meshes and compiled graphs, go back to the series' own handlers, a new rank's RNG and the environment the rank
    was started with, take the claiming kernel's ``environment`` (its temp folder), give memory back, then
    initialise as a fresh rank does."""
    import torch
    from physicsnemo.domain_parallel import ShardTensor

    t0 = time.perf_counter()
    tear_down_groups()  # park_rank did; again, so that a reset never depends on how its rank was parked
    if "torch._dynamo" in sys.modules:  # never imported: nothing was compiled (importing it takes seconds)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    if "torch._inductor.utils" in sys.modules:
        torch._inductor.utils.clear_caches()  # e.g. the cache folders it worked out from the old temp folder
    restore_registry(_SERIES_STATE["registries"])
    if _SERIES_STATE["_enable_shard_patches"] is not None:
        ShardTensor._enable_shard_patches = _SERIES_STATE["_enable_shard_patches"]
    os.environ.clear()
    os.environ.update(_SERIES_STATE["environ"] | environment)
    tempfile.tempdir = None  # read TMPDIR again
    gc.collect()
    release_freed_memory()
    reset_s = time.perf_counter() - t0
    state = init_rank(rendezvous, timeout_s, threads)
    torch.random.set_rng_state(_SERIES_STATE["rng"])  # what a new rank draws first, it draws again
    if _SERIES_STATE["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(_SERIES_STATE["cuda_rng"])
    state["phases"] = {"reset to a fresh start's state": reset_s} | {
        step: seconds for step, seconds in state["phases"].items() if step == "process group"}
    return state


def tear_down_groups() -> None:
    """Forget every process group and mesh of this rank, and free their communicators."""
    import torch
    from physicsnemo.distributed import DistributedManager
    from torch.distributed.device_mesh import _mesh_resources

    # Destroying a group only forgets it. Aborted, an NCCL group that a notebook kept (in a module, say) raises at its
    # next use; gloo's (torch 2.14) keeps its connections until the object is freed, which the emptied namespace does
    # unless something else holds it.
    for group in list(torch.distributed.distributed_c10d._world.pg_map):
        try:
            group.abort()
        except RuntimeError:  # a backend without abort
            pass
    DistributedManager.cleanup(barrier=False)  # destroys the world group and every subgroup made from it
    _mesh_resources.mesh_stack.clear()


def park_rank() -> dict:
    """What every rank of a cluster being parked runs, after ``%reset -f`` emptied its namespace: give back what a
    rank that waits for the next notebook need not hold. Its process groups go (an NCCL communicator holds GPU
    buffers for its peers), then cycles are collected and freed memory returned (``release_freed_memory``).

    What stays, and why: the CUDA context (some hundreds of MiB on each GPU: torch keeps the primary context for the
    life of the process and has no call that destroys it while its streams, handles and allocator refer to it;
    with the loaded libraries and imported modules, it is what a warm rank saves the next notebook), and compiled
    graphs until the claim's reset. Returns the bytes of GPU memory torch still reserves (0 without a GPU)."""
    import torch

    tear_down_groups()
    gc.collect()
    release_freed_memory()
    return {"cuda_reserved": torch.cuda.memory_reserved() if torch.cuda.is_available() else 0}


def release_freed_memory() -> None:
    """Give freed memory back to the system: glibc keeps freed heap pages unless trimmed; CUDA's caching allocator
    keeps freed blocks unless emptied."""
    import ctypes
    import ctypes.util

    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # cuBLAS keeps a workspace per handle and stream
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    if (libc := ctypes.util.find_library("c")) and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)
