"""The planner for any model against a measurement that shares no code with it, on 2 and 4 CPU ranks.

For every model of docs/models.md that runs at that rank count (a parity row with an output error), ``sl.plan.Planner
(case, size)`` is calibrated on the ranks (one job for all of them: ``plan.cases.prepare``) and asked for the step's
peak at a size it never measured (twice the larger of its two); ``scripts/plan_cases.py`` measures that step on the
ranks with its own code (the parity harness's layout, its own step, torch.profiler's ``[memory]`` events). The
largest rank's planned peak is within 10 % of the measured one. Ratios are printed (``-s``). CPU ranks: no GPU figure.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from shardlab import model_cases
from shardlab.plan.cases import prepare

ROOT = Path(__file__).resolve().parents[2]
RUN_ON_CPU = {"Transolver", "GeoTransolver", "FNO", "U-Net (sl.models.unet)"}  # parity at 2 and 4 CPU ranks here


def _script():
    spec = importlib.util.spec_from_file_location("plan_cases", ROOT / "scripts" / "plan_cases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable(ranks: int) -> list:
    """The cases whose docs/models.md row at ``ranks`` CPU ranks has a parity result (the model ran), and those known to
    run on CPU ranks (``RUN_ON_CPU``) whatever the last table says."""
    ran = set()
    for line in (ROOT / "docs" / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) > 3 and cells[1] == f"{ranks} (cpu)" and re.search(r"output \d", cells[3]):
            ran.add(cells[0])
    return [case for case in model_cases.CASES if case.name in ran | RUN_ON_CPU]


@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [2, 4])
def test_planned_peak_within_10_percent_of_a_step_measured_at_a_size_never_measured(ranks, no_leftovers):
    cases = runnable(ranks)
    prepare(cases, ranks)  # one calibration job for every case; each Planner(case, ...) reuses it
    rows = _script().ratios(cases, ranks)
    for row in rows:
        print(f"{ranks} ranks, {row['model']}: planned {row.get('predicted')} / measured {row.get('measured')} at "
              f"{row['size']} (calibrated at {row.get('measured at')}, {row.get('method')}): {row.get('ratio', 0):.3f}")
    assert len(rows) == len(cases) and all("error" not in row for row in rows), rows
    for row in rows:
        assert row["size"] > max(row["measured at"]), row  # a size the planner did not measure
        assert abs(row["ratio"] - 1) <= 0.10, row


# A model whose output is a multiple of its input: SRResNet's upsampling (physicsnemo.models.srrn: a convolution to
# 2³ times the channels, PixelShuffle3d, a convolution), at lesson 15's width, with ReLU for its PReLU and no batch
# norm: those two run split only through handlers registered from user code, whose own bytes the meta replay does not
# see (the plan says so: ``Planner.handlers_note``). Every op here is split by PhysicsNeMo's own handlers.
UPSAMPLER = '''
import torch
from physicsnemo.models.srrn.super_res_net import PixelShuffle3d


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 8, 9, padding=4), torch.nn.ReLU(),
                               torch.nn.Conv3d(8, 8 * 2**3, 3, padding=1), PixelShuffle3d(2), torch.nn.ReLU(),
                               torch.nn.Conv3d(8, 1, 9, padding=4))
'''

# One training step on every rank, measured by this program's own code (no planner, no parity harness): the field
# and the target, 2N deep and twice as wide, scattered (scatter_tensor: the target's torch.chunk rows are the output's
# here, an even split), the written run's loss, Adam, the peak read from torch.profiler's [memory] events.
UPSAMPLER_STEP = r'''
import sys
import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import scatter_tensor
from torch.distributed.tensor import Shard
from torch.profiler import ProfilerActivity, profile, record_function

from shardlab.mesh import build_mesh
from shardlab.ranks.launch import init_distributed, shutdown_distributed, write_job_result

sys.path.insert(0, sys.argv[1])
import upsampler

DEPTH, WINDOW = int(sys.argv[2]), "measured step"
init_distributed(120)
domain = build_mesh(ddp=1, domain=dist.get_world_size())["domain"]
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    model = upsampler.build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    for step in range(2):
        with record_function(WINDOW if step else "warm-up"):
            x, y = torch.randn(1, 1, DEPTH, 8, 8), torch.randn(1, 1, 2 * DEPTH, 16, 16)
            x, y = (scatter_tensor(t, 0, domain, (Shard(2),)) for t in (x, y))
            out = model(x)
            loss = ((out - y) ** 2).sum() / out.numel()
            del out, x, y
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            del loss
events = list(prof.profiler.kineto_results.events())
window = next(e for e in events if e.name() == WINDOW)
live = peak = 0
for event in sorted((e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"),
                    key=lambda e: e.start_ns()):
    live += event.nbytes()
    if window.start_ns() <= event.start_ns() <= window.end_ns():
        peak = max(peak, live)
every = [None] * dist.get_world_size()
dist.all_gather_object(every, peak)
if dist.get_rank() == 0:
    write_job_result({"threads": torch.get_num_threads(), "peaks": every})
shutdown_distributed()
'''


@pytest.mark.multirank
def test_an_upsampling_model_planned_within_10_percent_of_a_step_measured_on_two_ranks(tmp_path, no_leftovers):
    """The meta replay's plan of a model that doubles each spatial dim (output 2N: target, activations and halos
    after the upsampling at twice the rows) against one step measured on 2 CPU ranks by the program above. The meta
    replay measures nothing at any size (only convolution kernels' workspaces, on this CPU), so every size is one it
    never measured. About 10 s: one job of 2 ranks."""
    import importlib.util

    from shardlab import plan
    from shardlab.ranks.launch import run_job

    depth = 512
    (tmp_path / "upsampler.py").write_text(UPSAMPLER)
    (tmp_path / "step.py").write_text(UPSAMPLER_STEP)
    measured = run_job("torchrun", 2, tmp_path / "step.py", [str(tmp_path), str(depth)], timeout_s=300,
                       device="cpu").result
    spec = importlib.util.spec_from_file_location("upsampler", tmp_path / "upsampler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    planner = plan.Planner(module.build(), (1, 1, depth, 8, 8), device="cpu", threads=measured["threads"])
    assert planner.target_shape == (1, 1, 2 * depth, 16, 16)
    predicted = max(row.peak for row in planner.plan(1, 2, "none").rows)
    ratio = predicted / max(measured["peaks"])
    print(f"2 ranks, SRResNet's upsampling at depth {depth}: planned {predicted} / measured {measured['peaks']}: "
          f"{ratio:.3f}")
    assert abs(ratio - 1) <= 0.10, (predicted, measured)
