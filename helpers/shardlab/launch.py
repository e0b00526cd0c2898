"""Launch layer: which launcher started this process, and one safe way to initialise
PhysicsNeMo's ``DistributedManager`` on every rank.

Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Mapping

# Launchers, in the order PhysicsNeMo tries them (ENV first), plus MPICH/PMI, which
# PhysicsNeMo does not read.
LAUNCHER_VARIABLES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "slurm": ("SLURM_PROCID", "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_LAUNCH_NODE_IPADDR"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}
PHYSICSNEMO_METHOD = {"torchrun": "ENV", "slurm": "SLURM", "openmpi": "OPENMPI", "mpich": None, "none": None}
DEFAULT_TIMEOUT = timedelta(seconds=30)


def torchrun_command(n: int, *program: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node=n PROGRAM...`` with this environment's Python."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *program]


class LaunchError(RuntimeError):
    """The environment does not describe a usable distributed launch; the message says what to change."""


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process, as one table row."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: str
    physicsnemo_method: str | None
    note: str = ""

    def as_row(self) -> dict:
        return asdict(self)


def _int_var(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise LaunchError(
            f"{name} is not set, but other {launcher} variables are. {launcher} sets {name} for "
            f"every process; if you set the variables by hand, set {name} too."
        )
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer; {launcher} sets it to this process's index.") from None


def _check_ranges(launcher: str, rank: int, local_rank: int, world_size: int) -> None:
    if world_size < 1:
        raise LaunchError(f"{launcher}: world size is {world_size}; it must be at least 1.")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{launcher}: rank {rank} is outside 0..{world_size - 1} (world size {world_size}).")
    if not 0 <= local_rank < world_size:
        raise LaunchError(f"{launcher}: local rank {local_rank} is outside 0..{world_size - 1}.")


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, local rank and world size from the launcher's environment variables.

    Raises LaunchError with a fix when the variables are present but incomplete or wrong.
    """
    env = os.environ if env is None else env
    forced = env.get("PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD")
    addr = env.get("MASTER_ADDR", "localhost")
    port = env.get("MASTER_PORT", "12355")

    if forced is not None and forced not in ("ENV", "SLURM", "OPENMPI"):
        raise LaunchError(
            f"PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD={forced!r}; PhysicsNeMo accepts ENV, SLURM or OPENMPI. "
            "Unset it to let the launcher be detected."
        )
    # PhysicsNeMo tries ENV first and only falls back when RANK or WORLD_SIZE is missing.
    if forced == "ENV" or (forced is None and "RANK" in env and "WORLD_SIZE" in env):
        rank = _int_var(env, "RANK", "torchrun")
        world = _int_var(env, "WORLD_SIZE", "torchrun")
        if "LOCAL_RANK" not in env:
            raise LaunchError(
                "LOCAL_RANK is not set. torchrun sets it for every process; if you set RANK and WORLD_SIZE "
                "by hand, also set LOCAL_RANK (this process's index on its node, e.g. LOCAL_RANK=$RANK on one "
                "machine). Without it PhysicsNeMo computes rank % torch.cuda.device_count(), which divides "
                "by zero on a machine without GPUs."
            )
        local = _int_var(env, "LOCAL_RANK", "torchrun")
        _check_ranges("torchrun", rank, local, world)
        return LaunchInfo("torchrun", rank, local, world, addr, port, "ENV")

    if forced == "SLURM" or (forced is None and "SLURM_PROCID" in env):
        rank = _int_var(env, "SLURM_PROCID", "srun")
        world = _int_var(env, "SLURM_NPROCS", "srun")
        local = _int_var(env, "SLURM_LOCALID", "srun")
        _check_ranges("srun", rank, local, world)
        # PhysicsNeMo takes the address from Slurm, not from MASTER_ADDR.
        slurm_addr = env.get("SLURM_LAUNCH_NODE_IPADDR", "")
        return LaunchInfo("slurm", rank, local, world, slurm_addr, port, "SLURM")

    if forced == "OPENMPI" or (forced is None and "OMPI_COMM_WORLD_RANK" in env):
        rank = _int_var(env, "OMPI_COMM_WORLD_RANK", "mpirun")
        world = _int_var(env, "OMPI_COMM_WORLD_SIZE", "mpirun")
        local = _int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun")
        _check_ranges("mpirun", rank, local, world)
        return LaunchInfo("openmpi", rank, local, world, addr, port, "OPENMPI")

    if "PMI_RANK" in env or "PMI_SIZE" in env:
        rank = _int_var(env, "PMI_RANK", "MPICH's mpiexec")
        world = _int_var(env, "PMI_SIZE", "MPICH's mpiexec")
        local_name = "MPI_LOCALRANKID" if "MPI_LOCALRANKID" in env else "PMI_LOCAL_RANK"
        if local_name not in env:
            raise LaunchError(
                "MPICH/PMI launch without a local rank: neither MPI_LOCALRANKID nor PMI_LOCAL_RANK is set. "
                "Launch with MPICH's hydra mpiexec (it sets MPI_LOCALRANKID), or set LOCAL_RANK yourself."
            )
        local = _int_var(env, local_name, "MPICH's mpiexec")
        _check_ranges("mpich", rank, local, world)
        return LaunchInfo(
            "mpich", rank, local, world, addr, port, None,
            note="PhysicsNeMo does not read PMI_* variables: on its own every rank would start as rank 0 of "
            "a one-process job. shardlab.init_distributed maps PMI_RANK/PMI_SIZE/local rank to "
            "RANK/WORLD_SIZE/LOCAL_RANK and uses the ENV method.",
        )

    return LaunchInfo("none", 0, 0, 1, addr, port, None, note="no launcher variables: a single process")


