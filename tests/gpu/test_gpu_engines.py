"""What GPU engines hold, with devices simulated: inductor's compile workers bounded per rank (cluster engines and
run_job jobs), a parked cluster giving back what a waiting rank need not hold, and a start on CUDA stopping the parked
clusters that keep CUDA contexts on the GPUs it needs."""

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from shardlab.ranks import cluster as cl
from shardlab.ranks import devices, launch, owned, rankstate, records, warm
from shardlab.ranks.bringup import release_for_parking
from world_sizes import run_job_unstarted

COMPILE = devices.COMPILE_THREADS
CORES = 16


@pytest.fixture
def cores(monkeypatch):
    """A machine of CORES cores, no thread or compile-worker count chosen by the user, and no GPU."""
    monkeypatch.setattr(devices, "usable_cores", lambda: CORES)
    monkeypatch.setattr(launch, "usable_cores", lambda: CORES)
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    monkeypatch.setenv("SHARDLAB_MAX_RANKS_PER_CORE", "64")
    for name in ("OMP_NUM_THREADS", COMPILE):
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch puts back whatever the code under test sets
        monkeypatch.delenv(name)


# -- compile workers per rank -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, share", [(1, 16), (4, 4), (32, 1)])
def test_a_job_gives_each_rank_its_share_of_the_cores_as_threads_and_compile_workers(monkeypatch, cores, n, share):
    env = run_job_unstarted(monkeypatch, n, device="cpu")[1]
    # Unset, every rank that compiles would start min(32, 16) = 16 compile workers of its own.
    assert (env.get("OMP_NUM_THREADS"), env.get(COMPILE)) == (str(share), str(share))


def test_a_job_keeps_the_compile_workers_and_threads_you_chose(monkeypatch, cores):
    monkeypatch.setenv(COMPILE, "6")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = run_job_unstarted(monkeypatch, 4, device="cpu")[1]
    assert (env["OMP_NUM_THREADS"], env[COMPILE]) == ("2", "6")


@pytest.fixture
def rank(monkeypatch, cores):
    """``rankstate.init_rank`` as an engine runs it, without initialising a process group: what it applied."""
    import torch._inductor.config as inductor_config

    applied = {}
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: applied.update(threads=threads))
    monkeypatch.setattr(launch, "init_distributed", lambda timeout_s: SimpleNamespace(as_row=lambda: {}))
    monkeypatch.setattr(rankstate, "_SERIES_STATE", {"noted": "before"})  # this test is about threads, not the reset
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")  # init_rank writes them; put back after

    def init_rank(threads: int) -> dict:
        rankstate.init_rank({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 10, threads)
        return applied | {"config": inductor_config.compile_threads, "env": os.environ.get(COMPILE)}

    # Read at import, before the rank chose: the default of a 32-core machine. patch() puts back the value after.
    with inductor_config.patch(compile_threads=32):
        yield init_rank


def test_an_engine_bounds_its_compile_workers_even_though_inductor_read_its_config_already(rank):
    """PhysicsNeMo's import imports torch._inductor.config, which decides compile_threads once: a warm rank's reset
    comes after it, so the variable alone would be too late; the config itself is set."""
    assert rank(4) == {"threads": 4, "config": 4, "env": "4"}


def test_an_engine_keeps_the_compile_workers_you_chose(rank, monkeypatch):
    monkeypatch.setenv(COMPILE, "6")  # inherited from the kernel: inductor read it at import
    assert rank(4) == {"threads": 4, "config": 32, "env": "6"}


def test_the_variable_is_what_inductor_reads_when_it_is_imported_after_the_rank_chose():
    """A fresh engine: init_rank runs before PhysicsNeMo (and with it torch._inductor.config) is imported."""
    code = ("import sys; from shardlab.ranks import devices; devices.limit_rank_threads(3)\n"
            "assert 'torch._inductor.config' not in sys.modules\n"
            "import torch._inductor.config as c; print('COMPILE_THREADS', c.compile_threads)")
    env = {k: v for k, v in os.environ.items() if k != COMPILE}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "COMPILE_THREADS 3" in out.stdout


def test_cluster_ranks_get_the_same_share_as_jobs(cores):
    assert [devices.threads_per_rank(n) for n in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]
    assert devices.rank_thread_environment(8, env={}) == {"OMP_NUM_THREADS": "2", COMPILE: "2"}


# -- parking gives back what a waiting rank need not hold -------------------------------------------------------


class _Ranks:
    """A client of 2 engines that records what runs on them; ``fail``: what a rank raises when asked to tidy up."""

    def __init__(self, events: list, fail: Exception | None = None):
        self.ids, self.outstanding, self.events, self.fail = [0, 1], set(), events, fail

    def __getitem__(self, _targets):
        return self

    def _answer(self, what: str):
        self.events.append(what)

        def get():
            if self.fail is not None and what == "park_rank":
                raise self.fail
            return [None, None]

        return SimpleNamespace(wait=lambda timeout=None: True, get=get)

    def execute(self, code, block=False):
        return self._answer(code)

    def apply_async(self, function, *args):
        return self._answer(function.__name__)

    def close(self):
        self.events.append("client closed")


def _pooled_cluster(monkeypatch, events: list, fail: Exception | None = None) -> cl.RankCluster:
    """An RankCluster of 2 CPU ranks, started in a pool (nothing started for real)."""
    cluster = cl.RankCluster(n=2, device="cpu")
    cluster.pool, cluster.client, cluster.view = SimpleNamespace(), _Ranks(events, fail), object()
    cluster._cluster, cluster._record = SimpleNamespace(shutdown_atexit=True), SimpleNamespace(processes=[])
    cluster.states = [{"rank": 0, "pid": os.getpid()}, {"rank": 1, "pid": os.getpid()}]
    monkeypatch.setattr(warm, "park", lambda pool, record, shape: events.append("parked"))
    monkeypatch.setattr(cl.RankCluster, "_shut_down", lambda self: events.append("stopped"))
    return cluster


def test_a_cluster_gives_back_its_namespace_groups_and_cached_memory_before_it_is_parked(monkeypatch):
    events = []
    cluster = _pooled_cluster(monkeypatch, events)
    cluster.stop()
    assert events == ["%reset -f", "park_rank", "client closed", "parked"] and cluster.parked


def test_a_cluster_whose_ranks_cannot_tidy_up_is_stopped_not_parked(monkeypatch):
    events = []
    cluster = _pooled_cluster(monkeypatch, events, fail=RuntimeError("NCCL communicator hangs"))
    cluster.stop()
    assert events == ["%reset -f", "park_rank", "stopped"] and not cluster.parked
    assert release_for_parking(_Ranks([], fail=TimeoutError())) is False


def test_a_parked_rank_gives_back_its_groups_and_gpu_memory_but_keeps_its_cuda_context(monkeypatch):
    """On a simulated GPU rank: every process group torn down (NCCL's buffers), then GPU work finished, cuBLAS's
    workspaces dropped and the caching allocator emptied. Nothing destroys the CUDA context (torch has no call)."""
    import torch.distributed as dist
    from physicsnemo.distributed import DistributedManager

    calls = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2**20)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cuBLAS workspaces"),
                        raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a rank's world group
    monkeypatch.setattr(DistributedManager, "_shared_state", {"_is_initialized": True, "_distributed": True})
    try:
        assert rankstate.park_rank() == {"cuda_reserved": 2**20}
        assert not dist.is_initialized() and DistributedManager._shared_state == {}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert calls == ["synchronize", "cuBLAS workspaces", "empty_cache"]


