"""The memory planner, on the meta device, without ranks: halo rows, uneven shards, FSDP2 shards, the verdict, the
levers and the command line; the step peak against the CPU allocator's in one process. Its predictions against
measured ranks (and a GPU's ``max_memory_allocated``): tests/multirank/test_plan_measured.py."""

import json
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from shardlab import plan, plot
from shardlab.models import conv_stack
from shardlab.plan import cli as plan_cli
from shardlab.train import Levers


def one_conv(kernel_size=3, padding=1):
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Conv2d(1, 1, kernel_size, padding=padding))


def test_a_sharded_convolution_saves_its_rows_plus_halos_or_edge_padding():
    # 16 rows over 4 ranks: each saves its 4 rows + 1 halo row or zero row on each side, 8 columns of fp32.
    result = plan.plan(one_conv(), (1, 1, 16, 8), domain=4, wrapper="none")
    assert [r.rows for r in result.rows] == [4, 4, 4, 4]
    assert all(r.activations == (4 + 2) * 8 * 4 for r in result.rows)
    assert all(r.halos == 2 * 8 * 4 for r in result.rows)
    # One process: torch pads inside the kernel, the input itself is what is saved.
    single = plan.plan(one_conv(), (1, 1, 16, 8), wrapper="none").rows[0]
    assert single.activations == 16 * 8 * 4 and single.halos == 0 and single.transient == 0
    # A 5x5 kernel needs 2 rows from each neighbour.
    assert plan.plan(one_conv(5, 2), (1, 1, 16, 8), domain=4, wrapper="none").rows[1].activations == 8 * 8 * 4


def test_uneven_shards_follow_torch_chunk_as_scatter_tensor_does():
    result = plan.plan(conv_stack(width=8, layers=3), (1, 1, 66, 64), domain=4, wrapper="none")
    assert [r.rows for r in result.rows] == [17, 17, 17, 15]
    assert result.rows[0].activations > result.rows[3].activations
    assert "uneven shards" in result.notes[0]
    with pytest.raises(ValueError, match="halo row"):
        plan.plan(conv_stack(), (1, 1, 8, 8), domain=9)  # the ninth rank would hold no row


def test_state_bytes_per_wrapper_and_fsdp2_shards_of_a_one_row_parameter():
    model = conv_stack()  # 10500 bytes of parameters; the output conv has one row (1 output channel)
    ddp = plan.plan(model, (1, 1, 64, 64), ddp=2, wrapper="ddp").rows
    assert ddp[0].params == ddp[0].grads == ddp[0].buffers == 10500  # buckets: a copy of every gradient
    assert ddp[0].optimizer == 2 * 10500 + 6 * 4  # Adam: two moments and a 4-byte step per parameter
    fsdp = plan.plan(model, (1, 1, 64, 64), ddp=2, wrapper="fsdp2").rows
    assert fsdp[0].params + fsdp[1].params == 10500 and fsdp[0].params > fsdp[1].params
    # Two units' all-gathers at once: the middle conv twice (its flat all-gather output and the unsharded copies made
    # of it) and the first conv, whose flat output FSDP2 keeps until that copy-out (measured: test_..._5_percent).
    assert fsdp[0].buffers == (16 * 9 + 16 + 2 * (16 * 16 * 9 + 16)) * 4
    # One ddp rank: no all-gather, the largest unit copied once into its unsharded buffers.
    assert plan.plan(model, (1, 1, 64, 64), wrapper="fsdp2").rows[0].buffers == (16 * 16 * 9 + 16) * 4
    assert plan.plan(model, (1, 1, 64, 64), wrapper="none").rows[0].buffers == 0


def test_the_total_covers_the_replayed_peak_and_the_accounting():
    for row in plan.plan(conv_stack(), (1, 1, 256, 256), ddp=2, domain=2, wrapper="fsdp2").rows:
        assert row.accounted == sum(getattr(row, c) for c in plan.ACCOUNTED)
        assert row.total == row.accounted + row.temporaries >= row.peak > row.activations


def test_large_fields_are_planned_on_the_meta_device_in_seconds():
    t0 = time.perf_counter()
    planner = plan.Planner(plan.conv_model(3, width=32, depth=4), plan.parse_field("512x512x512"))
    result = planner.plan(ddp=2, domain=8, wrapper="fsdp2")
    big = plan.Planner(plan.conv_model(2, width=64, depth=6), plan.parse_field("8192x8192")).plan(domain=1)
    assert big.rows[0].activations > 100 * plan.GiB  # far more than this machine has: nothing was allocated
    assert result.rows[0].transient == 512**3 * 4 and len(result.rows) == 16
    print(f"512^3 and 8192^2 planned in {time.perf_counter() - t0:.2f} s")


