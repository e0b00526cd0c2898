"""Every workaround for an upstream PhysicsNeMo behaviour lives here, and only here.

Each one names what it works around; ``tests/test_workarounds.py`` fails as soon as
upstream no longer needs it, so it can be deleted. torch and PhysicsNeMo are imported inside
the functions: ``launch`` imports this module in notebook kernels that never initialise a rank.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta


@contextlib.contextmanager
def cpu_safe_process_group_init(timeout: timedelta):
    """Let ``DistributedManager.initialize()`` create a process group on CPU, with our timeout.

    Upstream: NVIDIA/physicsnemo issue #1936 (fix proposed in PR #1938). ``DistributedManager.setup``
    passes the CPU device as ``device_id`` to ``init_process_group``; torch rejects a device_id
    that is not an accelerator with an index (ValueError), and PhysicsNeMo only catches
    TypeError. It also passes no timeout, so gloo would wait 30 minutes for a missing rank.
    """

    def adjust(kwargs):
        device_id = kwargs.get("device_id")
        if device_id is not None and getattr(device_id, "type", None) == "cpu":
            del kwargs["device_id"]
        kwargs.setdefault("timeout", timeout)

    with _init_process_group_adjusted(adjust):
        yield


# What NCCL error handling is set to when a group is created (read by ProcessGroupNCCL's constructor).
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}


@contextlib.contextmanager
def nccl_errors_raise():
    """Make a collective that a rank never joins end in an error after the group's timeout on NCCL, not a hang.

    Upstream: physicsnemo/distributed/manager.py (2.2.2), ``DistributedManager.initialize()`` runs
    ``os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"`` just before it creates the process group:
    ``NoHandling`` (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp, ``enum ErrorHandlingMode``), so a
    collective that timed out is never aborted and the ranks waiting in it hang. After that line and before the
    group exists (the variables are read when a group is created), this sets NCCL_ERROR_HANDLING:

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, ``CleanUpOnly``: "just clean up collectives and abort communicators
      without tearing down process" (the same header). The engine survives, so a ``%%px`` cell can report it.
    - ``TORCH_NCCL_BLOCKING_WAIT=0``: with blocking wait on, torch creates no watchdog thread
      (libtorch_cuda.so logs "TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is created."); only
      a ``wait()`` would then be timed, work completed through futures (DDP's reducer) would hang, and every
      collective would block the host (FSDP2 would lose its overlap).

    Which failure raises where, on NCCL: the watchdog notices a collective that outlived the timeout ("Watchdog
    caught collective operation timeout: ... ran for N milliseconds before timing out.") and aborts the
    communicator. The rank's own thread is not interrupted: a result it syncs on (``.item()``) is garbage, and its
    next collective on that group raises "NCCL communicator was aborted on rank N. Original reason for failure
    was: Watchdog caught collective operation timeout: ..." (later ones: "NCCL communicator was aborted after a
    previous error"). Restart the ranks after that. gloo reads neither variable: its collective itself raises
    "Timed out waiting Nms" after the timeout.
    """

    def adjust(_kwargs):
        os.environ.update(NCCL_ERROR_HANDLING)

    with _init_process_group_adjusted(adjust):
        yield


@contextlib.contextmanager
def _init_process_group_adjusted(adjust):
    """While the block runs, ``torch.distributed.init_process_group`` first calls ``adjust(kwargs)``
    (it may edit the call's keywords): the one call upstream makes that both workarounds above correct."""
    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        adjust(kwargs)
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original


@contextlib.contextmanager
def gpu_of_this_rank(gpu: int | None):
    """Let ``DistributedManager.initialize()`` put this rank on GPU ``gpu`` of those it sees (``devices.gpu_index``).

    Upstream: PhysicsNeMo 2.2.2's ``DistributedManager.setup`` uses ``cuda:{local_rank}``. With one visible GPU
    per process (Slurm's ``--gpus-per-task=1``, a CUDA_VISIBLE_DEVICES slice per rank) a rank of local rank 1
    asks for ``cuda:1``, which does not exist: its only GPU is ``cuda:0``. This passes the GPU's index as the local
    rank ``setup`` uses for the device (and for its barrier's ``device_ids``); the launcher's own local rank is
    still what ``launch.detect_launch`` reports. ``None`` (no GPU) changes nothing.
    """
    from physicsnemo.distributed import DistributedManager

    original = DistributedManager.__dict__["setup"]

    def setup(*args, **kwargs):
        if gpu is not None:
            kwargs["local_rank"] = gpu
        return original.__func__(*args, **kwargs)

    DistributedManager.setup = staticmethod(setup)
    try:
        yield
    finally:
        DistributedManager.setup = original


def no_cross_rank_autograd_cache() -> None:
    """Keep a rank from loading a graph another rank compiled, from the AOTAutograd cache on disk.

    Upstream: PhysicsNeMo 2.2.2's ``ShardTensor._stable_hash_for_caching`` keys the cache on the spec and
    ``requires_grad`` only, and a submesh's stable hash does not say which ranks it holds
    (pytorch/pytorch#173789; the DTensor side, pytorch/pytorch#188390, was fixed in PR #188401 by adding
    the device, which still leaves every CPU rank on ``cpu``). Ranks of different domain groups share keys:
    from the second run on, one loads a graph naming another group's process group and fails with "Could not
    resolve the process group registered under the name N". Inductor's kernel cache below it stays on.
    """
    import torch._functorch.config

    torch._functorch.config.enable_autograd_cache = False


# The shard-aware wrappers for the operations this series uses. Upstream's register_shard_wrappers()
# also imports knn, mesh_ops, natten_patches and point_cloud_ops (k-nearest neighbours, signed distance
# fields, neighbourhood attention, radius search): their imports pull in physicsnemo.nn, which was most of
# a CPU rank's start-up here (register_custom_ops: ~9 s vs ~0.2 s for these, measured side by side on
# 2 busy cores). A lesson that needs those calls register_shard_ops_on_cpu(everything=True).
SERIES_SHARD_WRAPPERS = ("attention_patches", "conv_patches", "index_ops", "linear_patches", "normalization_patches",
                         "padding", "pooling_patches", "unary_ops", "unpooling_patches", "view_ops")


def register_shard_ops_on_cpu(everything: bool = False) -> None:
    """Register ShardTensor's op handlers (reductions, conv halos, norms...) on a CPU-only host.

    Upstream: ``physicsnemo.domain_parallel`` calls ``register_custom_ops()`` at import only
    ``if torch.cuda.is_available()``. Without it, e.g. the backward of a sum over a Shard(1)
    ShardTensor fails with "placement[0] doesn't have a matching shard in shard_order".
    Registering twice is harmless: the handlers are keyed by op. On GPUs upstream registers
    everything itself, so this runs on CPU ranks only.
    """
    import importlib

    if everything:
        from physicsnemo.domain_parallel import register_custom_ops

        register_custom_ops()
        return
    # What register_custom_ops() imports, each module registering its handlers at import.
    from physicsnemo.domain_parallel.custom_ops import _tensor_ops, mean_wrapper, sum_wrapper, unbind_wrapper  # noqa: F401

    for name in SERIES_SHARD_WRAPPERS:
        importlib.import_module(f"physicsnemo.domain_parallel.shard_utils.{name}")


class _ShardTensorHandlersOn:
    """Subclass ``__torch_function__`` (hence ShardTensor's op handlers) on inside ``with``, whatever was outside."""

    def __enter__(self):
        import torch

        self._enabled = torch._C._EnableTorchFunction()
        return self._enabled.__enter__()

    def __exit__(self, *exc):
        return self._enabled.__exit__(*exc)


def recompute_with_shard_tensor_handlers():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: the forward as usual, the recompute with ShardTensor's
    handlers on.

    Upstream: ``ShardTensor.backward`` (physicsnemo 2.2.2, ``domain_parallel/shard_tensor.py``) calls
    ``torch.Tensor.backward``, which ShardTensor's ``__torch_function__`` sends to its DTensor fallback, and that runs
    the whole backward under ``torch._C.DisableTorchFunctionSubclass()``. A non-reentrant checkpoint recomputes its
    block inside that backward, so the recomputed convolutions skip ShardTensor's halo handler, run through DTensor
    on the global shape, and checkpoint raises "Recomputed values ... have different metadata" (checkpoint is not
    aware of ``__torch_function__``: pytorch/pytorch issue #147995). Not yet reported to PhysicsNeMo.
    """
    import contextlib

    return contextlib.nullcontext(), _ShardTensorHandlersOn()
