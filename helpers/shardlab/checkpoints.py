"""Checkpoints written in parts, one per rank, and loaded into another layout.

``save_sharded`` writes a Trainer's state with ``torch.distributed.checkpoint`` (DCP): every rank offers the shards it
holds, DCP's planner keeps one writer for each piece that several ranks hold alike (``default_planner.py``,
``_dedup_save_plans``), and rank 0 writes a ``.metadata`` file that maps each parameter's name to its pieces. The folder
must be one folder for every rank (a shared file system): ``FileSystemWriter`` writes every rank's part into it, rank 0
the metadata, and rank 0 renames it into place. ``load_sharded`` reads them into a Trainer of
any other mesh shape or wrapper, ``load_into_one_process`` into a plain model in a process with no process group: each
reads the pieces its own shards need (DCP's planner, ``torch/distributed/checkpoint/default_planner.py``).
``step_with_global_batch`` then takes the steps the saved run would have taken (``sl.train.train_one_process``
with ``optimizer`` and ``first`` in one process).

Introduced in ``notebooks/12_data_at_scale.ipynb``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

from .data import sample_index
from .train import average_gradients_by_hand

METADATA = ".metadata"  # what DCP's FileSystemWriter writes last (filesystem.py, _metadata_fn)
SHOWN = 4  # names shown in an error before "and N more"


def save_sharded(trainer, folder) -> None:
    """The model and optimizer state as every rank holds it (``get_state_dict``: FSDP2 shards stay shards), with the
    step count and the losses, written by DCP into ``folder + ".writing"`` (each piece by one rank), which rank 0
    renames into place after a barrier: notebook 12's four calls, plus the checks. ``folder`` must be on a file system
    every rank sees. A collective: every rank calls it. An earlier checkpoint in ``folder`` is replaced."""
    folder = Path(folder)
    if folder.exists() and not is_checkpoint(folder):
        raise ValueError(f"{folder} exists and is not a checkpoint: save into a new folder, or remove this one.")
    writing = folder.with_name(folder.name + ".writing")
    if dist.get_rank() == 0 and writing.exists():
        shutil.rmtree(writing)  # an interrupted save's parts
    dist.barrier()
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state,
             "steps_done": trainer.steps_done, "losses": list(trainer.losses)}  # Python values: DCP pickles them
    dcp.save(state, storage_writer=dcp.FileSystemWriter(writing))
    dist.barrier()  # every rank's part written before the folder is renamed
    if dist.get_rank() == 0:
        _replace(writing, folder)
    dist.barrier()  # nobody reads the folder before it is in place


def _replace(new: Path, folder: Path) -> None:
    """Put ``new`` at ``folder``; an old checkpoint there is moved aside first and removed last, so that a crash
    leaves one complete checkpoint at ``folder`` or beside it, never a mix."""
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(new, folder)
    shutil.rmtree(old, ignore_errors=True)


def is_checkpoint(folder) -> bool:
    """Whether ``folder`` holds a complete DCP checkpoint: DCP writes its ``.metadata`` file after every part."""
    return (Path(folder) / METADATA).is_file()


def saved_shapes(folder) -> dict[str, tuple]:
    """The shape of each model parameter and buffer saved in the checkpoint at ``folder``, read from its metadata
    alone (the whole tensor's shape, however it was sharded)."""
    _check_folder(folder)
    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    # Nested state dicts are saved flattened: ("model", "down.0.weight") becomes "model.down.0.weight".
    return {key.removeprefix("model."): tuple(getattr(item, "size", ()))
            for key, item in metadata.items() if key.startswith("model.")}


def _check_folder(folder) -> None:
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {folder}: give the folder save_sharded wrote.")
    if not is_checkpoint(folder):
        raise FileNotFoundError(f"{folder} is not a torch.distributed.checkpoint folder (no {METADATA} file): give the "
                                "folder save_sharded wrote; a torch.save file loads with torch.load.")


def check_matches(model, folder) -> None:
    """Raise a one-line ValueError when the checkpoint at ``folder`` was saved from a model with other parameter
    names (naming the missing and unexpected ones) or shapes than ``model``; reads the metadata, modifies nothing."""
    saved, expected = saved_shapes(folder), {name: tuple(t.shape) for name, t in get_model_state_dict(model).items()}
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"the checkpoint at {folder} does not match this model: missing {_some(missing)}, "
                         f"unexpected {_some(unexpected)}. Load it into the model it was saved from, or rename the "
                         "saved names to this model's.")
    resized = [f"{name} {saved[name]} saved, {expected[name]} here" for name in sorted(saved) if
               saved[name] != expected[name]]
    if resized:
        raise ValueError(f"the checkpoint at {folder} has other shapes than this model: {_some(resized)}. Build the "
                         "model with the sizes it was saved with.")


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN]) or "none"
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _load(model, optimizer, folder, no_dist: bool) -> dict:
    """Check the names, then read the checkpoint into ``model``'s and ``optimizer``'s state in their own layout."""
    check_matches(model, folder)  # before get_state_dict, which gives an optimizer with no state a zero step
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "steps_done": 0, "losses": []}
    dcp.load(state, checkpoint_id=folder, no_dist=no_dist)  # tensors in place; the Python values replaced
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {"steps_done": state["steps_done"], "losses": list(state["losses"])}


