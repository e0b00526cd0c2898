"""The GPU path, with the GPU count simulated: one device rule (``shardlab.ranks.devices``) that the cluster, run_job,
the smoke CLI, bench, measure and gpucheck all follow for 0, 1, 2, 4 and 8 GPUs, with CUDA_VISIBLE_DEVICES slices
and one GPU per Slurm task; gpucheck's plan of rows per GPU count; strict_fp32 in either order of the TF32 APIs;
cores from the affinity mask. No GPU needed: every GPU decision is a function of plain inputs or a patched count."""

import json
from types import SimpleNamespace

import pytest
import torch

from shardlab.measure import tables as measure_tables
from shardlab.ranks import cluster as cl
from shardlab.ranks import commands, devices, engine_launchers, launch
from shardlab.ranks.devices import DeviceError, place_ranks
from shardlab.tools import bench, gpucheck, smoke
from world_sizes import run_job_unstarted

GPU_COUNTS = (0, 1, 2, 4, 8)


@pytest.fixture
def gpus(monkeypatch):
    """Pretend the ranks of this machine see ``count`` GPUs: ``set(count)``."""
    monkeypatch.setenv("SHARDLAB_MAX_RANKS_PER_CORE", "64")
    for var in ("SHARDLAB_RANKS", "SHARDLAB_ENGINES", "SLURM_JOB_ID", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
                "SLURM_GPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)

    def set_count(count: int) -> None:
        monkeypatch.setattr(devices, "visible_gpus", lambda: count)
        for module in (cl, launch, bench, gpucheck, smoke):
            monkeypatch.setattr(module, "visible_gpus", lambda: count, raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "simulated GPU")

    return set_count


# -- the rule ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", GPU_COUNTS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_the_rule_one_gpu_per_rank_cpu_ranks_with_fewer_than_two_gpus_else_refused(n, count):
    if n <= count:
        expected = "cuda"
    elif count <= 1:
        expected = "cpu"
    else:
        with pytest.raises(DeviceError, match=rf"{n} ranks but {count} GPU\(s\).*SHARDLAB_RANKS={count}.*"
                                              rf"device='cpu' for {n} CPU ranks"):
            place_ranks(n, count)
        assert place_ranks(n, count, "cpu").device == "cpu"  # asked for: allowed
        return
    placement = place_ranks(n, count)
    assert (placement.device, placement.ranks) == (expected, n)
    assert placement.label == f"{n} {expected.upper()} rank{'s' if n > 1 else ''}"


def test_one_gpu_runs_one_rank_jobs_on_cuda_and_clusters_on_cpu_ranks():  # bug 2
    assert place_ranks(1, 1).device == "cuda"
    assert place_ranks(4, 1).device == "cpu" and "one GPU cannot hold two NCCL ranks" in place_ranks(4, 1).why


@pytest.mark.parametrize("n, count, device", [(3, 2, "cuda"), (1, 0, "cuda"), (2, 2, "tpu")])
def test_impossible_or_unknown_devices_are_refused(n, count, device):
    with pytest.raises(DeviceError, match="device='cpu'|use 'auto', 'cpu' or 'cuda'"):
        place_ranks(n, count, device)


# -- everything follows it ---------------------------------------------------------------------------------------


def _bench_device(monkeypatch, n: int) -> str:
    class Chosen(Exception):
        pass

    def first_job(launcher, n, name, device):
        raise Chosen(device)

    monkeypatch.setattr(bench, "_job", first_job)
    with pytest.raises(Chosen) as chosen:
        bench.run(n)
    return chosen.value.args[0]


@pytest.mark.parametrize("count", GPU_COUNTS)
def test_cluster_run_job_smoke_bench_measure_and_gpucheck_choose_alike(monkeypatch, gpus, count):  # bug 3
    gpus(count)
    for n in (1, 2, 4, 8):
        try:
            expected = place_ranks(n, count)
        except DeviceError:
            with pytest.raises(DeviceError):
                cl.RankCluster(n=n)
            with pytest.raises(DeviceError):
                run_job_unstarted(monkeypatch, n)
            continue
        assert cl.RankCluster(n=n).device == expected.device
        placement, env = run_job_unstarted(monkeypatch, n)
        assert placement == expected and (env.get("CUDA_VISIBLE_DEVICES") == "") == (expected.device == "cpu")
        assert _bench_device(monkeypatch, n) == expected.device  # without building a cluster first
    default = cl.RankCluster()
    facts = smoke.machine_facts()
    assert facts["cluster_runs_on"].startswith(default.placement.label)
    assert facts["one_rank_runs_on"] == place_ranks(1, count).device
    assert facts["backend"] == ("nccl" if default.device == "cuda" else "gloo")
    for row in gpucheck.plan(count):
        if row["runs"]:
            assert row["on"] == place_ranks(row["ranks"], count).label
    measure_ranks = measure_tables.job_ranks(["activation-memory", "state-memory"],
                                             gpucheck.memory_sizes(count) or None)
    if count:
        assert place_ranks(measure_ranks, count).device == "cuda"


@pytest.mark.parametrize("count, ranks, device", [(0, 4, "cpu"), (1, 4, "cpu"), (2, 2, "cuda"), (3, 2, "cuda"),
                                                  (5, 4, "cuda"), (7, 6, "cuda"), (8, 8, "cuda")])
def test_the_default_cluster_is_an_even_number_of_ranks_the_gpus_can_hold(gpus, count, ranks, device):
    """Every lesson's mesh has domain groups of 2: an odd default (3 GPUs, 3 ranks) would be refused by them."""
    gpus(count)
    cluster = cl.RankCluster()
    assert (cluster.n, cluster.device) == (ranks, device)


def test_more_ranks_than_gpus_is_refused_not_silently_cpu(gpus):  # bug 4
    gpus(4)
    with pytest.raises(DeviceError, match=r"8 ranks but 4 GPU\(s\).*SHARDLAB_RANKS=4"):
        cl.RankCluster(n=8)
    assert cl.RankCluster(n=8, device="cpu").device == "cpu"


def test_measure_with_sizes_1_starts_one_rank_which_one_gpu_can_run(monkeypatch):  # bug 1
    started = []

    def fake_run_job(launcher, n, module, args, **kwargs):
        started.append(n)
        raise launch.JobFailed("not started", 3)

    monkeypatch.setattr(measure_tables, "run_job", fake_run_job)
    monkeypatch.setattr(measure_tables, "detect_launch", lambda: SimpleNamespace(launcher="none"))
    assert measure_tables.main(["activation-memory", "--sizes", "1"]) == 3
    assert measure_tables.main(["activation-memory", "state-memory"]) == 3
    assert started == [1, 4]


# -- one GPU per Slurm task, CUDA_VISIBLE_DEVICES slices, the allocation's GPUs ---------------------------------


@pytest.mark.parametrize("local_rank, count, index", [(0, 1, 0), (1, 1, 0), (3, 1, 0), (3, 4, 3), (0, 8, 0)])
def test_one_visible_gpu_per_task_is_cuda_0_whatever_the_local_rank(local_rank, count, index):  # bug 8
    assert devices.gpu_index(local_rank, count) == index
    info = launch.detect_launch(launch.example_environment("slurm", rank=local_rank, world_size=4))
    assert launch.rank_gpu(info, count) == index


def test_a_local_rank_beyond_the_visible_gpus_names_the_rank_and_the_fix():
    info = launch.detect_launch(launch.example_environment("torchrun", rank=3, world_size=4))
    with pytest.raises(launch.LaunchError, match=r"rank 3: local rank 3, but this process sees 2 GPU\(s\).*"
                                                 r"--nproc-per-node=2.*--gpus-per-task=1"):
        launch.rank_gpu(info, 2)
    assert launch.rank_gpu(info, 0) is None  # no GPU: nothing to bind


def test_physicsnemo_gets_the_gpu_index_as_its_local_rank():
    from physicsnemo.distributed import DistributedManager

    from shardlab import workarounds

    calls = []
    original = DistributedManager.__dict__["setup"]
    DistributedManager.setup = staticmethod(lambda **kwargs: calls.append(kwargs))
    try:
        recorder = DistributedManager.__dict__["setup"]
        with workarounds.gpu_of_this_rank(0):
            DistributedManager.setup(rank=1, world_size=2, local_rank=1, method="slurm")
        with workarounds.gpu_of_this_rank(None):
            DistributedManager.setup(rank=1, world_size=2, local_rank=1, method="slurm")
        assert DistributedManager.__dict__["setup"] is recorder  # put back
    finally:
        DistributedManager.setup = original
    assert [c["local_rank"] for c in calls] == [0, 1]


@pytest.mark.parametrize("n, args, env, expected", [
    (4, ["--gpus-per-task=1"], {}, 4),
    (4, ["--partition=gpu", "--gres=gpu:a100:4"], {}, 4),
    (8, ["--gpus-per-node=4", "--nodes=2"], {}, 8),
    (4, ["--gpus=2"], {}, 2),
    (4, ["--gpus-per-task=1"], {"SLURM_GPUS_ON_NODE": "8"}, 4),  # the engines' own options win
    (4, [], {"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "2"}, 8),
    (4, [], {"SLURM_GPUS_PER_TASK": "1"}, 4),
    (4, [], {"SLURM_GPUS": "h100:8"}, 8),
    (4, [], {}, 0),
    # Inside a two-node allocation, a step that names no node count spans the allocation's nodes (one at most per
    # task): --gpus-per-node counts on each of them.
    (8, ["--gpus-per-node=4"], {"SLURM_JOB_NUM_NODES": "2"}, 8),
    (8, ["--gres=gpu:4"], {"SLURM_NNODES": "2"}, 8),
    (1, ["--gpus-per-node=4"], {"SLURM_JOB_NUM_NODES": "2"}, 4),
    (8, ["--gpus-per-node=4", "--nodes=1"], {"SLURM_JOB_NUM_NODES": "2"}, 4),  # the step's own count wins
])
def test_slurm_gpus_come_from_the_job_or_the_allocation(n, args, env, expected):
    assert devices.slurm_gpus(n, args, env) == expected


def test_slurm_engines_get_gpus_a_kernel_on_a_login_node_does_not_see(gpus):  # bug 9
    gpus(0)  # the kernel's node has none
    cluster = cl.RankCluster(n=4, engines="slurm", controller_ip="*", slurm_args=["--gpus-per-task=1"])
    assert cluster.device == "cuda"
    assert "CUDA_VISIBLE_DEVICES" not in cluster.engine_launcher.environment
    assert cl.RankCluster(n=4, engines="slurm", controller_ip="*").device == "cpu"  # a job that asks for none


def test_cuda_visible_devices_slices_are_kept_for_cuda_engines(monkeypatch, gpus):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpus(2)  # what torch counts under that slice
    cluster = cl.RankCluster()
    assert (cluster.n, cluster.device) == (2, "cuda")
    assert "CUDA_VISIBLE_DEVICES" not in engine_launchers.engine_environment(cluster.device)  # inherited: GPUs 4 and 5


# -- gpucheck ----------------------------------------------------------------------------------------------------


def test_gpucheck_plan_says_what_each_gpu_count_can_prove():  # bug 10, and the README's GPU section
    for count in GPU_COUNTS:
        print(f"\n{count} GPU(s)\n{gpucheck.Table(gpucheck.plan(count), ['check', 'on', 'budget_s'])}")
    assert not any(r["runs"] for r in gpucheck.plan(0))
    one = {r["name"]: r["on"] for r in gpucheck.plan(1)}
    assert one["smoke"] == one["notebook 07_capstone"] == one["skipped-collective"] == one["scaling"] == "needs 2+ GPUs"
    assert {one[k] for k in ("loading-memory", "timeline", "flight-record", "transolver-parity")} == {"needs 2+ GPUs"}
    assert {one[k] for k in ("activation-memory", "state-memory", "planner", "compile-speed", "tf32-error")} == {
        "1 CUDA rank"}
    four = {r["name"]: r for r in gpucheck.plan(4)}
    assert four["notebook 07_capstone"]["on"] == "4 CUDA ranks" and four["skipped-collective"]["on"] == "2 CUDA ranks"
    assert four["scaling"]["on"] == "4 CUDA ranks" and "N in [1, 2, 4]" in four["scaling"]["check"]
    assert "N in [1, 2, 4]" in four["activation-memory"]["check"]
    assert "N in [1, 2, 4, 8]" in {r["name"]: r for r in gpucheck.plan(8)}["activation-memory"]["check"]
    assert all(r["budget_s"] > 0 for r in gpucheck.plan(8))


def test_gpucheck_writes_its_json_after_every_row_and_gives_each_row_its_own_budget(monkeypatch, tmp_path, gpus):
    gpus(1)
    out = tmp_path / "gpu-check.json"
    seen = []

    def fake_row(row, count):
        seen.append((row["name"], row["budget_s"], len(json.loads(out.read_text())["rows"]) if out.exists() else 0))
        if row["name"] == "state-memory":
            raise RuntimeError("broke")
        return "fine", row["name"] != "compile-speed"

    monkeypatch.setattr(gpucheck, "run_row", fake_row)
    rows = gpucheck.checks(1, out)
    planned = [r for r in gpucheck.plan(1)]
    assert [(name, budget) for name, budget, _ in seen] == [(r["name"], r["budget_s"]) for r in planned if r["runs"]]
    # Two "needs 2+" rows, then one more per row, and the scaling row (needs 2+) written before compile-speed.
    assert [written for *_, written in seen] == [2, 3, 4, 6, 7]
    assert json.loads(out.read_text())["rows"] == rows
    status = {r["check"].split(":")[0]: r["status"] for r in rows}
    assert [r["status"] for r in rows].count("FAILED") == 2 and "needs 2+ GPUs" in status.values()


@pytest.mark.parametrize("ratio, diff, device, label, ok", [
    (0.6, 1e-6, "cuda:0", "1 CUDA rank", True),
    (1.3, 1e-6, "cuda:0", "1 CUDA rank", True),  # compiled slower on a small model: reported, not a failure
    (0.6, 0.5, "cuda:0", "1 CUDA rank", False),  # compiled computes something else
    (0.6, 1e-6, "cpu", "1 CPU rank", False),
])
def test_the_compile_speed_row_is_judged(monkeypatch, ratio, diff, device, label, ok):
    row = {"eager_step_s": 0.002, "compiled_step_s": 0.002 * ratio, "compiled/eager": ratio, "first_call_s": 12.0,
           "compiled_relative_diff": diff}
    monkeypatch.setattr(gpucheck, "_measure", lambda *args: ({"device": device, "rows": [row]}, label))
    result, passed = gpucheck.run_row({"name": "compile-speed", "budget_s": 10}, 1)
    assert passed == ok and f"compiled/eager {ratio:.2f}" in result and label in result
    assert "first compiled call 12.0 s" in result and f"compiled vs eager {diff:.1e}" in result
    del row["compiled_relative_diff"]  # a table that does not compare the values cannot pass the row
    result, passed = gpucheck.run_row({"name": "compile-speed", "budget_s": 10}, 1)
    assert not passed and "compile_speed_table must compare them" in result


@pytest.mark.parametrize("scale", [1.0, 1.1])
def test_the_compile_speed_table_compares_the_compiled_values_with_eager(monkeypatch, scale):
    """What the compile-speed row judges is computed by the table: torch.compile replaced by a 'compiler' that
    returns the model itself, or one that scales its output by 1.1."""
    from types import SimpleNamespace

    def fake_compile(model, **_):
        return model if scale == 1.0 else (lambda x: model(x) * scale)

    monkeypatch.setattr(torch, "compile", fake_compile)
    table = measure_tables.compile_speed_table(SimpleNamespace(width=4, layers=2, repeats=1))
    assert table["rows"][0]["compiled_relative_diff"] == pytest.approx(scale - 1.0, abs=1e-6)


def test_the_tf32_row_is_judged(monkeypatch):
    def judged(tf32, strict, hardware=True, device="cuda:0"):
        row = {"tf32_relative_error": tf32, "strict_fp32_relative_error": strict, "tf32_hardware": hardware}
        monkeypatch.setattr(gpucheck, "_measure", lambda *args: ({"device": device, "rows": [row]}, "1 CUDA rank"))
        return gpucheck.run_row({"name": "tf32-error", "budget_s": 10}, 1)[1]

    assert judged(1e-3, 1e-7)
    assert not judged(1e-3, 1e-3)  # strict_fp32 did not remove it
    assert judged(1e-7, 1e-7)  # TF32 hardware showing less error (cuDNN chose an fp32 kernel): still correct
    assert not judged(5e-2, 1e-7)  # beyond TF32's rounding: a wrong result
    assert judged(1e-7, 1e-7, hardware=False)  # before sm_80: no TF32 to show
    assert not judged(1e-3, 1e-7, device="cpu")


def test_gpucheck_does_not_depend_on_the_tests_folder_and_says_when_not_in_a_checkout(monkeypatch, tmp_path):
    assert "tests" not in gpucheck.Path(gpucheck.__file__).read_text().replace("test_", "")
    monkeypatch.setattr(gpucheck, "CHECKOUT", tmp_path)
    with pytest.raises(FileNotFoundError, match="not part of the installed package.*from a checkout"):
        gpucheck.checkout_notebooks()


def test_gpucheck_without_a_gpu_says_so_and_exits_0(monkeypatch, gpus, tmp_path, capsys):
    gpus(0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either: a machine without GPUs
    out = tmp_path / "gpu-check.json"
    assert gpucheck.main(["--json", str(out)]) == 0
    assert "No GPU is visible here" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == []


# -- TF32 flags, cores -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", [
    "torch.backends.cudnn.conv.fp32_precision = 'ieee'",  # the new API first: the legacy getter would raise
    "torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True",  # the legacy API first
])
def test_strict_fp32_uses_one_api_whichever_was_set_first(first, fresh_python):  # bug 7
    code = f"""
        import torch
        from shardlab.measure import strict_fp32
        {first}
        flags = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
        before = [f.fp32_precision for f in flags]
        with strict_fp32():
            assert [f.fp32_precision for f in flags] == ["ieee"] * 3
        assert [f.fp32_precision for f in flags] == before, before
        print("OK")
    """
    proc = fresh_python.run(code)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_cores_come_from_the_affinity_mask_not_the_machine(monkeypatch):  # bug 11
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 64)
    monkeypatch.delenv("SHARDLAB_MAX_RANKS_PER_CORE", raising=False)
    assert devices.usable_cores() == 1
    assert "--oversubscribe" in commands.mpi_arguments(2)
    with pytest.raises(ValueError, match=r"5 CPU ranks on 1 CPU core\(s\)"):
        cl.RankCluster(n=5, device="cpu")
    assert smoke.machine_facts()["cpu_cores"] == 1