def test_planning_time_does_not_grow_with_the_rank_count_or_the_field(monkeypatch):
    """Cached by shard shapes, bisected over domain sizes: counted in traces and optimizer replays, not seconds."""
    from shardlab.plan import planner as planner_module

    calls = {"trace_rank": 0, "optimizer_state": 0}

    def counting(name, real):
        def counted(*args):
            calls[name] += 1
            return real(*args)
        return counted

    for name in calls:
        monkeypatch.setattr(planner_module, name, counting(name, getattr(planner_module, name)))
    t0 = time.perf_counter()
    wide = plan.Planner(plan.conv_model(2), plan.parse_field("4096x4096"))
    for wrapper in ("ddp", "fsdp2"):
        assert plan.verdict(wide, wide.plan(ddp=5000, wrapper=wrapper), plan.parse_size("80GiB")).fits
    assert calls["trace_rank"] == 1 and calls["optimizer_state"] <= 5  # 5000 FSDP2 ranks share 4 shard shapes
    huge = plan.Planner(plan.conv_model(2), plan.parse_field("1000000x1000000"))
    answer = plan.verdict(huge, huge.plan(), plan.parse_size("80TiB"))
    assert answer.smallest_domain == 5 and calls["trace_rank"] <= 1 + 3 * 21  # 3 positions x log2(10^6) sizes
    print(f"ddp 5000 and a 10^6 x 10^6 field planned and judged in {time.perf_counter() - t0:.2f} s "
          f"({calls['trace_rank']} traces), this machine")
    # The bisection agrees with a scan of every domain size.
    small = plan.Planner(plan.conv_model(2, width=32), plan.parse_field("96x96"))
    capacity = small.largest(2, 5).total + plan.headroom(small.largest(2, 5).total, 10)
    scanned = next(n for n in small.valid_domains() if small.fits(capacity, 2, n))
    assert small.smallest_domain(capacity, ddp=2) == scanned and 1 < scanned <= 5


def test_verdicts_fit_smallest_domain_and_no_domain():
    planner = plan.Planner(plan.conv_model(2, width=64, depth=6), plan.parse_field("8192x8192"))
    capacity = plan.parse_size("80GiB")
    assert plan.verdict(planner, planner.plan(domain=1), capacity).text == (
        "does not fit: smallest domain size that fits is 3 (scatter loading)")  # domain 1: no field is scattered
    assert not planner.fits(capacity, domain=2) and planner.fits(capacity, domain=3)
    fits = plan.verdict(planner, planner.plan(domain=4), capacity)
    assert fits.fits and fits.text.startswith("fits with ") and fits.text.endswith(" GiB left (scatter loading)")
    assert fits.left == capacity - fits.need - fits.headroom
    tiny = plan.verdict(planner, planner.plan(domain=1), plan.parse_size("1GiB"))
    assert tiny.text.startswith("does not fit at any domain size") and "scatter_tensor" in tiny.text
    assert "256 MiB is the full input field and 256 MiB the full target field" in tiny.text  # 8192² fp32 each


def test_sizes_fields_and_what_is_left_out():
    assert plan.parse_size("80GiB") == 80 * 2**30 and plan.parse_size("40GB") == 40 * 10**9
    assert plan.parse_size("H100") == plan.GPUS["H100 (80 GB)"]
    assert plan.parse_field("4096x4096") == (1, 1, 4096, 4096) and plan.parse_field("64x64x64")[2:] == (64, 64, 64)
    for bad, call in (("80 parsecs", plan.parse_size), ("4096 by 4096", plan.parse_field)):
        with pytest.raises(ValueError, match="like|separated"):
            call(bad)
    for item in plan.LEFT_OUT:  # each says what it adds and where that figure comes from
        assert item["typical"] and item["source"].startswith("https://")


def test_memory_bars_draw_the_capacity_line():
    result = plan.plan(conv_stack(), (1, 1, 64, 64), ddp=2, domain=2, wrapper="fsdp2")
    fig = plot.memory_bars(result.bars(), unit="MiB", capacity=2 * 2**20, capacity_label="GPU")
    ax = fig.axes[0]
    line = next(line for line in ax.get_lines() if line.get_label().startswith("GPU"))
    assert list(line.get_ydata()) == [2, 2] and ax.get_ylim()[1] > 2
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "GPU: 2 MiB"
    assert set(result.bars()) == {"ranks 0-1", "ranks 2-3"}  # equal ranks share one bar


