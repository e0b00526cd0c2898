"""The cluster a notebook owns: ipyparallel engines, one per rank, driven with ``%%px``; its start, stop and restart.

Started by mpiexec on this machine or by Slurm, so that the same notebooks run unchanged on a laptop, an MPICH machine
and a Slurm cluster. What it starts is resolved once into ``settings.Settings`` (the arguments of
``RankCluster``/``start_cluster``, else the environment: ``settings`` lists the variables), which the cluster keeps.
How each way starts its engines is ``engine_launchers``' business; bringing the ranks up (controller, engines, ranks
initialised, or a parked cluster taken over), ``bringup``'s; what a ``%%px`` cell does, ``px``'s; keeping ranks for
the next notebook, ``warm``'s. This module keeps the cluster's life: start (fresh or claimed), stop (or park) and
restart.
Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import uuid
from collections.abc import Sequence

import ipyparallel as ipp
import psutil

from . import beacon, launch, owned, records, settings, warm
from .bringup import PortTaken, bring_up, idle_and_alive, prepare, record_started, release_for_parking, take_over
from .engine_launchers import engine_launcher
from .panel import RankPanel
from .px import PxCells, StatusLine, wait_for

START_TIMEOUT_S = 120.0
START_ATTEMPTS = 3  # a start whose controller port another start took meanwhile (bringup.PortTaken) is made again


def process_roles(states: list[dict], controller) -> dict[int, str]:
    """What each process of a cluster is, by pid: every rank's engine (its nanny, a small helper that forwards
    interrupts, counted with it) and the controller; anything else of the cluster is its launcher."""
    roles = {pid: f"rank {state['rank']} engine" + ("" if pid == state["pid"] else " (nanny)")
             for state in states for pid, _ in owned.process_tree(state["pid"])}
    for pid, _ in owned.process_tree(controller.process.pid) if getattr(controller, "process", None) else []:
        roles.setdefault(pid, "controller")
    ranks = {state["pid"]: state["rank"] for state in states}
    for state in states[:1]:  # forked engines' parent is the cluster's fork server (``forkserver``), their nannies'
        with contextlib.suppress(psutil.Error):  # too, each named by its engine's pid (``forkchild.start_nanny``)
            if "shardlab.ranks.forkserver" in (server := psutil.Process(state["pid"]).parent()).cmdline():
                roles.setdefault(server.pid, "fork server")
                for child in server.children():
                    line = child.cmdline()
                    if line[1:3] == ["-m", "ipyparallel.engine.nanny"] and line[3:] and line[3].isdigit():
                        roles[child.pid] = f"rank {ranks.get(int(line[3]), '?')} engine (nanny)"
    return roles


class RankCluster:
    """ipyparallel engines started by ``mpiexec`` (or Slurm), each a rank with DistributedManager initialised.

    Use as a context manager, or call ``stop()``; a kernel that exits stops it too.
    """

    def __init__(self, n: int | None = None, device: str = "auto", timeout_s: float | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, cluster_id: str | None = None,
                 engines: str | None = None, controller_ip: str | None = None, mpi: str | None = None,
                 shared_dir: str | os.PathLike | None = None, slurm_args: Sequence[str] = (), keep_warm: bool = False):
        """``engines``: "mpi" (mpiexec here) or "slurm"; ``mpi``: "openmpi" or "mpich" (which mpiexec);
        ``controller_ip``: where the controller listens; ``shared_dir``: the folder for the profile (connection
        files, engine config, logs) when engines run on other nodes; ``slurm_args``: extra options for the
        engines' job (``#SBATCH`` lines, or srun options inside an allocation), e.g. ["--partition=gpu"].
        Unset, each is read from its environment variable (``settings``), then the defaults.
        ``start_timeout_s``: how long the engines may take to register, and to initialise per CPU core's share of
        ranks (8 ranks on 2 cores wait 4 times as long). ``keep_warm``: in a pool of warm clusters
        (``$SHARDLAB_WARM_POOL``, see ``warm``), ``start()`` claims a parked cluster of this shape and resets it, and
        ``stop()`` parks it; mpiexec engines only."""
        self.settings = settings.resolve(n, device, engines, mpi, slurm_args, controller_ip, shared_dir)
        self.cluster_id = cluster_id or f"shardlab-{uuid.uuid4().hex[:8]}"
        self.engine_launcher = engine_launcher(self.settings, self.job_name)
        self.timeout_s = launch.DEFAULT_TIMEOUT.total_seconds() if timeout_s is None else float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.pool = warm.Pool.from_environment() if keep_warm and self.settings.engines == "mpi" else None
        self.attached = self.parked = False  # claimed a parked cluster at start; parked at stop
        self.states: list[dict] = []
        self.start_seconds: float | None = None
        self.timings: dict[str, float] = {}
        self._cluster = self.client = self.view = self._record = self._px = self._activated = self._panel = None

    n = property(lambda self: self.settings.n, doc="How many ranks.")
    placement = property(lambda self: self.settings.placement, doc="The device the ranks run on, and why.")
    device = property(lambda self: self.settings.device, doc="'cpu' or 'cuda'.")
    engines = property(lambda self: self.settings.engines, doc="What starts the engines: 'mpi' or 'slurm'.")
    mpi = property(lambda self: self.settings.mpi, doc="Which mpiexec: 'openmpi' or 'mpich'.")
    slurm_args = property(lambda self: list(self.settings.slurm_args), doc="Extra options of the engines' job.")
    controller_ip = property(lambda self: self.settings.controller_ip, doc="Where the controller listens.")
    shared_dir = property(lambda self: self.settings.shared_dir, doc="Where the profile folder goes (None: temp).")
    launcher = property(lambda self: self.engine_launcher.name, doc="What starts the engines: openmpi, mpich, slurm.")
    expected_method = property(lambda self: self.engine_launcher.expected_method,
                               doc="The initialisation method DistributedManager reports on every engine.")
    job_name = property(lambda self: f"ipengine-{self.cluster_id}", doc="The engines' Slurm job name (sbatch).")
    slurm_jobs = property(lambda self: list(self._record.jobs) if self._record else [],
                          doc="Ids of the Slurm jobs this cluster submitted (none inside an allocation, or mpiexec).")
    profile_dir = property(lambda self: self._record.profile_dir if self._record else None,
                           doc="This start's profile folder (connection files, engine config, logs).")

    threads = property(lambda self: min(s["threads"] for s in self.states) if self.states else None,
                       doc="Intra-op threads per rank (the cores ranks share, divided): what the planner measures "
                           "CPU kernels with.")
    shape = property(lambda self: warm.shape_of(self.n, self.device, self.engines, self.mpi, self.controller_ip,
                                                self.shared_dir), doc="What a parked cluster must match to be claimed.")

    def start(self, attach: bool = True) -> RankCluster:
        """Start the ranks; in a pool (``keep_warm``), claim and reset a parked cluster of this shape instead,
        unless ``attach`` is False. Says what it did in one line: "started 4 CPU ranks in 11.9 s" (counting the ranks
        as they register meanwhile, ``px.StatusLine``) or "took over 4 warm CPU ranks ..., reset in 3.3 s"."""
        records.clean_stale_clusters()
        if self.pool is not None:
            if attach and (record := warm.claim(self.pool, self.shape)) is not None and self._attach(record):
                return self
            warm.evict_own(self.pool, self.shape)
        self._free_gpus()
        if note := self.engine_launcher.note():
            print(note)
        t0, status = time.perf_counter(), StatusLine()
        for attempt in range(1, START_ATTEMPTS + 1):
            self._cluster, self._record, options = prepare(self.cluster_id, self.job_name, self.engine_launcher,
                                                           self.n, self.controller_ip, self.shared_dir, self.pool)
            atexit.register(self.stop)
            try:
                up = bring_up(self._cluster, self.engine_launcher, self._record, self.n, options, self.timeout_s,
                              self.start_timeout_s, status.update)
                self.client, self.view, self.states, self.timings = up
                break
            except BaseException as error:
                if isinstance(error, PortTaken) and attempt < START_ATTEMPTS:
                    self._shut_down()
                    print(f"{error}: starting again with other ports.")
                    continue
                status.done(f"could not start {self.placement.label} ({time.perf_counter() - t0:.1f} s): see the "
                            "error")
                self.stop()
                raise
        self.start_seconds = time.perf_counter() - t0
        status.done(f"started {self.placement.label} in {self.start_seconds:.1f} s")
        return self

    def _free_gpus(self) -> None:
        """Before CUDA engines start: stop the parked clusters on CUDA of this kernel's pool, whatever their shape
        (``warm.stop_parked_on_cuda``: a parked rank keeps its CUDA context), saying so. Also without ``keep_warm``:
        their GPUs are needed all the same."""
        if self.device != "cuda" or (pool := self.pool or warm.Pool.from_environment()) is None:
            return
        for cluster_id in warm.stop_parked_on_cuda(pool):
            print(f"Stopped the parked cluster {cluster_id}: its ranks held GPUs that these CUDA engines need.")

    def _attach(self, record: records.Record) -> bool:
        """Take over a claimed parked cluster (``bringup.take_over``); False (and the cluster stopped) if it did not
        come back well, so that a fresh start follows."""
        t0 = time.perf_counter()
        self.cluster_id, self._record = record.cluster_id, record
        try:
            self._cluster, self.client, view, self.states, self.timings = take_over(record, self.n, self.timeout_s)
        except Exception as error:  # whatever went wrong, new ranks are the answer
            print(f"The parked cluster {record.cluster_id} did not come back ({type(error).__name__}: "
                  f"{str(error)[:200]}): starting new ranks.")
            # Only so that _shut_down runs: it stops every process the record lists.
            self._cluster = ipp.Cluster(profile_dir=record.profile_dir, cluster_id=record.cluster_id,
                                        shutdown_atexit=False)
            self._shut_down()
            self.cluster_id, self.timings = f"shardlab-{uuid.uuid4().hex[:8]}", {}
            return False
        atexit.register(self.stop)
        self.attached, self.view, self.start_seconds = True, view, time.perf_counter() - t0
        StatusLine().done(f"took over {self.n} warm {self.device.upper()} rank{'s' if self.n > 1 else ''} from a "
                          f"previous notebook, reset in {self.start_seconds:.1f} s")
        return True

    def wait(self, async_result, timeout_s: float, what: str, view=None):
        """Wait for an ipyparallel result; on time-out, name the ranks that did not answer."""
        targets = (view or self.view or self.client[:]).targets
        return wait_for(async_result, list(self.client.ids) if targets in (None, "all") else list(targets),
                        timeout_s, what)

    def run(self, code: str, timeout_s: float = 120.0, what: str = "finish the code"):
        """Execute code on every rank and wait at most timeout_s; a time-out names the ranks still busy."""
        return self.wait(self.view.execute(code, block=False), timeout_s, what)

    def activate(self, progress: bool | None = None, cell_timeout_s: float | None = None) -> RankCluster:
        """Make ``%%px`` run on every rank, blocking, with output grouped by rank and a per-rank error summary; a
        cell busy on some rank past ``cell_timeout_s`` (default: ``px.resolve_cell_timeout``) fails, naming them.
        ``progress``: a bar of the ranks done for a cell still running after 2 s (default: ``px.progress_wanted``)."""
        if self._px is not None:
            self._px.stop()
        self._activated = {"progress": progress, "cell_timeout_s": cell_timeout_s}
        self._px = PxCells(self.view, list(self.client.ids), progress, cell_timeout_s,
                           hosts={s["rank"]: s["hostname"] for s in self.states})
        return self

    def restart(self) -> RankCluster:
        """Stop whatever is left (e.g. after an engine died: MPI takes the whole job down) and start
        the same number of fresh ranks; ``%%px`` points at them if it pointed at the old ones."""
        activated = self._activated
        self._shut_down()
        self.cluster_id, self.timings = f"shardlab-{uuid.uuid4().hex[:8]}", {}
        self.engine_launcher = engine_launcher(self.settings, self.job_name)
        self.attached = self.parked = False
        self.start(attach=False)
        return self.activate(**activated) if activated is not None else self

    def alive_processes(self) -> list[int]:
        """PIDs of this cluster's engines, controller and launcher that are still running (none once parked: a
        parked cluster belongs to its pool's keeper, not to this notebook)."""
        return [p.pid for p in owned.alive(self._record.processes)] if self._record and not self.parked else []

    def panel(self) -> RankPanel:
        """Every rank's state, updated live, also while a ``%%px`` cell runs (``panel.RankPanel``): running, idle or
        failed, seconds in the cell, the last collective, memory, and whom waiting ranks wait for. Show it as the last
        line of a cell. One per start of the cluster; ``stop()`` and ``restart()`` stop it."""
        if self._panel is None:
            self._panel = RankPanel(beacon.status_folder(self.profile_dir),
                                    {s["rank"]: (s["hostname"], s["pid"]) for s in self.states})
        return self._panel

    def _stop_panel(self) -> None:
        if self._panel is not None:
            self._panel.stop()
            self._panel = None

    def table(self) -> list[dict]:
        """Every rank's DistributedManager state, as rows."""
        return self.states

    def memory(self) -> list[dict]:
        """Memory of this cluster's processes on this node, one row each, in MiB (``owned.memory_rows``; roles:
        ``process_roles``): every rank's engine, the controller and the launcher."""
        roles = process_roles(self.states, getattr(self._cluster, "controller", None))
        return owned.memory_rows(self._record.processes if self._record else [], roles)

    def stop(self) -> None:
        """Stop engines and controller, cancel the engines' Slurm job, then kill anything of this cluster still
        alive; returns once the job has left the queue. In a pool (``keep_warm``), a cluster whose ranks are all
        alive and idle is parked instead, for the next notebook."""
        if self._px is not None:
            self._px.stop()
        self._stop_panel()  # before parking: the ranks stop writing for a panel nobody will read
        if self._cluster is None or (self.pool is not None and self._park()):
            return
        self._shut_down()

    def _park(self) -> bool:
        """Hand the cluster to the pool if every rank is alive and idle, once each gave back what a waiting rank need
        not hold (``bringup.release_for_parking``); else False: it is stopped instead."""
        if not idle_and_alive(self.client, self.n, self.states) or not release_for_parking(self.client):
            return False
        cluster, self._cluster = self._cluster, None
        cluster.shutdown_atexit = False  # ipyparallel would stop it when this kernel exits
        self.client.close()
        warm.park(self.pool, self._record, self.shape)
        atexit.unregister(self.stop)
        self.parked, self.view = True, None
        return True

    def _shut_down(self) -> None:
        """Stop the cluster for good, parked or not."""
        if self._px is not None:
            self._px.stop()
        self._stop_panel()
        if self._cluster is None:
            return
        cluster, self._cluster = self._cluster, None
        record_started(self._record, self.engine_launcher, None, self.states)  # jobs submitted since
        for close in (self.client.close if self.client is not None else None, cluster.stop_cluster_sync):
            try:
                if close is not None:
                    close()
            except Exception:  # a dead controller cannot be closed politely; whatever is left is killed below
                pass
        self._record.clean_up(grace_s=1.0)
        atexit.unregister(self.stop)
        self.view = None

    def __enter__(self) -> RankCluster:
        return self.start() if self._cluster is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(n: int | None = None, *, device: str = "auto", timeout_s: float | None = None,
                  activate: bool = True, cell_timeout_s: float | None = None, keep_warm: bool = True,
                  **options) -> RankCluster:
    """Start ``n`` engines (default: ``$SHARDLAB_RANKS``, else one per GPU, else 4 CPU ranks) and make
    ``%%px`` run on all of them. ``device``: "auto" (``devices.place_ranks``: CUDA engines when every engine has
    a GPU, CPU ranks with no GPU or one; more engines than two or more GPUs is refused), "cpu" or "cuda".

    ``options`` go to RankCluster, e.g. ``engines="slurm", controller_ip="*"`` on a Slurm cluster (inside an
    allocation srun starts the engines in it; outside, an sbatch job does), or ``mpi="mpich"``. Unset, they
    come from ``$SHARDLAB_ENGINES``, ``$SHARDLAB_MPI``, ``$SHARDLAB_CONTROLLER_IP`` and ``$SHARDLAB_SHARED_DIR``,
    so unchanged notebooks run on Slurm engines with e.g. ``SHARDLAB_ENGINES=slurm SHARDLAB_CONTROLLER_IP='*'``.

    Under ``make lab`` (a pool of warm clusters, ``warm``), the ranks the previous notebook stopped are reused,
    reset to a fresh start's state, in seconds (``cluster.attached`` says so), and ``cluster.stop()`` keeps them
    for the next notebook; ``keep_warm=False`` always starts and stops ranks of its own.
    """
    cluster = RankCluster(n=n, device=device, timeout_s=timeout_s, keep_warm=keep_warm, **options)  # refused here
    for earlier in _started_here:  # a notebook run again (Run All, Run All Above) reaches its setup cell again
        if earlier._cluster is not None:
            print(f"Stopping this kernel's cluster from an earlier run ({earlier.placement.label}) first: one set of "
                  "ranks at a time.")
            earlier.stop()
    _started_here[:] = [cluster.start()]
    return cluster.activate(cell_timeout_s=cell_timeout_s) if activate else cluster


_started_here: list[RankCluster] = []  # what start_cluster started in this process

