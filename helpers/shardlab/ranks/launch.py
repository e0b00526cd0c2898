"""A launch as its ranks see it: what each launcher tells them (``detect_launch``), ``DistributedManager`` initialised
on every rank (``init_distributed``), and a job of such ranks run from here (``run_job``).

The only module that knows the launchers' variables (``torchrun``, OpenMPI's and MPICH's ``mpiexec``, Slurm's
``srun``); their command lines, environment and ports are ``commands``'.
Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from .. import workarounds
from ..measure import flight
from . import devices, forkserver, owned, subprocesses

# find_mpiexec and torchrun_command are here for callers of sl.ranks.launch: notebook 08, and the planner's two launches
# until they use run_job; write_job_result for the programs that run_job runs.
from .commands import (
    NODE_OWN_TEMP,
    RESULT_FILE,
    LaunchError,
    check_ranks_per_core,
    check_result_folder,
    find_mpiexec,  # noqa: F401
    free_port,
    job_command,
    job_folder,
    missing_result_hint,
    mpi_environment,
    mpi_session_environment,
    torchrun_command,  # noqa: F401
    wait_for_rank_zero,
    write_job_result,  # noqa: F401
)
from .devices import DeviceError, Placement, gpu_index, place_ranks, slurm_gpus, usable_cores, visible_gpus

DEFAULT_TIMEOUT = timedelta(seconds=30)
# What PhysicsNeMo assumes when MASTER_ADDR / MASTER_PORT are unset.
DEFAULT_ADDRESS, DEFAULT_PORT = "localhost", "12355"


@dataclass(frozen=True)
class Launcher:
    """One launcher's contract: the variables it sets for every process it starts."""

    name: str  # the vocabulary used everywhere in shardlab: torchrun, slurm, openmpi, mpich
    command: str  # what a user types
    rank: str
    world_size: str
    local_rank: tuple[str, ...]  # accepted in this order
    address: str | None  # where rank 0 listens; None: MASTER_ADDR
    physicsnemo_method: str | None  # PhysicsNeMo's name for it; None: PhysicsNeMo does not detect it
    needs_both: bool = False  # PhysicsNeMo only takes ENV when RANK *and* WORLD_SIZE are set


# In the order PhysicsNeMo tries them (ENV first), then MPICH/Intel MPI, which PhysicsNeMo does not read.
LAUNCHERS = (
    Launcher("torchrun", "torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",), "MASTER_ADDR", "ENV", needs_both=True),
    Launcher("slurm", "srun", "SLURM_PROCID", "SLURM_NPROCS", ("SLURM_LOCALID",), "SLURM_LAUNCH_NODE_IPADDR", "SLURM"),
    Launcher("openmpi", "mpirun (OpenMPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             ("OMPI_COMM_WORLD_LOCAL_RANK",), None, "OPENMPI"),
    Launcher("mpich", "mpiexec (MPICH, Intel MPI)", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
             None, None),
)
BY_NAME = {launcher.name: launcher for launcher in LAUNCHERS}
MPICH_NOTE = ("PhysicsNeMo does not read PMI_* variables: on its own every rank would start as rank 0 of a "
              "one-process job. shardlab.init_distributed maps PMI_RANK/PMI_SIZE/local rank to "
              "RANK/WORLD_SIZE/LOCAL_RANK and uses the ENV method.")
LOCAL_RANK_HINT = {
    "torchrun": ("torchrun sets it for every process; if you set RANK and WORLD_SIZE by hand, also set LOCAL_RANK "
                 "(this process's index on its node, e.g. LOCAL_RANK=$RANK on one machine). Without it PhysicsNeMo "
                 "computes rank % torch.cuda.device_count(), which divides by zero on a machine without GPUs."),
    "mpich": ("Launch with MPICH's hydra mpiexec (it sets MPI_LOCALRANKID), or set LOCAL_RANK yourself."),
}


def example_environment(name: str, rank: int, world_size: int, local_rank: int | None = None,
                        address: str = "127.0.0.1", port: int = 29500) -> dict[str, str]:
    """The variables launcher ``name`` sets for one process (what ``detect_launch`` reads back)."""
    launcher = BY_NAME[name]
    env = {launcher.rank: str(rank), launcher.world_size: str(world_size),
           launcher.local_rank[0]: str(rank if local_rank is None else local_rank)}
    if launcher.address == "MASTER_ADDR":
        env |= {"MASTER_ADDR": address, "MASTER_PORT": str(port)}
    elif launcher.address:
        env[launcher.address] = address
    return env


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


