"""gpu-check's rows for lessons 12-14 and the notebooks, with the GPUs simulated: each row's budget (the notebooks'
from their own measured times), a row past its own bound stopped with what it started and reported, how each new row
is judged on what CUDA ranks report, and, on this machine's CPU ranks, that the new rows' programs run within their
bounds and fail for not being on CUDA (a row that ran on CPU ranks never passes)."""

import json
import shutil
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from marked import marked_processes
from shardlab import parity
from shardlab.measure import flight, timeline
from shardlab.ranks import launch, subprocesses
from shardlab.tools import gpu_lessons, gpucheck, time_model

ROOT = Path(__file__).resolve().parents[2]
NEW_ROWS = ("loading-memory", "timeline", "flight-record", "transolver-parity")


# -- budgets ------------------------------------------------------------------------------------------------------


def test_each_notebook_is_a_row_whose_budget_comes_from_its_own_measured_time():
    measured = time_model.measured_run_s((ROOT / "docs" / "timings.md").read_text())
    rows = {r["name"]: r for r in gpucheck.plan(4) if r["name"].startswith("notebook ")}
    assert sorted(rows) == sorted(f"notebook {p.stem}" for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for name, row in rows.items():
        seconds = measured[name.removeprefix("notebook ")]
        starts = (row["budget_s"] - gpucheck.NOTEBOOK_MARGIN * seconds) / gpucheck.CLUSTER_START_S
        assert round(starts, 2) == int(round(starts, 2)) >= 1, (name, row["budget_s"], seconds)
        assert f"{seconds:.0f} s on CPU ranks" in row["check"]
    # 07 starts two clusters, 14 restarts its own: a start each on top of their measured time
    assert rows["notebook 07_capstone"]["budget_s"] == round(2 * gpucheck.CLUSTER_START_S + 2 * measured["07_capstone"])


def test_a_notebook_without_a_measured_time_gets_the_longest_ones_and_says_so(monkeypatch, tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "docs").mkdir()
    cell = {"cell_type": "code", "source": ["cluster = sl.start_cluster()  # start_cluster( in a comment: no start"]}
    for name in ("01_a", "02_b"):
        (tmp_path / "notebooks" / f"{name}.ipynb").write_text(json.dumps({"cells": [cell]}))
    (tmp_path / "docs" / "timings.md").write_text("| `01_a` | 100.0 |\n| `09_c` | 300.0 |\n")
    monkeypatch.setattr(gpucheck, "CHECKOUT", tmp_path)
    rows = gpucheck.notebook_rows()
    assert rows["01_a"][0] == gpucheck.CLUSTER_START_S + gpucheck.NOTEBOOK_MARGIN * 100
    assert rows["02_b"][0] == gpucheck.CLUSTER_START_S + gpucheck.NOTEBOOK_MARGIN * 300
    assert "no time of it in docs/timings.md" in rows["02_b"][1]


def test_every_new_row_has_a_bound_and_the_whole_run_keeps_the_sum_by_default():
    rows = {r["name"]: r for r in gpucheck.plan(4)}
    assert all(rows[name]["budget_s"] > 0 and rows[name]["runs"] for name in NEW_ROWS)
    assert rows["transolver-parity"]["ranks"] == 4 and {r["name"]: r for r in gpucheck.plan(3)}[
        "transolver-parity"]["ranks"] == 3  # at the node's GPU count, odd too: points split unevenly


def test_a_row_past_its_own_bound_is_stopped_with_what_it_started_and_the_next_row_still_runs(monkeypatch):
    """The row's own time-out (passed to what it starts) is ignored here on purpose: gpu-check's own alarm must stop
    it at budget + OVERRUN_S, however long the run's deadline still is."""
    marker = uuid.uuid4().hex
    monkeypatch.setattr(gpucheck, "OVERRUN_S", 1)
    monkeypatch.setattr(gpucheck, "plan", lambda gpus: [
        {"name": name, "check": name, "on": "2 CUDA ranks", "ranks": 2, "needs": 2, "budget_s": 1, "runs": True}
        for name in ("timeline", "flight-record")])

    def row(planned, gpus):
        if planned["name"] == "timeline":  # a rank program that hangs past its budget
            env = launch.clean_environment(SHARDLAB_TEST_MARKER=marker)
            subprocesses.run_process_group([shutil.which("sleep"), "60"], env, 60, "a row that outlives its budget")
        return "done", True

    monkeypatch.setattr(gpucheck, "run_row", row)
    t0 = time.monotonic()
    rows = gpucheck.checks(2, deadline_s=600)
    assert time.monotonic() - t0 < 20
    assert rows[0]["status"] == "FAILED" and rows[0]["result"].startswith("stopped 1 s past its own 1 s budget")
    assert rows[1]["status"] == "passed"
    assert not marked_processes(marker)


# -- how each new row is judged, on what CUDA ranks report ----------------------------------------------------------


def loading_report(device="cuda:0", held=1.0, peak=True):
    rows = [{"N": n, "loading": way, "held/(fields/N)": held if way == "slab" else float(n),
             **({"cuda_peak_above_start_max_rank": 4096} if peak else {})}
            for n in (2, 4) for way in ("slab", "scatter_tensor")]
    return {"device": device, "rows": rows}


def test_the_loading_memory_row_is_judged():
    assert gpu_lessons.judge_loading_memory(loading_report(), "4 CUDA ranks")[1]
    assert not gpu_lessons.judge_loading_memory(loading_report(held=2.0), "4 CUDA ranks")[1]  # slab held too much
    assert not gpu_lessons.judge_loading_memory(loading_report(peak=False), "4 CUDA ranks")[1]  # no GPU peak read
    said, ok = gpu_lessons.judge_loading_memory(loading_report(device="cpu", peak=False), "4 CPU ranks")
    assert not ok and said.startswith("on 4 CPU ranks")


def timeline_report(device="cuda:0", world=4, **change):
    row = {"rank": 0, "steps_s": [0.01, 0.01], "shares_sum": 1.0, "communication": 0.3, "halo exchange": 12,
           "ShardTensor all-reduces": 40, "DDP all-reduces": 2, "NCCL kernels": 54} | change
    return {"device": device, "world_size": world, "rows": [row | {"rank": r} for r in range(world)]}


def test_the_timeline_row_is_judged():
    assert gpu_lessons.judge_timeline(timeline_report(), "4 CUDA ranks")[1]
    assert gpu_lessons.judge_timeline(timeline_report(world=2, **{"DDP all-reduces": 0}), "2 CUDA ranks")[1]
    for wrong in ({"shares_sum": 1.5}, {"NCCL kernels": 0}, {"ShardTensor all-reduces": 0}, {"halo exchange": 0},
                  {"DDP all-reduces": 0}):
        assert not gpu_lessons.judge_timeline(timeline_report(**wrong), "4 CUDA ranks")[1], wrong
    assert not gpu_lessons.judge_timeline(timeline_report(device="cpu", **{"NCCL kernels": 0}), "4 CPU ranks")[1]


def _records(world, skipped):
    group = tuple(range(world))
    return {r: [flight.Entered(group, 1, "all_reduce", started_ns=r)] +
            ([flight.Entered(group, 2, "all_reduce", done=False, started_ns=10 + r)] if r != skipped else [])
            for r in group}


def test_the_flight_record_row_is_judged():
    assert gpu_lessons.judge_flight_record(_records(4, 3), ["nccl"], "cuda", "4 CUDA ranks")[1]
    said, ok = gpu_lessons.judge_flight_record(_records(4, 1), ["nccl"], "cuda", "4 CUDA ranks")
    assert not ok and "for rank(s) [1]" in said  # not the rank held back
    assert not gpu_lessons.judge_flight_record(_records(4, 3) | {3: []}, ["nccl"], "cuda", "4 CUDA ranks")[1]
    assert not gpu_lessons.judge_flight_record(_records(4, 3), ["gloo"], "cpu", "4 CPU ranks")[1]


def parity_row(device="cuda", error=None, **change):
    runs = [{"split": split, "size": size, "output": 1e-14, "gradient": 1e-13} | change
            for split, size in (("even", 512), ("uneven", 513))]
    if error:
        runs[1] = {"split": "uneven", "size": 513, "error": error}
    return {"ranks": 4, "domain": 4, "device": device, "problems": [], "parity": runs}


def test_the_transolver_parity_row_is_judged():
    assert gpu_lessons.judge_transolver_parity(parity_row())[1]
    assert not gpu_lessons.judge_transolver_parity(parity_row(gradient=1e-6))[1]
    said, ok = gpu_lessons.judge_transolver_parity(parity_row(error="shard_tensor.py:907: no handler"))
    assert not ok and "no handler" in said
    assert not gpu_lessons.judge_transolver_parity(parity_row(device="cpu"))[1]


def test_the_rows_pass_what_they_run_to_the_jobs(monkeypatch):
    """The job each row starts: the table, its sizes, its ranks and its budget as the job's time-out."""
    seen = []

    def fake_job(launcher, n, module, args, timeout_s):
        seen.append((n, module, list(args), timeout_s))
        result = {args[0]: loading_report() if args[0] == "loading-memory" else timeline_report()}
        return SimpleNamespace(result=result, placement=SimpleNamespace(label=f"{n} CUDA ranks"))

    monkeypatch.setattr(gpu_lessons, "run_job", fake_job)
    monkeypatch.setattr(parity, "run", lambda refs, ranks, timeout_s: seen.append((ranks, refs, timeout_s))
                        or [parity_row()])
    rows = {r["name"]: r for r in gpucheck.plan(8)}
    assert all(gpucheck.run_row(rows[name], 8)[1] for name in ("loading-memory", "timeline", "transolver-parity"))
    assert seen[0] == (8, "shardlab.measure", ["loading-memory", "--sizes", "2", "4", "8"], 240)
    assert seen[1] == (8, "shardlab.measure", ["timeline"], 240)
    assert seen[2] == (8, ["shardlab.model_cases:transolver"], 300)


# -- the new rows' programs, for real, on this machine's CPU ranks ---------------------------------------------------


@pytest.mark.multirank
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs: gpu-check itself runs the rows")
def test_the_new_rows_run_on_cpu_ranks_within_their_bounds_and_fail_for_not_being_on_cuda(monkeypatch, no_leftovers):
    """The plan of a 4-GPU node, run where the jobs find no GPU (their placement is this machine's: CPU ranks). The
    rank programs are the ones a node runs; their results are what CPU ranks show, and the rows fail saying so."""
    planned = [r for r in gpucheck.plan(4) if r["name"] in NEW_ROWS]
    monkeypatch.setattr(gpucheck, "plan", lambda gpus: planned)
    rows = {r["name"]: r for r in gpucheck.checks(4)}
    for row in planned:
        got = rows[row["name"]]
        assert got["status"] == "FAILED" and got["seconds"] < row["budget_s"], got
        assert "stopped" not in got["result"] and "Error" not in got["result"].split(":")[0], got
    loading = rows["loading-memory"]["result"]
    assert loading.startswith("on 4 CPU ranks: ") and "N=4 slab: held 1.00 x fields/N, CUDA peak not" in loading
    assert rows["timeline"]["result"].startswith("on 4 CPU ranks: rank 0:") and "0 NCCL kernels" in rows[
        "timeline"]["result"]
    assert "wait in all_reduce" in rows["flight-record"]["result"] and "for rank(s) [3]" in rows[
        "flight-record"]["result"] and "backend ['gloo']" in rows["flight-record"]["result"]
    assert rows["transolver-parity"]["result"].startswith("4 CPU ranks, domain 4: even split")
    assert timeline.kind_of("ncclDevKernel_SendRecv") == "halo exchange"  # what the node's trace is read with
