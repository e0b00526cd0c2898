"""The workarounds for upstream behaviours (PhysicsNeMo, torch, psutil), each in one place.

All live here but one, which is its module's whole job: the CPU profiler's frees, paired with their allocations
where bytes are counted (``measure.allocations``). Each names what it works around; ``tests/unit/test_workarounds.py``
fails as soon as upstream no longer needs it, so it can be deleted. torch and PhysicsNeMo are imported inside the
functions: ``launch`` imports this module in notebook kernels that never initialise a rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from datetime import timedelta

import psutil


@contextlib.contextmanager
def cpu_safe_process_group_init(timeout: timedelta):
    """Let ``DistributedManager.initialize()`` create a process group on CPU, with our timeout.

    Upstream: NVIDIA/physicsnemo issue #1936 (fix proposed in PR #1938). ``DistributedManager.setup`` passes the CPU
    device as ``device_id`` to ``init_process_group``; torch rejects a device_id that is not an accelerator with an
    index (ValueError), and PhysicsNeMo only catches TypeError. It passes no timeout either: gloo would wait 30 min.
    """

    def adjust(kwargs):
        device_id = kwargs.get("device_id")
        if device_id is not None and getattr(device_id, "type", None) == "cpu":
            del kwargs["device_id"]
        kwargs.setdefault("timeout", timeout)

    with _init_process_group_adjusted(adjust):
        yield


# What NCCL error handling is set to when a group is created (read by ProcessGroupNCCL's constructor): always this.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0"}
# What a collective that timed out waits for before it is aborted, and whether the heartbeat monitor ends the process
# afterwards (read by ProcessGroupNCCL::HeartbeatMonitor's constructor, whenever a group is created).
NCCL_TIMEOUT_DUMP = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                     "TORCH_NCCL_ENABLE_MONITORING": "0"}
# Whoever sets one of these has chosen torch's dump and monitor: then none of NCCL_TIMEOUT_DUMP is set.
NCCL_DUMP_AND_MONITOR = (*NCCL_TIMEOUT_DUMP, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


def nccl_settings(env=None) -> dict[str, str]:
    """What ``nccl_errors_raise`` sets before a group is created, in the environment ``env`` (default: this process's):
    NCCL_ERROR_HANDLING always; NCCL_TIMEOUT_DUMP unless ``env`` sets any of NCCL_DUMP_AND_MONITOR."""
    env = os.environ if env is None else env
    return NCCL_ERROR_HANDLING | ({} if any(name in env for name in NCCL_DUMP_AND_MONITOR) else NCCL_TIMEOUT_DUMP)


@contextlib.contextmanager
def nccl_errors_raise():
    """Make a collective that a rank never joins raise soon after the group's timeout on NCCL, not hang, and keep the
    process alive. Wrap the creation of the process group in it (``DistributedManager.initialize()`` included, which
    sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` just before): ``nccl_settings()`` is applied as the group is created;
    set any of NCCL_DUMP_AND_MONITOR yourself and torch's dump and monitor stay as you set them.

    Why each setting, from torch's and PhysicsNeMo's sources: docs/gpu-check.md#why-these-nccl-settings.
    """

    def adjust(_kwargs):
        os.environ.update(nccl_settings())

    with _init_process_group_adjusted(adjust):
        yield


@contextlib.contextmanager
def _init_process_group_adjusted(adjust):
    """While the block runs, ``torch.distributed.init_process_group`` first calls ``adjust(kwargs)`` (it may edit the
    call's keywords): the one call upstream makes that both workarounds above correct."""
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

    Upstream: PhysicsNeMo 2.2.2's ``DistributedManager.setup`` uses ``cuda:{local_rank}``. With one visible GPU per
    process (Slurm's ``--gpus-per-task=1``, a CUDA_VISIBLE_DEVICES slice per rank) a rank of local rank 1 asks for
    ``cuda:1``, which does not exist: its only GPU is ``cuda:0``. This passes the GPU's index as the local rank
    ``setup`` uses for the device (and its barrier's ``device_ids``); the launcher's own local rank is still what
    ``launch.detect_launch`` reports. ``None`` (no GPU) changes nothing.
    """

    def adjust(kwargs):
        if gpu is not None:
            kwargs["local_rank"] = gpu

    with _setup_adjusted(adjust):
        yield


@contextlib.contextmanager
def _setup_adjusted(adjust):
    """While the block runs, ``DistributedManager.setup`` first calls ``adjust(kwargs)`` (it may edit the call's
    keywords): the one call through which the initialisation methods reach the device and rank 0's address."""
    from physicsnemo.distributed import DistributedManager

    original = DistributedManager.__dict__["setup"]

    def setup(*args, **kwargs):
        adjust(kwargs)
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


# The shard-aware wrappers for the operations this series uses. Upstream's register_shard_wrappers() also imports
# knn, mesh_ops, natten_patches and point_cloud_ops (k-nearest neighbours, signed distance fields, neighbourhood
# attention, radius search): their imports pull in physicsnemo.nn, most of a CPU rank's start-up here
# (register_custom_ops: ~9 s vs ~0.2 s for these, side by side on 2 busy cores): a lesson that needs those calls
# register_shard_ops_on_cpu(everything=True).
SERIES_SHARD_WRAPPERS = ("attention_patches", "conv_patches", "index_ops", "linear_patches", "normalization_patches",
                         "padding", "pooling_patches", "unary_ops", "unpooling_patches", "view_ops")


def register_shard_ops_on_cpu(everything: bool = False) -> None:
    """Register ShardTensor's op handlers (reductions, conv halos, norms...) on a CPU-only host.

    Upstream: ``physicsnemo.domain_parallel`` calls ``register_custom_ops()`` at import only ``if
    torch.cuda.is_available()``. Without it, e.g. the backward of a sum over a Shard(1) ShardTensor fails with
    "placement[0] doesn't have a matching shard in shard_order". Registering twice is harmless: the handlers are
    keyed by op. On GPUs upstream registers everything itself, so this runs on CPU ranks only.
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


def exact_mean(t):
    """``t.mean()`` whose gradient is as exact as its dtype on a ShardTensor too. Upstream: PhysicsNeMo 2.2.2's
    ``ShardedMean.backward`` (``domain_parallel/custom_ops/_reductions.py``) scales the gradient by ``1.0 /
    torch.prod(torch.tensor(global_shape))``, a float32 tensor: in float64 every gradient is off by float32's rounding
    of 1/numel (5e-8 relative for 1000 values; nothing for a power of two). Not yet reported upstream."""
    return t.sum() / t.numel()


def process_started(pid: int) -> float:
    """When process ``pid`` started: with the pid, what tells it from a later process that reuses the pid.

    Upstream: psutil issues #2526 and #2541 (by design since psutil 7.0). On Linux, ``Process.create_time()`` adds
    the boot time, which ``/proc/stat`` recomputes from the wall clock at every read: once NTP slews the clock across
    a whole second, creation times read after move by one. A live cluster then looks like recycled pids: another
    start stops it as stale, and ``stop`` leaves it running. Linux: the start in clock ticks from ``/proc/<pid>/stat``,
    which no clock change moves; elsewhere, psutil's creation time.
    """
    if not sys.platform.startswith("linux"):
        return psutil.Process(pid).create_time()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError as error:  # gone, or hidden from this user (/proc mounted with hidepid)
        raise (psutil.AccessDenied if isinstance(error, PermissionError) else psutil.NoSuchProcess)(pid) from None
    after_name = stat[stat.rindex(b")") + 2:].split()  # the name, in parentheses, may hold spaces
    return int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: clock ticks after boot


# -- where a Slurm step's ranks meet ----------------------------------------------------------------------------

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def slurm_rendezvous_on_first_node():
    """Let the SLURM method of ``DistributedManager.initialize()`` meet rank 0 where it listens: the step's first node.

    Upstream: NVIDIA/physicsnemo issue #819. PhysicsNeMo 2.2.2's ``DistributedManager.initialize_slurm`` passes
    ``SLURM_LAUNCH_NODE_IPADDR`` to ``setup`` as rank 0's address, and ignores MASTER_ADDR. That variable is the
    address of the node srun ran on: unset under sbatch without srun, where ``setup`` fails (#819), and a login
    node's when srun is started there (salloc's shell on a login node; a kernel there starting Slurm engines or
    ``run_job("slurm")``), where no rank listens, so every rank waits for a rendezvous that never comes. While the
    block runs, the SLURM method's ``setup`` gets ``slurm_rendezvous_address()`` instead; the ENV and OPENMPI
    methods are left alone.
    """

    def adjust(kwargs):
        if kwargs.get("method") == "slurm":
            kwargs["addr"] = slurm_rendezvous_address()

    with _setup_adjusted(adjust):
        yield


def slurm_rendezvous_address(env=None) -> str:
    """Where rank 0 of this process's Slurm step listens, the same answer on every rank of the step:

    - MASTER_ADDR when it is set to anything but loopback: the user's choice;
    - loopback when the step runs on one node (every rank is there; shardlab's own MASTER_ADDR=127.0.0.1 is kept);
    - else the first node of the step, where Slurm puts task 0: the first of ``SLURM_STEP_NODELIST`` (else
      ``SLURM_JOB_NODELIST``), expanded by ``slurm_hostnames``.

    A RuntimeError says what to set when the step's nodes cannot be read."""
    env = os.environ if env is None else env
    given = env.get("MASTER_ADDR", "").strip()
    if given and given not in LOOPBACK:
        return given
    nodelist = next((env[name] for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if env.get(name)), "")
    count = next((env[name] for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
                  if env.get(name)), "")
    from .ranks.slurm import slurm_hostnames

    hosts = []
    with contextlib.suppress(ValueError):
        hosts = slurm_hostnames(nodelist) if nodelist else []
    if len(hosts) == 1 or (not hosts and count == "1"):
        return given or "127.0.0.1"
    if hosts:
        return hosts[0]
    raise RuntimeError(
        f"this Slurm step runs on {count or 'an unknown number of'} nodes, and which one rank 0 listens on cannot be "
        f"read from SLURM_STEP_NODELIST/SLURM_JOB_NODELIST ({nodelist!r}). Set MASTER_ADDR to the step's first "
        "node before srun, e.g. export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1).")


def fno_on_slabs(model):
    """Each ``FNO2DEncoder`` of ``model`` (PhysicsNeMo's 2-D FNO), for an input split along H, builds its coordinate
    features for this rank's rows only (the same ``linspace``'s rows) and drops its padding from this rank's rows,
    communicating nothing; other inputs take upstream's forward. In place; returns ``model``. Upstream (physicsnemo
    2.2.2, ``nn/module/fno_layers.py``, no issue yet): ``self._meshgrid(list(x.shape), x.device)`` (line 369) gets a
    ShardTensor's global shape, so every rank builds the whole (B, 2, H, W) grid (391-412); the padding (8 rows by
    default, which ShardTensor's pad handler adds on the last rank) is dropped by ``x[..., :-8, :-8]`` (line 387), a
    slice of the split dim with no handler: DTensor's fallback assumes even shards, the collectives mismatch and gloo
    aborts. The spectral layers are ``models.spectral_layers_on_slabs``'s."""
    from physicsnemo.nn.module.fno_layers import FNO2DEncoder

    for module in (m for m in model.modules() if isinstance(m, FNO2DEncoder)):
        module.forward = types.MethodType(_fno_encoder_on_slabs, module)
    return model


def _fno_encoder_on_slabs(self, x):
    import torch
    from physicsnemo.domain_parallel import ShardTensor

    if not isinstance(x, ShardTensor) or len(x.placements) != 1 or not x.placements[0].is_shard(2):
        return type(self).forward(self, x)
    (batch, _, height, width), me, mesh = x.shape, x.device_mesh.get_local_rank(), x.device_mesh
    on_slabs = lambda local, shapes: ShardTensor.from_local(  # noqa: E731  (this rank's rows; every rank's shape)
        local, mesh, x.placements, sharding_shapes={0: tuple(map(tuple, shapes))})
    if self.coord_features:
        rows = [shape[2] for shape in x._spec.sharding_shapes()[0]]
        top, line = sum(rows[:me]), lambda n: torch.linspace(0, 1, n, dtype=torch.float32, device=x.device)
        grid = torch.stack(torch.meshgrid(line(height)[top:top + rows[me]], line(width), indexing="ij"))
        grid = grid.expand(batch, 2, rows[me], width).to(x.dtype).contiguous()
        x = torch.cat((x, on_slabs(grid, [(batch, 2, n, width) for n in rows])), dim=1)
    y = torch.nn.functional.pad(self.lift_network(x), (0, self.pad[1], 0, self.pad[0]), mode=self.padding_type)
    for k, (conv, spectral) in enumerate(zip(self.conv_layers, self.spconv_layers)):
        y = conv(y) + spectral(y)
        y = self.activation_fn(y) if k < len(self.conv_layers) - 1 else y
    shapes = y._spec.sharding_shapes()[0]
    kept = [max(0, min(shape[2], height - sum(s[2] for s in shapes[:r]))) for r, shape in enumerate(shapes)]
    return on_slabs(y.to_local()[:, :, :kept[me], :width], [(*shape[:2], n, width) for shape, n in zip(shapes, kept)])