def _int_var(env: Mapping[str, str], name: str, launcher: Launcher) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise LaunchError(f"{name} is not set, but other {launcher.command} variables are. {launcher.command} sets "
                          f"{name} for every process; if you set the variables by hand, set {name} too.")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer; {launcher.command} sets it to this process's "
                          "index.") from None


def _chosen(env: Mapping[str, str]) -> Launcher | None:
    forced = env.get("PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD")
    if forced is not None:
        methods = {each.physicsnemo_method: each for each in LAUNCHERS if each.physicsnemo_method}
        if forced not in methods:
            raise LaunchError(f"PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD={forced!r}; PhysicsNeMo accepts "
                              f"{', '.join(list(methods)[:-1])} or {list(methods)[-1]}. Unset it to let the launcher "
                              "be detected.")
        return methods[forced]
    for launcher in LAUNCHERS:
        present = [name in env for name in (launcher.rank, launcher.world_size)]
        if all(present) if launcher.needs_both else any(present):
            return launcher
    return None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, local rank and world size from the launcher's environment variables.

    Raises LaunchError with a fix when the variables are present but incomplete or wrong.
    """
    env = os.environ if env is None else env
    launcher = _chosen(env)
    port = env.get("MASTER_PORT", DEFAULT_PORT)
    if launcher is None:
        return LaunchInfo("none", 0, 0, 1, env.get("MASTER_ADDR", DEFAULT_ADDRESS), port, None,
                          note="no launcher variables: a single process")
    rank = _int_var(env, launcher.rank, launcher)
    world = _int_var(env, launcher.world_size, launcher)
    local_name = next((name for name in launcher.local_rank if name in env), launcher.local_rank[0])
    if local_name not in env and launcher.name in LOCAL_RANK_HINT:
        missing = ("neither " + " nor ".join(launcher.local_rank) + " is set" if len(launcher.local_rank) > 1
                   else f"{local_name} is not set")
        raise LaunchError(f"{missing[0].upper()}{missing[1:]}. {LOCAL_RANK_HINT[launcher.name]}")
    local = _int_var(env, local_name, launcher)
    if world < 1:
        raise LaunchError(f"{launcher.command}: world size is {world}; it must be at least 1.")
    if not 0 <= rank < world:
        raise LaunchError(f"{launcher.command}: rank {rank} is outside 0..{world - 1} (world size {world}).")
    if not 0 <= local < world:
        raise LaunchError(f"{launcher.command}: local rank {local} is outside 0..{world - 1}.")
    # For Slurm, SLURM_LAUNCH_NODE_IPADDR as PhysicsNeMo reads it (init_distributed corrects it: workarounds, #819).
    address = env.get(launcher.address or "MASTER_ADDR", "" if launcher.address else DEFAULT_ADDRESS)
    return LaunchInfo(launcher.name, rank, local, world, address, port, launcher.physicsnemo_method,
                      note=MPICH_NOTE if launcher.name == "mpich" else "")


# -- starting ranks ---------------------------------------------------------------------------


def clean_environment(**extra: str) -> dict[str, str]:
    """The environment for a job this process starts: its own, without any launcher's variables (a
    kernel started by a launcher must not leak its rank into its jobs), marked as ours, plus ``extra``."""
    launcher_vars = {name for each in LAUNCHERS for name in (each.rank, each.world_size, *each.local_rank)}
    launcher_vars |= {"PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD"}
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    return env | owned.marked_environment() | extra


def job_environment(**extra: str) -> dict[str, str]:
    """``clean_environment`` for a job of ranks on this machine: rank 0 listens on loopback, on a free port."""
    return clean_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra)


@dataclass(frozen=True)
class JobResult:
    """What a job of ranks gave back: rank 0's ``write_job_result`` value (None if it wrote none) and how it ran."""

    result: object
    returncode: int
    seconds: float
    command: list[str]
    stdout: str  # "" when the output was shown rather than kept
    stderr: str
    placement: Placement  # the device its ranks ran on, and why


class JobFailed(RuntimeError):
    """A job of ranks exited non-zero (or wrote no result where one was needed). ``result``: what it wrote, if
    anything; the message gives the exit code and the end of its stderr."""

    def __init__(self, message: str, returncode: int, result=None):
        super().__init__(message)
        self.returncode, self.result = returncode, result


