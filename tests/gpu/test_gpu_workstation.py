"""`make test` on a GPU workstation: every test that starts a fixed number of ranks (tests/support/world_sizes.py's
``NEEDS``) runs them on CPU ranks on purpose, or on GPUs that can hold them, or skips saying what it needs; never into
the device rule's refusal (more ranks than GPUs on a node with two or more), never asserting gloo on NCCL ranks. The GPU
count is simulated (0, 1, 2, 3, 4 and 8 GPUs, on a 16-core workstation), and each test's own way of starting its ranks
is run up to the point where the launch path places them: ``run_job``, ``RankCluster``, or a command-line tool or
notebook kernel that places its ranks itself and sees no GPU when the test hides them."""

import ast
import re
from pathlib import Path

import nbformat
import pytest
import torch

import world_sizes as ranks
from shardlab.ranks import cluster as cl
from shardlab.ranks import commands, devices, engine_launchers, launch
from shardlab.ranks.devices import DeviceError

GPU_COUNTS = (0, 1, 2, 3, 4, 8)
CORES = 16
TESTS = Path(__file__).resolve().parents[1]
CASES = [(need, n) for need in ranks.NEEDS for n in need.sizes]


def _name(need: ranks.Need) -> str:
    return next(name for name, value in vars(ranks).items() if value is need)


@pytest.fixture
def workstation(monkeypatch):
    """A workstation of ``CORES`` cores whose ranks see ``count`` GPUs: ``set(count)``, again for what a process that
    the test starts with ``env`` sees."""
    monkeypatch.delenv("SHARDLAB_MAX_RANKS_PER_CORE", raising=False)
    for var in ("SHARDLAB_RANKS", "SHARDLAB_ENGINES", "SHARDLAB_MPI", "SLURM_JOB_ID", "SLURM_GPUS",
                "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    for module in (devices, launch, engine_launchers, commands):
        monkeypatch.setattr(module, "usable_cores", lambda: CORES, raising=False)

    def set_count(count: int) -> None:
        for module in (devices, cl, launch):
            monkeypatch.setattr(module, "visible_gpus", lambda: count, raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return set_count


def _start(need: ranks.Need, n: int, count: int, device: str, env: dict, workstation, monkeypatch) -> tuple[str, bool]:
    """Where the launch path the test of ``need`` uses puts its ``n`` ranks on a machine of ``count`` GPUs, and
    whether they see no GPU, when the test passes ``device`` where it can and starts its process with ``env``."""
    child_sees = 0 if env.get("CUDA_VISIBLE_DEVICES") == "" else count  # a CLI or a kernel the test starts with env
    if need is ranks.SMOKE:  # run_job("openmpi", n, device=...) in the test's own process
        workstation(count)
        placement, job_env = ranks.run_job_unstarted(monkeypatch, n, "openmpi", device)
        return placement.device, job_env.get("CUDA_VISIBLE_DEVICES") == ""
    if need in (ranks.MEASURE, ranks.PLANNER):  # the CLI, started with env, runs run_job("torchrun", n) itself
        workstation(child_sees)
        placement, job_env = ranks.run_job_unstarted(monkeypatch, n)
        return placement.device, job_env.get("CUDA_VISIBLE_DEVICES") == ""
    monkeypatch.setenv("SHARDLAB_RANKS", str(n))
    if need is ranks.DEFAULT_SIZE:  # RankCluster(device=...) in the test's own process
        workstation(count)
        cluster = cl.RankCluster(device=device)
    elif need is ranks.NOTEBOOK_SIZES:  # the kernel, started with env, runs sl.start_cluster() (no device setting)
        workstation(child_sees)
        cluster = cl.RankCluster()
    else:
        raise AssertionError(f"{_name(need)}: say here how {need.file}::{need.test} starts its ranks")
    assert cluster.n == n
    return cluster.device, engine_launchers.engine_environment(cluster.device).get("CUDA_VISIBLE_DEVICES") == ""


@pytest.mark.parametrize("count", GPU_COUNTS)
@pytest.mark.parametrize("need, n", CASES, ids=[f"{_name(need)}-{n}ranks" for need, n in CASES])
def test_each_fixed_size_runs_on_cpu_on_purpose_or_on_gpus_that_hold_it(monkeypatch, workstation, need, n, count):
    workstation(count)
    placed = need.ranks(n)
    assert placed.gpus == count and not placed.skip, placed  # a 16-core workstation serves every size
    device, no_gpu = _start(need, n, count, placed.device, placed.env, workstation, monkeypatch)  # never refused
    assert device == placed.device, (need.test, count, placed)
    if need.cpu:  # CPU ranks on every machine, the GPUs hidden from them: gloo, as the test asserts
        assert (device, no_gpu) == ("cpu", True), (need.test, count)
    elif n <= count:  # GPUs that hold the ranks: one each
        assert (device, no_gpu) == ("cuda", False), (need.test, count)
    else:  # CPU ranks, by the rule (no GPU or one) or on purpose where the rule refuses (2 to n-1 GPUs)
        assert (device, no_gpu) == ("cpu", True), (need.test, count)
        assert count <= 1 or placed.env == ranks.HIDE_GPUS, placed

    # As the test started its ranks before it asked tests/support/world_sizes.py (device "auto", nothing hidden):
    # refused on 2 to
    # n-1 GPUs, and CUDA (NCCL) ranks where the test is about CPU ranks. The simulated count reaches the launch path.
    if 2 <= count < n:
        with pytest.raises(DeviceError, match=rf"{n} ranks but {count} GPU\(s\)"):
            _start(need, n, count, "auto", {}, workstation, monkeypatch)
    elif need.cpu and n <= count:
        assert _start(need, n, count, "auto", {}, workstation, monkeypatch) == ("cuda", False)


@pytest.mark.parametrize("need", ranks.NEEDS, ids=_name)
def test_each_need_is_the_one_its_test_asks(need):
    """The registry is what the tests do: the test named by a Need asks it for its ranks (``NAME.ranks(...)``)."""
    tree = ast.parse((TESTS / need.file).read_text())
    test = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == need.test),
                None)
    assert test is not None, f"{need.file} has no {need.test}: update {_name(need)} in tests/support/world_sizes.py"
    asks = [node for node in ast.walk(test) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "ranks" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == _name(need)]
    assert asks, f"{need.file}::{need.test} does not take its ranks from {_name(need)}.ranks()"