def load_sharded(trainer, folder) -> None:
    """Load the checkpoint at ``folder`` into ``trainer``, whatever its mesh shape and wrapper: each rank reads the
    pieces of its own shards. A collective: every rank calls it. Bad names or folder: raised on every rank before
    anything is modified."""
    progress = _load(trainer.model, trainer.optimizer, folder, no_dist=False)
    trainer.steps_done, trainer.losses = progress["steps_done"], progress["losses"]


def load_into_one_process(model, optimizer, folder) -> dict:
    """Load the checkpoint at ``folder`` into a plain model and its optimizer in one process, with no process group
    (``dcp.load(..., no_dist=True)``, ``state_dict_loader.py``): every saved shard is read into the whole tensors.
    Returns ``{"steps_done": ..., "losses": [...]}``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is what we ask for
        return _load(model, optimizer, folder, no_dist=True)


def step_with_global_batch(trainer, global_batch: int) -> float:
    """One step of ``trainer`` on the ``global_batch`` samples a run with ``ddp = global_batch`` trains at this step
    (``sample_index``): each ddp replica accumulates the gradients of ``global_batch / ddp`` of them, each loss
    divided by that count, so the gradient is the same mean. A run saved at ddp=2 resumes on ddp=1 at the same
    steps. Returns the global mean loss, as ``Trainer.step`` does."""
    per_replica, rest = divmod(global_batch, trainer.ddp_size)
    if rest or not per_replica:
        raise ValueError(f"global_batch={global_batch} is not a multiple of this mesh's ddp size {trainer.ddp_size}: "
                         "give a multiple of it (the ddp size of the run you resume).")
    autocast = trainer.levers.autocast
    total = torch.zeros(1, dtype=torch.float64, device=trainer.device)
    trainer.optimizer.zero_grad()
    for j in range(per_replica):
        i = sample_index(trainer.steps_done, global_batch, trainer.replica * per_replica + j, trainer.n_samples)
        x, y = trainer.sample(i)
        with contextlib.nullcontext() if autocast is None else torch.autocast(x.device.type, autocast):
            loss = ((trainer.model(x) - y) ** 2).mean() / per_replica
        loss.backward()  # gradients add up over the samples; DDP and FSDP2 average them over the replicas
        total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach().double()
    if trainer.how == "none" and trainer.ddp_size > 1:
        average_gradients_by_hand(trainer.model, trainer.mesh["ddp"].get_group())
    trainer.optimizer.step()
    dist.all_reduce(total, group=trainer.mesh["ddp"].get_group())
    trainer.steps_done += 1
    trainer.losses.append(total.item() / trainer.ddp_size)
    return trainer.losses[-1]