# -- a start on CUDA stops the parked clusters that hold GPUs ---------------------------------------------------


@pytest.fixture
def pool(pool, monkeypatch):
    monkeypatch.setenv(warm.POOL, str(pool.folder))  # conftest's pool, as this kernel's
    return pool


def _park_marker(pool, cluster_id: str, shape: dict) -> None:
    """A parked cluster as ``warm.park`` leaves it, parked by another kernel, with a live keeper (this process)."""
    me, parent = list(owned.identity()), list(owned.identity(os.getppid()))
    records.Record(cluster_id, *me, profile_dir="", folder=str(pool.folder)).save()
    warm.Parked(str(pool.folder / f"{cluster_id}{warm.PARKED}"), cluster_id, shape, parent, time.time() + 60,
                me).save()


@pytest.fixture
def four_gpus(monkeypatch):
    for var in ("SHARDLAB_RANKS", "SHARDLAB_ENGINES", "SLURM_JOB_ID", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
                "SLURM_GPUS_PER_TASK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for module in (devices, cl, launch):
        monkeypatch.setattr(module, "visible_gpus", lambda: 4, raising=False)


class _Started(Exception):
    """Raised where a start would create its controller and engines: everything before it has run."""


def _start_until_engines(monkeypatch, cluster: cl.RankCluster) -> None:
    def prepare(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(cl, "prepare", prepare)
    with pytest.raises(_Started):
        cluster.start()


@pytest.mark.parametrize("keep_warm", [True, False])
def test_a_start_on_cuda_first_stops_a_parked_cuda_cluster_of_another_shape(monkeypatch, pool, four_gpus, capsys,
                                                                            keep_warm):
    on_cuda = warm.shape_of(2, "cuda", "mpi", "openmpi", "127.0.0.1", None)
    _park_marker(pool, "shardlab-gpu", on_cuda)  # notebook A parked 2 CUDA ranks
    cluster = cl.RankCluster(n=4, device="cuda", keep_warm=keep_warm)  # notebook B wants all 4 GPUs
    assert cluster.shape != on_cuda
    _start_until_engines(monkeypatch, cluster)
    assert pool.parked() == [] and not records.records_in(pool.folder)
    assert "Stopped the parked cluster shardlab-gpu: its ranks held GPUs" in capsys.readouterr().out


def test_a_start_on_cpu_leaves_a_parked_cuda_cluster_parked(monkeypatch, pool, four_gpus):
    _park_marker(pool, "shardlab-gpu", warm.shape_of(2, "cuda", "mpi", "openmpi", "127.0.0.1", None))
    _start_until_engines(monkeypatch, cl.RankCluster(n=2, device="cpu", keep_warm=True))
    assert [p.cluster_id for p in pool.parked()] == ["shardlab-gpu"]


def test_stop_parked_on_cuda_stops_only_clusters_on_cuda(pool):
    _park_marker(pool, "shardlab-gpu", warm.shape_of(2, "cuda", "mpi", "openmpi", "127.0.0.1", None))
    _park_marker(pool, "shardlab-cpu", warm.shape_of(2, "cpu", "mpi", "openmpi", "127.0.0.1", None))
    assert warm.stop_parked_on_cuda(pool) == ["shardlab-gpu"]
    assert [p.cluster_id for p in pool.parked()] == ["shardlab-cpu"]