def test_a_size_the_registry_does_not_list_is_refused():
    with pytest.raises(ValueError, match=r"runs 16 ranks: add 16 to its Need in tests/support/world_sizes.py"):
        ranks.NOTEBOOK_SIZES.ranks(16, gpus=0)


@pytest.mark.parametrize("count", GPU_COUNTS)
def test_cpu_ranks_a_machine_would_refuse_are_a_skip_that_says_what_they_need(monkeypatch, count):
    monkeypatch.delenv("SHARDLAB_MAX_RANKS_PER_CORE", raising=False)
    monkeypatch.setattr(devices, "usable_cores", lambda: 1)
    placed = ranks.ranks_for_test(8, gpus=count)
    if count >= 8:  # one GPU each: no CPU rank to refuse
        assert (placed.device, placed.skip) == ("cuda", None)
        return
    assert placed.device is None
    assert re.search(r"needs 8 CPU ranks .*8 CPU ranks on 1 CPU core.*SHARDLAB_MAX_RANKS_PER_CORE=8", placed.skip)
    with pytest.raises(pytest.skip.Exception, match="needs 8 CPU ranks"):
        placed.or_skip()
    assert ranks.ranks_for_test(4, cpu=True, gpus=count).device == "cpu"  # at the limit: served


# -- the fixture notebooks: collectives on the rank's device ---------------------------------------------------

FACTORIES = {"ones", "zeros", "full", "empty", "tensor", "randn", "rand", "arange", "ones_like", "zeros_like"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "all_to_all", "send", "recv", "scatter", "gather"}


def tensors_off_the_ranks_device(source: str) -> list[str]:
    """In a ``%%px`` cell that runs a collective: each tensor made without ``device=``, i.e. on the CPU, which NCCL
    ranks (a GPU node, 2 ranks on 2 or more GPUs) cannot all-reduce."""
    code = ast.parse(source.split("\n", 1)[1] if source.startswith("%%px") else source)
    calls = [node for node in ast.walk(code) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    if not any(call.func.attr in COLLECTIVES for call in calls):
        return []
    return [ast.unparse(call) for call in calls if call.func.attr in FACTORIES and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "torch" and not any(k.arg == "device" for k in call.keywords)]


def test_the_device_check_catches_a_cpu_tensor_in_a_collective():
    assert tensors_off_the_ranks_device("%%px\nt = torch.ones(1)\ndist.all_reduce(t)") == ["torch.ones(1)"]
    assert not tensors_off_the_ranks_device("%%px\nt = torch.ones(1, device=device)\ndist.all_reduce(t)")
    assert not tensors_off_the_ranks_device("%%px\nt = torch.ones(1)\nprint(t)")  # no collective


@pytest.mark.parametrize("path", sorted((TESTS / "fixtures").glob("*.ipynb")), ids=lambda p: p.stem)
def test_fixture_collectives_use_the_ranks_device(path):
    """The fixtures run under nbmake with ``sl.start_cluster(n=2)``: NCCL ranks wherever there are two GPUs or more."""
    cells = [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
    found = [tensor for source in cells if source.startswith("%%px") for tensor in tensors_off_the_ranks_device(source)]
    assert not found, f"{path.name}: tensors made on the CPU for a collective (make them on the rank's device): {found}"
