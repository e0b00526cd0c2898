"""Judges of ``notebooks/07_capstone.ipynb``: the learner's training step against ``sl.train.Trainer`` (the answer
key), the learner's checkpoint against the state gathered from the model, and the samples of one step.

Each judge runs on every rank with the learner's own function or answer and works out what is right there,
from that rank's mesh and models it builds itself.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from ..launch import default_device
from ..measure import strict_fp32
from ..models import conv_stack
from ..train import Trainer, normalized_darcy, wrap

STEPS_JUDGED = 3  # enough for gradients left over from one step to show in the next


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _max_weight_difference(a, b) -> float:
    return max((_full(p) - _full(q)).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def step_matches_trainer(train_step, mesh, how, lr):
    """Exercise 1: ``train_step(model, optimizer, mesh, inputs, targets, step)`` trains like ``sl.train.Trainer``:
    the same global loss at every step and the same weights after them, with the sample scattered over the
    domain group."""
    if not callable(train_step):
        return f"train_step is a {type(train_step).__name__}: define a function train_step(model, optimizer, ...)"
    device = default_device()
    inputs, targets = normalized_darcy()
    key = Trainer(conv_stack(seed=0).to(device), mesh, how, lr=lr, samples=(inputs, targets))
    model = wrap(conv_stack(seed=0).to(device), mesh, how)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    untrained = conv_stack(seed=0).to(device)
    given = []
    hook = model.register_forward_pre_hook(lambda module, args: given.append(args[0]))
    expected, got = [], []
    try:
        with strict_fp32():
            for step in range(STEPS_JUDGED):
                expected.append(key.step())
                got.append(train_step(model, optimizer, mesh, inputs, targets, step))
    finally:
        hook.remove()
    if not given:
        return "the model was never called: the step must run model(x) on the scattered input"
    x = given[0]
    if type(x).__name__ != "ShardTensor" or tuple(x.placements) != (Shard(2),):
        return (f"the model was given a {type(x).__name__} of shape {tuple(x.shape)} on this rank: each domain group "
                "shares one sample, scattered over mesh['domain'] along the rows (Shard(2))")
    if any(not isinstance(loss, float) for loss in got):
        kinds = sorted({type(loss).__name__ for loss in got})
        return f"train_step returned {', '.join(kinds)}: return the global loss as a Python float"
    if _max_weight_difference(model, untrained) == 0.0:
        return "the weights never changed: after backward() the optimizer must take its step"
    for step, (g, e) in enumerate(zip(got, expected)):
        if abs(g - e) > 1e-6 * abs(e):
            return (f"at step {step} it returned a loss {abs(g - e) / abs(e):.1e} (relative) away from the reference "
                    "loop's: the global mean loss of the step, the same on every rank, computed from this step's "
                    "own gradients only")
    worst = _max_weight_difference(model, key.model)
    if worst > 1e-5:
        return f"the losses agree but after {STEPS_JUDGED} steps the weights differ from the reference by {worst:.1e}"
    return None


def _shared_temporary_path() -> tuple[Path, Path]:
    """A fresh folder made on rank 0 and the file path in it, the same on every rank."""
    box = [tempfile.mkdtemp(prefix="shardlab-07-judge-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]), Path(box[0]) / "checkpoint.pt"


def _compare_checkpoint(path: Path, model_state: dict, optimizer_state: dict, step: int) -> str | None:
    """Rank 0: what is wrong with the file at ``path``, compared with the state gathered from the model."""
    if not path.exists():
        return ("no file was written at the path it was given: rank 0 writes it, after every rank took part in "
                "gathering the state")
    saved = torch.load(path, weights_only=False, map_location="cpu")  # CPU-only: compared in host memory
    if not isinstance(saved, dict):
        return f"the file holds a {type(saved).__name__}: save a dict with 'model', 'optimizer' and 'step'"
    missing = [k for k in ("model", "optimizer", "step") if k not in saved]
    if missing:
        return f"the file has no {' and no '.join(repr(k) for k in missing)}: a resumed run needs all three"
    if saved["step"] != step:
        return f"'step' is {saved['step']!r}, not the step the function was given"
    keys = list(saved["model"])
    if any(k.startswith("module.") for k in keys):
        return ("the model's keys start with 'module.', the DDP wrapper's names: save the module's own state "
                "(get_model_state_dict), which loads with or without a wrapper")
    if set(keys) != set(model_state):
        return "the model state's keys are not the model's parameter and buffer names"
    if any(hasattr(v, "to_local") for v in saved["model"].values()):
        return "the model state holds DTensor shards: gather the full tensors (full_state_dict=True)"
    if any(not torch.equal(saved["model"][k].cpu(), model_state[k].cpu()) for k in model_state):
        return "the saved weights are not the model's current weights"
    state = saved["optimizer"].get("state") if isinstance(saved["optimizer"], dict) else None
    if not state:
        return "the optimizer state is empty: Adam's moments would restart from zero"
    if set(state) != set(optimizer_state["state"]):
        return ("the optimizer state is keyed by parameter numbers, not names (optimizer.state_dict()): use "
                "get_optimizer_state_dict(model, optimizer, ...), which any wrapper can load")
    for name, moments in optimizer_state["state"].items():
        for k, v in moments.items():
            if not torch.equal(torch.as_tensor(state[name][k]).cpu(), torch.as_tensor(v).cpu()):
                return f"the optimizer's {k!r} for {name} is not the optimizer's current one"
    return None


def checkpoint_is_complete(save_checkpoint, model, optimizer):
    """Exercise 2: ``save_checkpoint(model, optimizer, step, path)`` leaves one file with the full model and optimizer
    state (parameter names as keys, no wrapper prefix, no shards) and the step."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if not callable(save_checkpoint):
        return f"save_checkpoint is a {type(save_checkpoint).__name__}: define a function save_checkpoint(...)"
    folder, path = _shared_temporary_path()
    step = 5
    try:
        save_checkpoint(model, optimizer, step, str(path))
        dist.barrier()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=options)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
        verdict = [_compare_checkpoint(path, model_state, optimizer_state, step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(verdict, src=0)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return verdict[0]


def samples_of_first_step(used, mesh):
    """Exercise 3: ``used`` lists the samples whose gradients went into optimizer step 0, gathered from every rank."""
    if not isinstance(used, (list, tuple)) or not all(isinstance(i, int) for i in used):
        return f"used is {used!r}: a list of sample indices (ints)"
    right = list(range(mesh["ddp"].size()))  # replica r trains on sample step * ddp + r
    if list(used) == right:
        return None
    if sorted(set(used)) == right:
        return (f"it lists {len(used)} entries for {len(set(used))} samples: the ranks of a domain group share "
                "one sample, so count each sample once")
    if set(right) < set(used):
        return "it lists samples that step 0 did not train on: only the first step's samples count"
    return "these are not the samples step 0 trained on, sorted: gather the sample index each rank scattered"