def run_job(launcher: str, n: int, module: str | os.PathLike, args: Sequence[str] = (), *, timeout_s: float,
            env: Mapping[str, str] | None = None, check: bool = True, show_output: bool = False,
            device: str = "auto") -> JobResult:
    """Run ``python -m MODULE ARGS...`` (or the script at a path) on ``n`` ranks with ``launcher`` (torchrun,
    openmpi, mpich or slurm, as ``job_command``), wait for it, and return a ``JobResult``.

    The one way shardlab runs a job of ranks. Rank 0 hands its result back with ``write_job_result`` (a file
    named in the job's environment, so the module needs no option for it: in the job's folder, ``job_folder``, which
    for a Slurm job is in $SHARDLAB_SHARED_DIR when set); ``JobResult.result`` is that value, parsed. Environment:
    this one without any launcher's variables (``clean_environment``), rank 0 on loopback on a free port (a Slurm
    step on several nodes meets on its first node: ``init_distributed``), ``mpi_environment()``, threads and compile
    workers by each rank's share of the cores (``devices.rank_thread_environment``), no GPU when its ranks run on
    CPU (``device``, as ``devices.place_ranks`` decides from the GPUs the ranks see: CUDA ranks when every rank has
    a GPU; then at most ``check_ranks_per_core`` CPU ranks), then ``env``. The result's ``placement`` says what ran.

    Always cleans up: the job's log folder (torchrun's logs, OpenMPI's session folder, the result file) is
    removed, and on time-out or interruption its whole process group is stopped (``subprocesses.run_process_group``);
    a time-out raises a TimeoutError naming the launcher, the rank count and the module. A non-zero exit raises
    JobFailed, with stderr's end; with ``check=False`` it returns instead when the job wrote a result (a check that
    failed on some rank, reported, and the exit code says so). ``show_output``: the job's output goes to this
    process's stdout and stderr as it comes (a command-line tool) instead of into ``JobResult``."""
    program = [str(module)] if isinstance(module, os.PathLike) or str(module).endswith(".py") else ["-m", module]
    what = f"{launcher} job of {n} rank(s) running {module}"
    threads = devices.rank_thread_environment(n)  # OMP_NUM_THREADS and TORCHINDUCTOR_COMPILE_THREADS, unless set
    placement = place_ranks(n, slurm_gpus(n) if launcher == "slurm" else visible_gpus(), device)
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if placement.device == "cpu" else {}
    if hidden and launcher != "slurm":  # CPU ranks on this machine
        check_ranks_per_core(n, usable_cores())
    with job_folder(launcher) as logs:
        result_file = Path(logs, "result.json")
        cmd = job_command(launcher, n, *program, *args, log_dir=logs)  # what it runs, as JobResult.command shows it
        session = mpi_session_environment(logs)  # OpenMPI's session folder goes with the log folder
        own_temp = NODE_OWN_TEMP if launcher == "slurm" else {}  # a Slurm job's ranks may run on other nodes
        job_env = job_environment(**(mpi_environment() | session | threads | hidden | own_temp | dict(env or {})))
        job_env[RESULT_FILE] = str(result_file)
        t0 = time.perf_counter()
        with forkserver.for_job(launcher, logs, job_env) as stub:  # ranks forked from one imported parent
            forked = job_command(launcher, n, *stub, *program, *args, log_dir=logs) if stub else cmd
            proc = subprocesses.run_process_group(forked, job_env, timeout_s, what, capture=not show_output)
        seconds = time.perf_counter() - t0
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    if proc.returncode and (check or result is None):
        missing = "" if result is not None else ", no result written"
        hint = missing and missing_result_hint(launcher)  # a Slurm job's rank 0 may have run on another node
        raise JobFailed(f"{what} failed (exit code {proc.returncode}{missing}).{hint} stderr:\n{proc.stderr[-3000:]}",
                        proc.returncode, result)
    return JobResult(result, proc.returncode, seconds, cmd, proc.stdout, proc.stderr, placement)


# -- on every rank ----------------------------------------------------------------------------


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
    phases: dict = field(default_factory=dict)  # seconds spent in each step of this call
    threads: int = 1  # intra-op threads (torch.get_num_threads): what CPU kernels' speed and scratch depend on
    node_id: int | None = None  # SLURM_NODEID: which node of a Slurm job the rank runs on
    master_addr: str | None = None  # where the ranks met rank 0 (MASTER_ADDR once initialised), or None

    def as_row(self) -> dict:
        return asdict(self)


def _rank_process_settings(timeout: timedelta) -> None:
    """Every process-wide setting a rank needs, in one place (only ever called in rank processes).

    - torch's module default timeouts: device-mesh subgroups are created without a timeout and
      fall back to them (30 min for gloo, 10 min for nccl); a tutorial must fail fast instead.
    - torch's Flight Recorder (on by default, 2,000 entries) shrunk to ``flight.BUFFER_ENTRIES`` (``flight.enable``):
      each rank keeps the collectives it entered, gloo's as well as NCCL's, so a hang can be read on every rank
      (notebook 14, ``sl.ranks.panel``).
    - a warnings filter: PhysicsNeMo 2.2.2 calls a collective that torch 2.14 deprecates, and the
      FutureWarning would print on every rank for every redistribute with nothing to act on.
    """
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    flight.enable()
    c10d.default_pg_nccl_timeout = timeout
    warnings.filterwarnings("ignore", message=r".*all_gather_tensor.* is deprecated", category=FutureWarning)


