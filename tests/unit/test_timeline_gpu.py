"""sl.measure.timeline on a GPU rank's trace, built as torch 2.14.1's profiler writes one on NCCL ranks (no GPU here):
where it differs from a CPU rank's, and that notebook 14's reading of it stays right.

What a GPU trace holds, from the installed torch 2.14.1:

- each event's category is the name of its Kineto activity type (``torch/include/kineto/ActivityType.h``, lines
  81-86): ``cpu_op`` and ``user_annotation`` on the host's threads, ``kernel``, ``gpu_memcpy``, ``gpu_memset`` and
  ``gpu_user_annotation`` on the GPU, one Chrome "process" per device and one "thread" per stream
  (``torch/profiler/_cupti/monitor_trace.py``, lines 445-451: ``"cat": "kernel"``, ``"pid"`` the device, ``"tid"``
  the stream);
- a kernel names the host op that launched it with its "External id" (Kineto's ``linkedActivity``,
  ``kineto/ITraceActivity.h``, line 47);
- NCCL carries a collective as a kernel, ``ncclDevKernel_*``, on a stream; ProcessGroupNCCL has no thread that
  carries one (``ProcessGroupNCCL.hpp``: a heartbeat monitor, line 685, a watchdog, line 749, a completion-hook thread,
  line 1378), so its ``nccl:all_reduce`` range on the host is the launch, over in microseconds;
- the backward runs on the autograd engine's thread for the device, not the thread that called ``backward()``
  (``torch/csrc/autograd/engine.h``, ``thread_init``, line 213; ``start_device_threads``, lines 235-237): the
  all-reduces that ShardTensor's ``GradReducer`` and DDP's hooks start in the backward are launched there.

The trace below is built with the answer known from how it was built (µs)."""

import pytest

from shardlab.measure import timeline

MAIN, AUTOGRAD, STREAM, NCCL_STREAM = 101, 202, "stream 7", "stream 20"


def host(name, ts, dur, tid=MAIN, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "cat": cat, "args": args}


def gpu(name, ts, dur, stream=STREAM, cat="kernel", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream, "cat": cat, "args": args}


def one_step_on_nccl():
    """One step of a domain-parallel model on an NCCL rank: the scatter's broadcast, a halo exchange, a conv kernel in
    the forward; in the backward (on the autograd thread) ShardTensor's all-reduce of a weight's gradient, then DDP's
    bucket; an optimizer kernel. The step's range on the host ends after ``torch.cuda.synchronize()``."""
    return [
        host("step", 0, 1000, cat="user_annotation"),
        host("load + scatter", 0, 100, cat="user_annotation"),
        host("c10d::broadcast_", 10, 5, **{"External id": 1}),
        host("nccl:broadcast", 11, 3, cat="user_annotation"),  # the launch, on the host: 3 µs
        gpu("ncclDevKernel_Broadcast_RING_LL", 20, 60, NCCL_STREAM, **{"External id": 1}),
        host("forward", 100, 300, cat="user_annotation"),
        host("c10d::send", 110, 4, **{"External id": 2}),
        host("nccl:send", 111, 2, cat="user_annotation"),
        gpu("ncclDevKernel_SendRecv", 120, 40, NCCL_STREAM, **{"External id": 2}),
        host("aten::conv2d", 170, 10, **{"External id": 3}),
        host("cudaLaunchKernel", 172, 5, cat="cuda_runtime", **{"External id": 3}),
        gpu("void cudnn::conv_fwd_kernel", 180, 150, **{"External id": 3}),
        host("backward", 400, 400, cat="user_annotation"),
        # the autograd engine's thread for this GPU
        host("_c10d_functional::all_reduce", 410, 20, tid=AUTOGRAD),
        host("c10d::allreduce_", 412, 10, tid=AUTOGRAD, **{"External id": 4}),
        host("nccl:all_reduce", 413, 8, tid=AUTOGRAD, cat="user_annotation"),
        gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 450, 100, NCCL_STREAM, **{"External id": 4}),
        host("c10d::allreduce_", 560, 10, tid=AUTOGRAD, **{"External id": 5}),  # DDP's bucket: no functional op
        host("nccl:all_reduce", 561, 8, tid=AUTOGRAD, cat="user_annotation"),
        gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 600, 150, NCCL_STREAM, **{"External id": 5}),
        host("optimizer", 800, 100, cat="user_annotation"),
        gpu("void multi_tensor_apply_kernel", 810, 50, **{"External id": 6}),
        host("cudaDeviceSynchronize", 900, 95, cat="cuda_runtime"),
        # Kineto's copies of the host's ranges on the streams they cover
        gpu("step", 20, 840, STREAM, cat="gpu_user_annotation"),
        gpu("step", 20, 730, NCCL_STREAM, cat="gpu_user_annotation"),
        gpu("backward", 450, 300, NCCL_STREAM, cat="gpu_user_annotation"),
    ]


def test_on_nccl_communication_is_the_kernels_on_the_stream_not_the_hosts_launches():
    summary = timeline.summarize(one_step_on_nccl(), rank=0)
    assert summary["steps"] == [(0, 1000)]
    spans = summary["spans"]
    assert spans["scatter / broadcast"] == [(20, 80)]  # the kernel's 60 µs, not the launch's 3
    assert spans["halo exchange"] == [(120, 160)]
    assert spans["all-reduce, ShardTensor (domain)"] == [(450, 550)]
    assert spans["all-reduce, DDP (ddp)"] == [(600, 750)]
    assert sum(timeline.shares(summary).values()) == pytest.approx(1)
    assert timeline.communication_share(summary) == pytest.approx((60 + 40 + 100 + 150) / 1000)


def test_a_gpu_ranks_compute_is_its_kernels_and_its_steps_end_when_the_gpu_is_done():
    summary = timeline.summarize(one_step_on_nccl(), rank=0)
    # The host's ops (their launches) and the GPU's kernels; where a collective is in flight, the collective
    assert summary["spans"]["compute"] == [(10, 15), (110, 114), (170, 330), (810, 860), (900, 995)]
    assert timeline.step_seconds(summary) == [1e-3]


def test_the_backwards_all_reduces_are_told_apart_on_the_autograd_thread():
    """The launches of both all-reduces are on the autograd engine's device thread, not the thread that ran the step:
    a reader that looks for the functional collective on the step's thread alone calls both DDP's."""
    summary = timeline.summarize(one_step_on_nccl(), rank=0)
    kinds = [(kind, phase) for kind, phase, _, _ in summary["collectives"]]
    assert ("all-reduce, ShardTensor (domain)", "backward") in kinds and ("all-reduce, DDP (ddp)", "backward") in kinds


def test_the_nccl_launch_ranges_are_neither_phases_nor_steps():
    summary = timeline.summarize(one_step_on_nccl(), rank=0)
    assert [name for name, _, _ in summary["phases"]] == ["backward", "forward", "load + scatter", "optimizer"]


@pytest.mark.parametrize("kernel, kind", [
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "all-reduce"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce-scatter / all-gather"),  # not a scatter
    ("ncclDevKernel_AllGather_RING_LL", "reduce-scatter / all-gather"),
    ("ncclDevKernel_Broadcast_RING_LL", "scatter / broadcast"),
    ("ncclDevKernel_SendRecv", "halo exchange"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float", "all-reduce"),  # NCCL before 2.19 named them so
    ("void cudnn::conv_fwd_kernel", None),
])
def test_ncclDevKernels_are_known_by_their_names(kernel, kind):
    assert timeline.kind_of(kernel) == kind