def test_command_line_prints_the_table_and_writes_json_for_8192_squared(tmp_path, capsys):
    # python -m shardlab.plan's entry point, called in this process (test_piping_into_head_... starts the real one).
    out = tmp_path / "plan.json"
    t0 = time.perf_counter()
    assert plan_cli.main(["--field", "8192x8192", "--domain", "8", "--ddp", "2", "--wrapper", "fsdp2", "--gpu", "80GiB",
                      "--json", str(out)]) == 0
    seconds = time.perf_counter() - t0
    printed = capsys.readouterr().out
    assert "verdict on 80.0 GiB GPUs (--gpu 80GiB): fits with" in printed and "left out" in printed
    report = json.loads(out.read_text())
    assert [r["rank"] for r in report["rows"]] == list(range(16))
    for row in report["rows"]:
        assert {"rank", "params", "grads", "optimizer", "activations", "transient", "total"} <= set(row)
        assert row["total"] >= row["params"] + row["grads"] + row["optimizer"] + row["activations"] + row["transient"]
    assert report["verdict"]["fits"] and report["verdict"]["text"].startswith("fits with")
    print(f"shardlab.plan for 8192x8192 answered in {seconds:.1f} s (wall clock, this machine)")


def test_command_line_says_what_does_not_fit_and_refuses_a_domain_too_large(capsys):
    assert plan_cli.main(["--field", "8192x8192", "--channels", "64", "--depth", "6", "--gpu", "80GiB"]) == 0
    assert "does not fit: smallest domain size that fits is 3" in capsys.readouterr().out
    assert plan_cli.main(["--field", "64x64", "--domain", "100"]) == 2
    assert "halo row" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--kernel-size", "-3"], "kernel size -3: a kernel size is a positive odd number"),
    (["--kernel-size", "4"], "kernel size 4: odd kernels only"),
    (["--json", "{tmp}/no/such/folder/plan.json"], "cannot write there"),
    (["--json", "{tmp}"], "cannot write there"),  # a folder
    (["--gpu", "80"], "'80' has no unit: write 80GiB"),
    (["--field", "64x64x64", "--domain", "0"], "ddp=1, domain=0: both axis sizes must be at least 1"),
    (["--param-dtype", "bfloat16"], "param_dtype=torch.bfloat16 is FSDP2's MixedPrecisionPolicy, and how='ddp': use "
                                    "how='fsdp2', or autocast=torch.bfloat16"),
])
def test_command_line_bad_input_is_one_line_that_says_what_to_change(args, says, tmp_path, capsys):
    assert plan_cli.main(["--field", "64x64", *[a.format(tmp=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("gpu, gib", [("80GB", "74.5"), ("80GiB", "80.0"), ("H100", "79.6"), ("H200", "140.4")])
def test_the_verdict_names_the_capacity_it_used_in_gib(gpu, gib, capsys):
    assert plan_cli.main(["--field", "64x64", "--gpu", gpu]) == 0
    assert f"verdict on {gib} GiB GPUs (--gpu {gpu}): fits with" in capsys.readouterr().out


def test_each_lever_moves_the_category_it_acts_on():
    planner = plan.Planner(plan.conv_model(2, width=16, depth=3), (1, 1, 128, 128))
    base = planner.plan(ddp=2, domain=2, wrapper="fsdp2").rows[0]

    def row(**levers):
        return planner.plan(ddp=2, domain=2, wrapper="fsdp2", levers=Levers(**levers)).rows[0]

    # Checkpointing keeps each block's input, this rank's 64 rows: the field and two 16-channel tensors; the halo
    # rows are added inside the blocks, recomputed in backward.
    checkpointed = row(checkpoint=True)
    assert checkpointed.activations == (1 + 2 * 16) * 64 * 128 * 4 and checkpointed.halos == 0
    assert checkpointed.peak < base.peak and checkpointed.params == base.params
    autocast = row(autocast=torch.bfloat16)  # half the bytes for what convolutions save, plus bf16 weight copies
    assert base.activations / 2 < autocast.activations < base.activations * 0.6
    assert (autocast.params, autocast.grads, autocast.optimizer) == (base.params, base.grads, base.optimizer)
    gathered = row(param_dtype=torch.bfloat16)  # FSDP2 gathers bf16; shards, gradients, Adam stay fp32
    assert gathered.buffers == base.buffers // 2 and gathered.optimizer == base.optimizer
    kept = row(reshard_after_forward=False)  # every unit gathered at the end of forward
    assert kept.buffers > base.buffers and kept.activations == base.activations
    with pytest.raises(ValueError, match="reshard_after_forward=False is an FSDP2 option"):
        planner.plan(ddp=2, wrapper="ddp", levers=Levers(reshard_after_forward=False))
    with pytest.raises(ValueError, match="checkpoint=True cuts an nn.Sequential into blocks"):
        plan.Planner(Spectral(), (1, 1, 64, 64)).plan(levers=Levers(checkpoint=True))


def test_command_line_plans_with_the_levers_on(capsys):
    base = ["--field", "512x512", "--wrapper", "fsdp2", "--ddp", "2"]
    totals = {}
    for name, flags in (("baseline", []), ("checkpoint + param_dtype bf16 + no reshard after forward",
                                          ["--checkpoint", "--param-dtype", "bfloat16", "--no-reshard-after-forward"])):
        assert plan_cli.main([*base, *flags]) == 0
        out = capsys.readouterr().out
        assert f"; levers: {name}\n" in out
        totals[name] = out
    assert totals["baseline"] != totals["checkpoint + param_dtype bf16 + no reshard after forward"]


def test_piping_into_head_ends_without_a_traceback():
    proc = subprocess.run(f"{sys.executable} -m shardlab.plan --field 4096x4096 --domain 8 | head -n 1", shell=True,
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("# memory plan:") and proc.stdout.count("\n") == 1
    assert proc.stderr == "", proc.stderr


class Spectral(torch.nn.Module):
    """An FNO-like layer: multiply in Fourier space over both spatial dims."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.fft.irfft2(torch.fft.rfft2(x) * self.weight, s=x.shape[-2:])


def test_what_cannot_be_planned_truthfully_is_refused_with_the_reason():
    spectral = plan.Planner(Spectral(), (1, 1, 64, 64))
    assert spectral.plan(domain=1).rows[0].activations > 0  # unsharded, an FFT is planned like any op
    with pytest.raises(ValueError, match="FFT .* along dim 2, the sharded dim: every output row depends on every "
                                         "input row"):
        spectral.plan(domain=2)
    with pytest.raises(ValueError, match="batch size 2 per domain group.*scale the global batch on the ddp axis"):
        plan.plan(plan.conv_model(2), (2, 1, 64, 64), domain=2)
    assert plan.plan(plan.conv_model(2), (2, 1, 64, 64), ddp=2).rows[0].activations > 0  # batch 2 on one rank: fine
    with pytest.raises(ValueError, match=r"a 2-D field \(1, 1, 64, 64\) given to a model with Conv3d layers"):
        plan.Planner(plan.conv_model(3), (1, 1, 64, 64))
    with pytest.raises(ValueError, match="cannot run on a field of shape"):
        plan.Planner(torch.nn.Linear(5, 5), (1, 1, 64, 64))


def profiled_step_peak(model, field_shape, optimizer: str, dtype, levers) -> int:
    """The allocator's peak over one training step on this CPU, read from torch.profiler's memory events (every
    allocation and free the CPU allocator makes, kernels' own buffers included), plus the bytes held before it."""
    from torch.profiler import ProfilerActivity, profile

    from shardlab.train import training_step, use_checkpointing

    model = model.to(dtype)
    if levers.checkpoint:
        model = use_checkpointing(model)
    opt = plan.OPTIMIZERS[optimizer](model.parameters())
    x = torch.randn(field_shape, dtype=dtype)
    y = torch.randn((field_shape[0], 1, *field_shape[2:]), dtype=dtype)
    training_step(model, opt, lambda: (x.clone(), y.clone()), levers=levers)  # gradients and optimizer state exist
    state = [*model.parameters(), *(p.grad for p in model.parameters()),
             *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    held = sum(t.numel() * t.element_size() for t in state)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        training_step(model, opt, lambda: (x.clone(), y.clone()), levers=levers)  # the batch copied in, as on a GPU
    return held + step_peak(prof.profiler.kineto_results.experimental_event_tree())


def step_peak(roots) -> int:
    """The most bytes live at once in a profile's allocation events, a free counted only where the profile saw the
    block allocated: torch's CPU memory reporter remembers sizes across profiler runs, so a tensor allocated before
    this one at an address an earlier run saw can be reported freed here (the series' ``cpu_allocator_changes``
    works around it; this reference reads the events on its own)."""
    events, stack = [], list(roots)
    while stack:
        node = stack.pop()
        stack += node.children
        fields = node.extra_fields
        if hasattr(fields, "alloc_size") and hasattr(fields, "ptr"):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    live = peak = 0
    allocated = set()
    for _, ptr, nbytes in sorted(events):
        if nbytes < 0 and ptr not in allocated:
            continue
        (allocated.add if nbytes > 0 else allocated.discard)(ptr)
        live += nbytes
        peak = max(peak, live)
    return peak


CHECKPOINT, AUTOCAST = Levers(checkpoint=True), Levers(autocast=torch.bfloat16)
PEAK_CASES = [  # (spatial size, width, depth, kernel, optimizer, dtype, levers)
    ((256, 256), 16, 3, 3, "adam", torch.float32, Levers()),
    ((512, 512), 16, 3, 3, "adam", torch.float32, CHECKPOINT),
    ((256, 256), 32, 5, 3, "sgd", torch.float32, Levers()),
    ((200, 136), 16, 4, 3, "adam", torch.float32, AUTOCAST),  # uneven sides
    ((192, 192), 16, 3, 5, "adamw", torch.float32, Levers(checkpoint=True, autocast=torch.bfloat16)),
    ((32, 32, 32), 8, 3, 3, "adamw", torch.float32, Levers()),
    ((24, 40, 32), 8, 4, 3, "sgd-momentum", torch.float32, CHECKPOINT),
    ((128, 320), 24, 3, 3, "sgd", torch.float32, AUTOCAST),
    ((16, 64), 16, 3, 3, "adam", torch.float32, Levers()),  # an input of 16k elements: torch's slow path
    ((64, 64, 64), 16, 3, 3, "adam", torch.float32, Levers()),  # a Conv3d large enough for oneDNN
]


def test_the_step_peak_is_within_10_percent_of_the_cpu_allocators_peak():
    """Ten 2-D and 3-D conv stacks, even and uneven, several optimizers, checkpointing and bf16 autocast, one
    process: the planner's peak against the CPU allocator's, measured independently (profiler memory events over
    the whole step; no code shared with the planner). One intra-op thread, as the ranks run. Which convolution kernel
    runs, and what it holds, differs from CPU to CPU (bf16 takes torch's slow path without AVX-512, oneDNN's blocked
    layouts follow the ISA): the planner measures the kernels on the CPU it runs on (``plan.workspace``), so this
    holds on any CPU; a model fitted on one CPU failed it on two others."""
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spatial, width, depth, kernel, optimizer, dtype, levers in PEAK_CASES:
            field_shape = (1, 1, *spatial)
            model = conv_stack(width=width, layers=depth, kernel_size=kernel, dims=len(spatial))
            predicted = plan.plan(model, field_shape, wrapper="none", optimizer=optimizer, dtype=dtype,
                                  device="cpu", levers=levers).rows[0].peak
            measured = profiled_step_peak(model, field_shape, optimizer, dtype, levers)
            rows.append((spatial, width, depth, kernel, optimizer, levers.label, predicted, measured,
                         f"{(predicted - measured) / measured:+.1%}"))
    finally:
        torch.set_num_threads(threads)
    print("\n".join(map(str, rows)))
    assert all(abs(p - m) <= 0.10 * m for *_, p, m, _ in rows), rows


@pytest.mark.parametrize("gpus, factor, device, ok", [(2, 1.05, "cuda", True), (2, 0.85, "cuda", False),
                                                      (1, 1.0, "cuda", True), (2, 1.0, "cpu", False)])
def test_gpu_check_judges_every_rank_of_the_peak_configurations(monkeypatch, gpus, factor, device, ok):
    """The GPU count simulated: the job's measurement is made from the planner's own peaks, scaled by ``factor``."""
    from types import SimpleNamespace

    cases = plan.peak_cases(gpus, scale=16)
    assert len(cases) >= 8 and cases[0]["field"] == [1, 1, 64 * 16, 64 * 16]
    assert {c["domain"] for c in cases} == ({1, 2} if gpus == 2 else {1})

    def fake_job(n, job_cases, timeout_s):
        assert n == gpus and job_cases == cases
        measured = [case | {"ranks": [r.as_dict() | {"peak": round(r.peak / factor)} for r in
                                      plan.predict_case(case, "cuda").rows]} for case in job_cases]
        label = f"{n} {'CUDA' if device == 'cuda' else 'CPU'} rank(s)"
        return SimpleNamespace(result={"world_size": n, "backend": "nccl", "device": f"{device}:0",
                                       "cases": measured}, placement=SimpleNamespace(device=device, label=label))

    monkeypatch.setattr(plan.validate, "measure_on_ranks", fake_job)
    result, passed = plan.gpu_check(gpus)
    assert passed == ok, result
    if device == "cuda":
        assert result.count("max_memory_allocated") == len(cases) and f"worst rank {factor - 1:+.1%}"[:12] in result
    else:
        assert result.startswith("no CUDA peak was measured")