def shutdown_distributed() -> None:
    """End a launched script: every rank tears the process group down together, before interpreter exit.

    Left to PhysicsNeMo's atexit hook, a rank sometimes aborted in C++ ("terminate called without
    an active exception") after all its work had succeeded, turning a good run's exit code into 1.
    """
    from physicsnemo.distributed import DistributedManager

    DistributedManager.cleanup(barrier=True)


@dataclass(frozen=True)
class DistributedState:
    """What DistributedManager reports on one rank after initialisation."""

    launcher: str
    method: str | None
    rank: int
    local_rank: int
    world_size: int
    device: str
    backend: str | None
    timeout_s: float
    hostname: str
    pid: int

    def as_row(self) -> dict:
        return asdict(self)


def _set_default_collective_timeout(timeout: timedelta) -> None:
    # Device-mesh subgroups are created without a timeout and fall back to torch's module
    # defaults (30 min for gloo, 10 min for nccl). A tutorial must fail fast instead of hanging.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def _check_gpu_binding(info: LaunchInfo) -> None:
    import torch

    if torch.cuda.is_available() and info.local_rank >= torch.cuda.device_count():
        raise LaunchError(
            f"rank {info.rank} has local rank {info.local_rank}, but this node has only "
            f"{torch.cuda.device_count()} visible GPU(s). Start one process per GPU "
            f"(e.g. torchrun --nproc-per-node={torch.cuda.device_count()})."
        )


def init_distributed(timeout: timedelta | float = DEFAULT_TIMEOUT) -> DistributedState:
    """Initialise DistributedManager on this rank, safely on CPU and GPU; calling it again is a no-op.

    ``timeout`` (seconds or timedelta) bounds every collective, including those of mesh
    subgroups, so a rank that never arrives turns into an error instead of a hang.
    """
    import socket

    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager

    from . import workarounds

    # PhysicsNeMo 2.2.2 calls a torch collective that torch 2.14 deprecates; the warning would
    # print on every rank for every redistribute and says nothing a learner can act on.
    warnings.filterwarnings("ignore", message=r".*all_gather_tensor.* is deprecated", category=FutureWarning)
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    info = detect_launch()
    if not DistributedManager.is_initialized():
        _check_gpu_binding(info)
        _set_default_collective_timeout(timeout)
        if info.launcher == "mpich":
            os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
            os.environ["PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD"] = "ENV"
        with warnings.catch_warnings():
            # Single-process runs make PhysicsNeMo warn that no launcher was found; we report that ourselves.
            warnings.filterwarnings("ignore", message="Could not initialize using ENV")
            with workarounds.cpu_safe_process_group_init(timeout):
                DistributedManager.initialize()
        if not torch.cuda.is_available():
            workarounds.register_shard_ops_on_cpu()

    manager = DistributedManager()
    backend = dist.get_backend() if manager.distributed and dist.is_initialized() else None
    # DistributedManager only stores the method for multi-process runs.
    method = getattr(manager, "_initialization_method", None) if backend else None
    return DistributedState(
        launcher=info.launcher, method=method, rank=manager.rank, local_rank=manager.local_rank,
        world_size=manager.world_size, device=str(manager.device), backend=backend,
        timeout_s=timeout.total_seconds(), hostname=socket.gethostname(), pid=os.getpid(),
    )
