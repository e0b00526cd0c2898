"""Training layer on 2 ranks: a checkpoint written mid-run (``save_checkpoint``) and loaded
(``Trainer.load_full_state``) resumes on a fresh model at exactly the uninterrupted run's losses (DDP and FSDP2),
and the levers train the same model on ranks. In one process: tests/unit/test_train.py."""

import json

import pytest

from shardlab.ranks.launch import run_job

ROUND_TRIP = """
import json, sys
import torch
import torch.distributed as dist
import shardlab as sl
sl.init_distributed(60)
device = sl.ranks.launch.default_device()
mesh = sl.build_mesh(ddp=-1, domain=1)
path = sys.argv[1]
result = {}
for how, model in (("ddp", sl.models.conv_stack), ("fsdp2", sl.models.conv_stack), ("fsdp2 unet", sl.models.unet)):
    trainer = sl.train.Trainer(model(seed=0).to(device), mesh, how.split()[0])
    for _ in range(2):
        trainer.step()
    sl.train.save_checkpoint(trainer, path)
    uninterrupted = [trainer.step() for _ in range(2)]
    fresh = sl.train.Trainer(model(seed=99).to(device), mesh, how.split()[0])
    # Rank 0 alone reads the file (into host memory); load_full_state broadcasts it to every rank.
    fresh.load_full_state(torch.load(path, weights_only=False, map_location="cpu") if dist.get_rank() == 0 else None)
    result[how] = {"resumed": [fresh.step() for _ in range(2)], "uninterrupted": uninterrupted,
                   "steps_done": fresh.steps_done}
if dist.get_rank() == 0:
    print("RESULT", json.dumps(result))
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
def test_checkpoint_round_trip_resumes_at_the_same_losses(tmp_path, no_leftovers):
    script = tmp_path / "round_trip.py"
    script.write_text(ROUND_TRIP)
    job = run_job("torchrun", 2, script, [str(tmp_path / "state.pt")], timeout_s=300,
                  env={"CUDA_VISIBLE_DEVICES": ""})
    result = json.loads(job.stdout.split("RESULT", 1)[1])
    for how, run in result.items():
        assert run["steps_done"] == 4, how
        assert run["resumed"] == pytest.approx(run["uninterrupted"], rel=1e-6), how


LEVERS_ON_RANKS = """
import json
import torch
import torch.distributed as dist
import shardlab as sl
from shardlab.train import Levers
sl.init_distributed(60)
device = sl.ranks.launch.default_device()
result = {}
for layout, how, levers in (((1, 2), "ddp", Levers(checkpoint=True)),
                            ((2, 1), "fsdp2", Levers(checkpoint=True, reshard_after_forward=False)),
                            ((2, 1), "fsdp2", Levers(param_dtype=torch.bfloat16)),
                            ((1, 2), "none", Levers(autocast=torch.bfloat16))):
    mesh = sl.build_mesh(ddp=layout[0], domain=layout[1])
    runs = [sl.train.train(sl.models.conv_stack(seed=0).to(device), mesh, how, steps=3, levers=chosen).losses
            for chosen in (Levers(), levers)]
    result[f"{how} {layout} {levers}"] = runs
if dist.get_rank() == 0:
    print("RESULT", json.dumps(result))
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
def test_levers_train_the_same_model_on_ranks(tmp_path, no_leftovers):
    """Checkpointing and reshard_after_forward change memory, not the step: the same losses as without, on a
    domain-sharded field (DDP) and on FSDP2. bf16 (FSDP2's param_dtype, autocast on a sharded field) trains close."""
    script = tmp_path / "levers.py"
    script.write_text(LEVERS_ON_RANKS)
    job = run_job("torchrun", 2, script, [], timeout_s=300, env={"CUDA_VISIBLE_DEVICES": ""})
    result = json.loads(job.stdout.split("RESULT", 1)[1])
    assert len(result) == 4
    for name, (baseline, with_levers) in result.items():
        tolerance = 3e-2 if "bf16" in name else 1e-6
        assert with_levers == pytest.approx(baseline, rel=tolerance), name
        if "bf16" in name:  # it did compute in bf16
            assert with_levers != baseline, name
