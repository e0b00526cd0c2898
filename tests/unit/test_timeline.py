"""sl.measure.timeline without ranks: a trace's moments counted once each, by kind, inside the steps only; the step's
own phases and its memory peak; the ranks' traces merged on one clock (notebook 14). Traces are built here, with the
answer known from how they were built."""

import json

import pytest

from shardlab.measure import timeline


def x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 7, "cat": cat, "args": args}


def step(ts, dur):
    return x("step", ts, dur, cat="user_annotation")


def test_each_moment_of_a_step_is_one_kind_and_overlaps_count_once():
    events = [step(0, 100), step(200, 100),
              x("aten::conv2d", 0, 60), x("aten::mm", 200, 100),  # the main thread's ops
              x("gloo:all_to_all", 10, 20, tid=2), x("gloo:all_to_all", 20, 20, tid=3),  # 10..40 once, not 40
              x("gloo:all_reduce", 50, 30, tid=2),  # over compute (50..60) and idle (60..80): the collective wins
              x("gloo:all_reduce", 90, 60, tid=2),  # past the first step's end and into the gap: 90..100 only
              x("c10d::allreduce_", 5, 1)]  # c10d's enqueue on the main thread is compute, not a collective
    summary = timeline.summarize(events, rank=3)
    seconds = {kind: timeline.length(spans) for kind, spans in summary["spans"].items()}
    assert seconds == {"halo exchange": 30, "all-reduce, ShardTensor (domain)": 0, "all-reduce, DDP (ddp)": 40,
                       "reduce-scatter / all-gather": 0, "scatter / broadcast": 0, "compute": 20 + 100, "idle": 10}
    assert sum(timeline.shares(summary).values()) == pytest.approx(1)
    assert timeline.communication_share(summary) == pytest.approx(70 / 200)
    assert timeline.step_seconds(summary) == [1e-4, 1e-4]


@pytest.mark.parametrize("name, kind", [("gloo:all_reduce", "all-reduce"), ("nccl:all_reduce", "all-reduce"),
                                        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce"),
                                        ("gloo:all_to_all", "halo exchange"), ("nccl:_reduce_scatter_base",
                                                                               "reduce-scatter / all-gather"),
                                        ("gloo:broadcast", "scatter / broadcast"), ("aten::all_reduce_like", None),
                                        ("c10d::allreduce_", None), ("HaloPadding", None)])
def test_collectives_are_known_by_their_backends_event_names(name, kind):
    assert timeline.kind_of(name) == kind


def test_the_peak_is_tied_to_the_steps_own_phase_not_a_librarys_annotation_inside_it():
    memory = [{"ph": "i", "name": "[memory]", "ts": t, "tid": 1, "args": {"Total Allocated": b, "Device Type": 0}}
              for t, b in ((5, 10), (30, 50), (60, 20), (500, 999))]  # the last one is after the steps
    events = [step(0, 100), x("forward", 0, 40, cat="user_annotation"),
              x("DistributedDataParallel.forward", 1, 38, cat="user_annotation"),
              x("backward", 40, 50, cat="user_annotation"), *memory]
    summary = timeline.summarize(events, rank=0)
    assert [name for name, _, _ in summary["phases"]] == ["backward", "forward"]
    assert timeline.memory_peak(summary) == {"bytes": 50, "at_us": 30, "phase": "forward"}


def test_a_trace_without_steps_says_how_to_make_one():
    with pytest.raises(ValueError, match="profile_steps"):
        timeline.summarize([x("aten::mm", 0, 5)], rank=0)


def test_traces_merge_on_one_clock_a_process_per_rank(tmp_path):
    for rank, base in ((0, 1_000_000), (1, 2_000_000)):  # ns: rank 1's times count from 1 ms later
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(
            {"baseTimeNanoseconds": base, "traceEvents": [step(10, 5)]}))
    merged = json.loads(timeline.merge(tmp_path, tmp_path / "all.json").read_text())["traceEvents"]
    steps = {e["pid"]: e["ts"] for e in merged if e.get("name") == "step"}
    assert steps == {"rank 0": 1_010, "rank 1": 2_010}
    assert {e["args"]["name"] for e in merged if e.get("name") == "process_name"} == {"rank 0", "rank 1"}
    with pytest.raises(FileNotFoundError, match="profile_steps"):
        timeline.merge(tmp_path / "none", tmp_path / "x.json")


def test_across_ranks_takes_the_slowest_rank_and_the_ideal_from_the_first_size():
    rank_0 = [{"N": 1, "rows per rank": 128, "step_s": 0.10, "communication": 0.2},
              {"N": 2, "rows per rank": 64, "step_s": 0.08, "communication": 0.4}]
    rank_1 = [dict(rank_0[0], step_s=0.12, communication=0.4), dict(rank_0[1], step_s=0.06, communication=0.6)]
    strong = timeline.across_ranks([rank_0, rank_1], strong=True)
    assert [(r["N"], r["step_s"], r["ideal_s"]) for r in strong] == [(1, 0.12, 0.12), (2, 0.08, 0.06)]
    assert [r["communication"] for r in strong] == pytest.approx([0.3, 0.5])
    assert [r["ideal_s"] for r in timeline.across_ranks([rank_0, rank_1], strong=False)] == [0.12, 0.12]