def rank_gpu(info: LaunchInfo, gpus: int) -> int | None:
    """The index of the GPU this rank uses among the ``gpus`` it sees (None without a GPU): ``devices.gpu_index``,
    a LaunchError naming the rank when it has none."""
    if not gpus:
        return None
    try:
        return gpu_index(info.local_rank, gpus)
    except DeviceError as error:
        raise LaunchError(f"rank {info.rank}: {error}") from None


def init_distributed(timeout: timedelta | float = DEFAULT_TIMEOUT) -> DistributedState:
    """Initialise DistributedManager on this rank, safely on CPU and GPU; calling it again is a no-op.

    ``timeout`` (seconds or timedelta) bounds every collective, including those of mesh
    subgroups, so a rank that never arrives turns into an error instead of a hang.
    """
    # Imported here, not at the top: a notebook kernel uses this module to detect launchers and
    # start jobs, and never pays for torch's and PhysicsNeMo's imports (seconds) unless it initialises a rank.
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager

    phases = {"import torch + PhysicsNeMo": time.perf_counter() - t0}
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    info = detect_launch()
    if info.rank == 0:
        check_result_folder()
    if not DistributedManager.is_initialized():
        gpu = rank_gpu(info, visible_gpus())
        _rank_process_settings(timeout)
        if info.launcher == "mpich":
            os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
            os.environ["PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD"] = "ENV"
            # MPICH does not say where rank 0 listens; PhysicsNeMo's ENV method needs it, and its OpenMPI
            # method assumes these same defaults (one node). Across nodes, set MASTER_ADDR yourself.
            os.environ.setdefault("MASTER_ADDR", DEFAULT_ADDRESS)
            os.environ.setdefault("MASTER_PORT", DEFAULT_PORT)
        with warnings.catch_warnings():
            # Single-process runs make PhysicsNeMo warn that no launcher was found; we report that ourselves.
            warnings.filterwarnings("ignore", message="Could not initialize using ENV")
            with (workarounds.cpu_safe_process_group_init(timeout), workarounds.nccl_errors_raise(),
                  workarounds.gpu_of_this_rank(gpu), workarounds.slurm_rendezvous_on_first_node()):
                if info.launcher != "slurm":  # PhysicsNeMo's Slurm method meets elsewhere than MASTER_ADDR
                    wait_for_rank_zero(info.rank, timeout.total_seconds())
                DistributedManager.initialize()
        phases["process group"] = time.perf_counter() - t0 - sum(phases.values())
        workarounds.no_cross_rank_autograd_cache()
        if not torch.cuda.is_available():
            workarounds.register_shard_ops_on_cpu()
            phases["ShardTensor ops registered (CPU)"] = time.perf_counter() - t0 - sum(phases.values())

    manager = DistributedManager()
    backend = dist.get_backend() if manager.distributed and dist.is_initialized() else None
    # DistributedManager only stores the method for multi-process runs.
    method = getattr(manager, "_initialization_method", None) if backend else None
    return DistributedState(
        launcher=info.launcher, method=method, rank=manager.rank, local_rank=info.local_rank,
        world_size=manager.world_size, device=str(manager.device), backend=backend,
        timeout_s=timeout.total_seconds(), hostname=socket.gethostname(), pid=os.getpid(), phases=phases,
        threads=torch.get_num_threads(), master_addr=os.environ.get("MASTER_ADDR") if backend else None,
        node_id=int(os.environ["SLURM_NODEID"]) if info.launcher == "slurm" and "SLURM_NODEID" in os.environ else None,
    )



def default_device():
    """The device this process computes on: its rank's device once DistributedManager is initialised,
    else the first accelerator, else the CPU."""
    import torch
    from physicsnemo.distributed import DistributedManager

    if DistributedManager.is_initialized():
        return DistributedManager().device
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return torch.device(accelerator.type, 0) if accelerator is not None else torch.device("cpu")  # CPU-only: none


def shutdown_distributed() -> None:
    """End a launched script: every rank tears the process group down together, before interpreter exit.

    Left to PhysicsNeMo's atexit hook, a rank sometimes aborted in C++ ("terminate called without
    an active exception") after all its work had succeeded, turning a good run's exit code into 1.
    """
    from physicsnemo.distributed import DistributedManager

    DistributedManager.cleanup(barrier=True)
