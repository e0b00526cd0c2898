"""Checkpoints layer: a (ddp=2, domain=2) FSDP2 run saved in parts (``save_sharded``) resumes at the uninterrupted
run's losses in another layout, (ddp=1, domain=4) under FSDP2 and DDP, and in one process with no process group.
Bad names and folders, without ranks: tests/unit/test_checkpoints.py.

The honest comparison keeps the global batch: a step at ddp=2 averages the gradients of two samples, so after the
change of layout a step must train the same two samples (``step_with_global_batch``: the one replica accumulates
both, each loss halved; in one process, ``train_one_process`` resumed with the loaded optimizer: a batch of both).
A ddp=1 run that trained one sample a step would be another run, whose losses no checkpoint could make equal."""

import json

import pytest
import torch

from shardlab import checkpoints
from shardlab.data import normalized_darcy
from shardlab.models import unet
from shardlab.ranks.launch import run_job
from shardlab.train import train_one_process

STEPS, MORE = 3, 3  # steps before the save, steps compared after it
TOLERANCE = 1e-10  # relative, float64: the layouts add the same numbers in another order (measured: ~1e-16)


ACROSS_LAYOUTS = """
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
import shardlab as sl
from shardlab.checkpoints import load_sharded, save_sharded, step_with_global_batch

sl.init_distributed(120)
device = sl.ranks.launch.default_device()
folder, STEPS, MORE = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
samples = sl.data.normalized_darcy(dtype=torch.float64)  # float64, as notebook 07: the layouts' rounding stays tiny
rank_0 = dist.get_rank() == 0


def unet(seed):
    return sl.models.unet(levels=4, seed=seed)  # 64 rows over 4 domain ranks: 4 levels (sl.models.UNet)


def trainer(ddp, domain, how, seed, model=unet):
    mesh = sl.build_mesh(ddp=ddp, domain=domain)
    return sl.train.Trainer(model(seed=seed).to(device, torch.float64), mesh, how, samples=samples)


def timed(save):
    dist.barrier()
    start = time.perf_counter()
    save()  # both end on a barrier: rank 0's time is the slowest rank's
    return time.perf_counter() - start


saved = trainer(2, 2, "fsdp2", seed=0)
for _ in range(STEPS):
    saved.step()
seconds = {"save_sharded": [], "save_checkpoint": []}
for _ in range(3):  # side by side, alternating; a second save replaces the first
    seconds["save_sharded"].append(timed(lambda: save_sharded(saved, folder / "parts")))
    seconds["save_checkpoint"].append(timed(lambda: sl.train.save_checkpoint(saved, folder / "full.pt")))
result = {"seconds": seconds, "before": list(saved.losses), "uninterrupted": [saved.step() for _ in range(MORE)],
          "files": {p.name: p.stat().st_size for p in sorted((folder / "parts").iterdir())},
          "full.pt": (folder / "full.pt").stat().st_size, "beside": sorted(p.name for p in folder.iterdir())}
for how in ("fsdp2", "ddp"):
    resumed = trainer(1, 4, how, seed=99)
    load_sharded(resumed, folder / "parts")
    result[how] = {"steps_done": resumed.steps_done, "losses": list(resumed.losses),
                   "resumed": [step_with_global_batch(resumed, 2) for _ in range(MORE)]}

other = trainer(1, 4, "fsdp2", seed=0, model=sl.models.conv_stack)
before = [p.detach().clone() for p in other.model.parameters()]
refusals = []
for attempt in (lambda: load_sharded(other, folder / "parts"), lambda: save_sharded(other, folder / "plain")):
    (folder / "plain").mkdir(exist_ok=True)
    try:
        attempt()
        refusals.append(None)
    except ValueError as error:
        refusals.append(str(error))
unchanged = all(torch.equal(a, b) for a, b in zip(before, other.model.parameters())) and not other.optimizer.state
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, {"refusals": refusals, "unchanged": unchanged})
result["bad input"] = everyone
result["plain"] = sorted(p.name for p in (folder / "plain").iterdir())
if rank_0:
    sl.ranks.launch.write_job_result(result)
sl.ranks.launch.shutdown_distributed()
"""


def _largest_difference(losses, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


@pytest.mark.multirank
def test_a_sharded_checkpoint_resumes_in_other_layouts_at_the_uninterrupted_losses(tmp_path, no_leftovers):
    script = tmp_path / "across_layouts.py"
    script.write_text(ACROSS_LAYOUTS)
    folder = tmp_path / "run"
    folder.mkdir()
    result = run_job("torchrun", 4, script, [str(folder), str(STEPS), str(MORE)], timeout_s=240, device="cpu").result
    uninterrupted = result["uninterrupted"]

    # Every rank wrote a part; the folder was renamed into place, no temporary left beside it.
    assert sorted(result["files"]) == [".metadata", *[f"__{rank}_0.distcp" for rank in range(4)]]
    assert result["beside"] == ["full.pt", "parts"]
    differences = {}
    for how in ("fsdp2", "ddp"):
        resumed = result[how]
        assert resumed["steps_done"] == STEPS and resumed["losses"] == result["before"]
        differences[f"(ddp=1, domain=4) {how}"] = _largest_difference(resumed["resumed"], uninterrupted)

    # One process, no process group: the test's own.
    model = unet(levels=4, seed=7).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    progress = checkpoints.load_into_one_process(model, optimizer, folder / "parts")
    assert progress == {"steps_done": STEPS, "losses": result["before"]}
    samples = normalized_darcy(dtype=torch.float64)
    resumed = train_one_process(model, MORE, ddp_size=2, samples=samples, optimizer=optimizer, first=STEPS)
    differences["one process"] = _largest_difference(resumed, uninterrupted)
    # The series' reference: the same run uninterrupted in one process, from the start.
    reference = train_one_process(unet(levels=4, seed=0).double(), STEPS + MORE, ddp_size=2, samples=samples)
    differences["ranks, uninterrupted, vs train_one_process"] = _largest_difference(
        progress["losses"] + uninterrupted, reference)

    for rank in result["bad input"]:
        names, existing = rank["refusals"]
        assert names.startswith(f"the checkpoint at {folder / 'parts'} does not match this model: missing 0.bias"), rank
        assert existing == f"{folder / 'plain'} exists and is not a checkpoint: save into a new folder, or remove " \
                           "this one."
        assert rank["unchanged"], rank
    assert result["plain"] == []

    sizes = {"parts": sum(result["files"].values()), "full.pt": result["full.pt"]}
    print("CHECKPOINTS", json.dumps({"largest relative loss difference": differences, "files": result["files"],
                                     "bytes": sizes, "seconds": result["seconds"]}))
    assert all(difference <= TOLERANCE for difference in differences.values()), differences
    # The parts hold the same state as the single file, with DCP's metadata on top: nothing lost, nothing doubled.
    assert sizes["full.pt"] < sizes["parts"] < 1.2 * sizes["full.pt"], sizes