def test_the_steps_gpu_copies_are_not_steps_and_the_gpus_kernels_are_compute():
    """Issue 44 C. With CUDA activities on, each record_function range is copied onto every GPU stream its kernels
    ran on, same name, category "gpu_user_annotation", pid the device, tid the stream
    (torch/profiler/_cupti/monitor_trace.py, ``_gpu_user_annotation_events``, lines 916-1000 of torch 2.14.1: "the
    chrome path builds them the same way", line 2078). Only the host's ranges are steps; a kernel is compute."""
    host = [step(0, 100), step(200, 100), x("forward", 0, 50, cat="user_annotation")]
    copies = [dict(x(name, ts, dur, tid=stream, cat="gpu_user_annotation"), pid=0)
              for stream in (7, 20) for name, ts, dur in (("step", 5, 120), ("step", 210, 95), ("forward", 5, 60))]
    kernels = [dict(x("void cutlass_gemm", 40, 30, tid=7, cat="kernel"), pid=0)]
    summary = timeline.summarize(host + copies + kernels + [x("aten::conv2d", 0, 30)], rank=0)
    assert summary["steps"] == [(0, 100), (200, 300)]
    assert sum(timeline.shares(summary).values()) == pytest.approx(1)
    assert timeline.step_seconds(summary) == [1e-4, 1e-4]
    assert timeline.length(summary["spans"]["compute"]) == 30 + 30  # the host's op, then the kernel (40..70)
    assert [name for name, _, _ in summary["phases"]] == ["forward"]


def test_on_nccl_the_transfer_is_the_kernel_and_each_all_reduce_is_told_by_its_caller():
    """ProcessGroupNCCL carries no collective on a thread of its own (ProcessGroupNCCL.hpp of torch 2.14.1: a
    heartbeat monitor thread, line 685, a watchdog, line 749, a completion-hook thread, line 1378): the host's
    ``nccl:all_reduce`` range is the launch, the transfer is an ``ncclDevKernel_*`` kernel on a stream, and the kernel
    names the host op that launched it ("External id"). ShardTensor's all-reduces go through the functional
    collectives (physicsnemo/domain_parallel/shard_utils/grad_ops.py, lines 29-32: GradReducer, for every
    convolution's weight and bias, conv_patches.py lines 522-524); DDP's do not."""
    events = [step(0, 1000),
              x("_c10d_functional::all_reduce", 100, 20), x("c10d::allreduce_", 105, 10, **{"External id": 1}),
              x("nccl:all_reduce", 106, 8, cat="user_annotation"),
              x("c10d::allreduce_", 300, 10, **{"External id": 2}), x("nccl:all_reduce", 301, 8, cat="user_annotation"),
              dict(x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 400, 100, tid=9, cat="kernel", **{"External id": 1}),
                   pid=0),
              dict(x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 600, 50, tid=9, cat="kernel", **{"External id": 2}),
                   pid=0)]
    summary = timeline.summarize(events, rank=0)
    assert summary["spans"]["all-reduce, ShardTensor (domain)"] == [(400, 500)]
    assert summary["spans"]["all-reduce, DDP (ddp)"] == [(600, 650)]
    assert [(kind, start) for kind, _, start, _ in summary["collectives"]] == [
        ("all-reduce, DDP (ddp)", 600), ("all-reduce, ShardTensor (domain)", 400)]


def test_on_gloo_each_all_reduce_is_matched_to_its_handover_by_shape():
    """gloo carries collectives on each group's worker threads, from a queue per group (ProcessGroupGloo.hpp of torch
    2.14.1: ``threads_``, line 478, ``workQueue_``, line 514): a DDP bucket's queue can start it before a gradient
    ShardTensor handed over earlier, so the order alone would swap them; the shapes (``record_shapes``) do not."""
    events = [step(0, 1000),
              x("_c10d_functional::all_reduce", 10, 2),
              x("c10d::allreduce_", 10.5, 1, **{"Input Dims": [[[16, 1, 3, 3]]]}),
              x("c10d::allreduce_", 12.5, 0.2, **{"Input Dims": [[[500]]]}),  # DDP's bucket
              x("_c10d_functional::all_reduce", 14, 3), x("c10d::allreduce_", 15, 1, **{"Input Dims": [[[16]]]}),
              x("gloo:all_reduce", 13, 5, tid=2, cat="user_annotation", **{"Input Dims": [[500]]}),
              x("gloo:all_reduce", 20, 10, tid=3, cat="user_annotation", **{"Input Dims": [[16, 1, 3, 3]]}),
              x("gloo:all_reduce", 40, 10, tid=3, cat="user_annotation", **{"Input Dims": [[16]]})]
    summary = timeline.summarize(events, rank=0)
    assert summary["spans"]["all-reduce, DDP (ddp)"] == [(13, 18)]
    assert summary["spans"]["all-reduce, ShardTensor (domain)"] == [(20, 30), (40, 50)]


def test_the_figures_kinds_are_the_timelines():
    from shardlab.plot import ranks

    assert ranks.KINDS == (*timeline.COMMUNICATION, timeline.COMPUTE, timeline.IDLE)


def test_the_merged_trace_goes_where_jupyterlabs_file_browser_shows_it_and_git_does_not():
    """Notebook 14 writes it to ``traces/`` beside the notebooks (JupyterLab is rooted at notebooks/, ``make lab``)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ignored = subprocess.run(["git", "check-ignore", "-q", "notebooks/traces/steps-4-ranks.json"], cwd=root)
    assert ignored.returncode == 0
