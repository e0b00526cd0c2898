"""Judges of ``notebooks/07_capstone.ipynb``: the learner's training step against ``sl.train.Trainer`` (the answer
key), the learner's checkpoint against the state gathered from a model under DDP and under FSDP2 (and loaded under the
other wrapper), and the samples of one step.

Each judge runs on every rank and calls the learner's function on what the learner has not seen: a model, data,
steps and mesh of its own, built fresh, so that neither an object of the notebook nor a typed-in number can pass.
While the learner's function runs, the judge watches what it calls: the forward inputs it gives the model, the
optimizer it steps, the ranks that write, the gathers, and the library functions that the exercise rebuilds (they
are recorded, not blocked, so that every rank takes the same path through the collectives).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from .. import data, train
from ..mesh import MESH_AXES
from ..models import conv_stack
from ..ranks.launch import default_device
from .judging import Watch, case_generator, second_hint

STEPS_JUDGED = 3  # enough for gradients left over from one step to show in the next
JUDGED_SAMPLES = 5  # fewer than the steps judged take at any ddp size: the step must go round the samples again
# A file that loads under DDP can still hold FSDP2's shards: each wrapper saves, and the other loads.
CHECKPOINTED_UNDER = ("ddp", "fsdp2")


def _watching(*targets) -> Watch:
    """A ``check.Watch`` of attributes only, ``(owner, name, label)`` each (the judged code may compile or run
    collectives of its own, so no profile hook and no dispatch mode)."""
    return Watch(attributes={label: (owner, name) for owner, name, label in targets}, collectives=False)


def _library_calls(calls, rebuilt: str) -> str | None:
    if not calls:
        return None
    return (f"it called {', '.join(sorted(set(calls)))}, which {rebuilt}: write it from the parts the exercise "
            "lists instead")


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _max_weight_difference(a, b) -> float:
    return max((_full(p) - _full(q)).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _judged_data() -> tuple:
    """Samples the notebook never names: a few training samples from the end of the split, in reverse order, in
    float64 as the notebook's (so a step that reads the notebook's own data fails on its numbers, not its dtype)."""
    inputs, targets = data.normalized_darcy(dtype=torch.float64)
    return inputs[-JUDGED_SAMPLES:].flip(0).clone(), targets[-JUDGED_SAMPLES:].flip(0).clone()


def _judged_model(seed: int):
    return conv_stack(seed=seed).to(default_device(), torch.float64)


@second_hint(
    "In order: optimizer.zero_grad(), loss.backward(), optimizer.step(), on the optimizer you were given. Scatter"
    ' both inputs[i : i + 1] and targets[i : i + 1] with scatter_tensor(..., src, mesh["domain"], (Shard(2),)), '
    'src = dist.get_global_rank(mesh["domain"].get_group(), 0). Return loss.full_tensor(), all-reduced over '
    'mesh["ddp"].get_group() and divided by the ddp size, as a float.'
)
def step_matches_trainer(train_step, mesh, how, lr):
    """Exercise 1: ``train_step(model, optimizer, mesh, inputs, targets, step)`` trains like ``sl.train.Trainer``:
    the same global loss at every step and the same weights after them. It is run on a model, samples and steps
    of the judge's own, and must give the model this rank's rows of its sample (a Shard(2) ShardTensor) at every
    call, step the optimizer it was given, and not call the Trainer it rebuilds."""
    if not callable(train_step):
        return f"train_step is a {type(train_step).__name__}: define a function train_step(model, optimizer, ...)"
    inputs, targets, rng = *_judged_data(), case_generator()
    seed = rng.randrange(100, 10_000)
    first = rng.randrange(JUDGED_SAMPLES, 4 * JUDGED_SAMPLES)  # a step past the samples
    key = train.Trainer(_judged_model(seed), mesh, how, lr=lr, samples=(inputs, targets))
    key.steps_done = first
    model = train.wrap(_judged_model(seed), mesh, how)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    untrained = _judged_model(seed)
    given = []
    # On the module inside the wrapper: every forward reaches it, through DDP or around it.
    hook = getattr(model, "module", model).register_forward_pre_hook(lambda module, args: given.append(args[0]))
    expected, got = [], []
    try:
        for step in range(first, first + STEPS_JUDGED):
            expected.append(key.step())
            with _watching((train.Trainer, "step", "sl.train.Trainer.step"),
                           (train.Trainer, "batch", "sl.train.Trainer.batch"),
                           (train, "wrap", "sl.train.wrap"),
                           (data, "sample_index", "sl.data.sample_index")) as watch:
                got.append(train_step(model, optimizer, mesh, inputs, targets, step))
            if problem := _library_calls([e.name for e in watch.calls()], "is the answer key's own step"):
                return problem
    finally:
        hook.remove()
    if not given:
        return "the model was never called: the step must run model(x) on the scattered input"
    rows = -(-inputs.shape[2] // mesh["domain"].size())
    for x in given:
        if (type(x).__name__ != "ShardTensor" or tuple(x.placements) != (Shard(2),)
                or x.to_local().shape[2] > rows):
            return (f"the model was given a {type(x).__name__} of shape {tuple(x.shape)} on this rank: at every "
                    "call it gets this rank's rows of the sample, scattered over mesh['domain'] along the rows "
                    "(Shard(2)); a forward of the whole sample on every rank is not domain parallel")
    if len(given) != STEPS_JUDGED:
        return f"the model was called {len(given)} times in {STEPS_JUDGED} steps: one forward per step"
    if any(not isinstance(loss, float) for loss in got):
        kinds = sorted({type(loss).__name__ for loss in got})
        return f"train_step returned {', '.join(kinds)}: return the global loss as a Python float"
    stepped = [state.get("step") for state in optimizer.state.values()]
    if not stepped or any(int(s) != STEPS_JUDGED for s in stepped):
        return ("the optimizer it was given did not take one step per call: train with the optimizer passed in "
                "(the notebook checkpoints its state)")
    if _max_weight_difference(model, untrained) == 0.0:
        return "the weights never changed: after backward() the optimizer must take its step"
    for step, (g, e) in enumerate(zip(got, expected)):
        if abs(g - e) > 1e-6 * abs(e):
            return (f"at the {step + 1}. step judged it returned a loss {abs(g - e) / abs(e):.1e} (relative) away "
                    "from the reference loop's: the global mean loss of the step's own sample(s), taken from the "
                    "arguments, the same on every rank, computed from this step's own gradients only")
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
        return "the model state's keys are not the names of the model it was given"
    if any(hasattr(v, "to_local") for v in saved["model"].values()):
        return "the model state holds DTensor shards: gather the full tensors (full_state_dict=True)"
    if any(not torch.equal(saved["model"][k].cpu(), model_state[k].cpu()) for k in model_state):
        return "the saved weights are not the current weights of the model it was given"
    state = saved["optimizer"].get("state") if isinstance(saved["optimizer"], dict) else None
    if not state:
        return "the optimizer state is empty: Adam's moments would restart from zero"
    if any(hasattr(v, "to_local") for moments in state.values() if isinstance(moments, dict) for v in moments.values()):
        return "the optimizer state holds DTensor shards: gather the full tensors (full_state_dict=True)"
    if set(state) != set(optimizer_state["state"]):
        return ("the optimizer state is keyed by parameter numbers, not names (optimizer.state_dict()): use "
                "get_optimizer_state_dict(model, optimizer, ...), which any wrapper can load")
    for name, moments in optimizer_state["state"].items():
        for k, v in moments.items():
            if not torch.equal(torch.as_tensor(state[name][k]).cpu(), torch.as_tensor(v).cpu()):
                return f"the optimizer's {k!r} for {name} is not the current one of the optimizer it was given"
    return None


def _file_verdict(path: Path, model_state: dict, optimizer_state: dict, step: int) -> str | None:
    """Rank 0: ``_compare_checkpoint``, with a file that cannot be read back said as such (every rank waits for it)."""
    try:
        return _compare_checkpoint(path, model_state, optimizer_state, step)
    except Exception as error:
        return f"the file cannot be read back with torch.load ({type(error).__name__}: {error})"


@second_hint(
    "model.state_dict() and optimizer.state_dict() are the wrapper's ('module.' names, parameters by number, "
    "FSDP2's shards). On every rank: options = StateDictOptions(full_state_dict=True, cpu_offload=True), "
    "get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options); "
    'then only if dist.get_rank() == 0, torch.save({"model": ..., "optimizer": ..., "step": step}, path); then '
    "dist.barrier() on every rank."
)
def checkpoint_is_complete(save_checkpoint, mesh, how, lr):
    """Exercise 2: ``save_checkpoint(model, optimizer, step, path)`` leaves one file with the full model and optimizer
    state (parameter names as keys, no wrapper prefix, no shards) and the step. It is judged under both wrappers, the
    notebook's first, each time on a model the judge trained itself, at a step of its own: every rank must gather (a
    collective under FSDP2) and only rank 0 write (with ``cpu_offload=True`` the other ranks receive ``{}``), without
    ``sl.train``'s own checkpoint code; and the file, loaded under the other wrapper, must train on as the model it
    was saved from did."""
    if not callable(save_checkpoint):
        return f"save_checkpoint is a {type(save_checkpoint).__name__}: define a function save_checkpoint(...)"
    for saved_under in sorted(CHECKPOINTED_UNDER, key=lambda wrapper: wrapper != how):
        if problem := _checkpoint_under(save_checkpoint, mesh, saved_under, lr):
            return f"saved from a model under {saved_under.upper()}: {problem}"
    return None


def _checkpoint_under(save_checkpoint, mesh, how, lr):
    import torch.distributed.checkpoint.state_dict as state_dicts
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    rng = case_generator()
    seed, step = rng.randrange(100, 10_000), rng.randrange(1000, 10_000)
    trainer = train.Trainer(_judged_model(seed), mesh, how, lr=lr, samples=_judged_data())
    trainer.step()
    model, optimizer = trainer.model, trainer.optimizer
    folder, path = _shared_temporary_path()
    try:
        with _watching((train, "save_checkpoint", "sl.train.save_checkpoint"),
                       (train.Trainer, "full_state", "sl.train.Trainer.full_state"),
                       (state_dicts, "get_model_state_dict", "gathered the model"),
                       (state_dicts, "get_optimizer_state_dict", "gathered the optimizer"),
                       (torch, "save", "wrote")) as watch:
            save_checkpoint(model, optimizer, step, str(path))
        calls = [e.name for e in watch.calls()]
        dist.barrier()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the full states reach rank 0 only
        model_state = state_dicts.get_model_state_dict(model, options=options)
        optimizer_state = state_dicts.get_optimizer_state_dict(model, optimizer, options=options)
        verdict = [_file_verdict(path, model_state, optimizer_state, step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(verdict, src=0)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(set(calls)))
        resumed = None if verdict[0] else _resumed_elsewhere(path, trainer, step, seed, lr)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    if problem := _library_calls([c for c in calls if c.startswith("sl.")], "is sl.train's own checkpoint"):
        return problem
    writers = [rank for rank, seen in enumerate(everyone) if rank and "wrote" in seen]
    if writers:
        return (f"rank(s) {writers} wrote the file too: with cpu_offload=True only rank 0 receives the full state "
                "(the others get {}), so rank 0 alone writes")
    if verdict[0]:
        return verdict[0]
    idle = [rank for rank, seen in enumerate(everyone)
            if not {"gathered the model", "gathered the optimizer"} <= set(seen)]
    if idle:
        return (f"rank(s) {idle} did not gather both states: gathering is a collective (FSDP2 all-gathers the "
                "shards), so every rank calls get_model_state_dict and get_optimizer_state_dict")
    return resumed


def _resumed_elsewhere(path: Path, trainer, step: int, seed: int, lr: float) -> str | None:
    """Every rank: the file loaded into a model of other weights under the other wrapper (rank 0 reads it, then
    ``broadcast_from_rank0``, as section 6 resumes) must take the next steps at the losses of the model it was saved
    from: a checkpoint is layout-free, and holds all the state that training reads."""
    elsewhere = next(wrapper for wrapper in CHECKPOINTED_UNDER if wrapper != trainer.how)
    fresh = train.Trainer(_judged_model(seed + 1), trainer.mesh, elsewhere, lr=lr, samples=_judged_data())
    saved = torch.load(path, weights_only=False, map_location="cpu") if dist.get_rank() == 0 else {}  # CPU-only
    fresh.load_full_state({"model": saved.get("model"), "optimizer": saved.get("optimizer"), "steps_done": step,
                           "losses": []})
    trainer.steps_done = step
    for n in range(STEPS_JUDGED):
        expected, got = trainer.step(), fresh.step()
        if abs(got - expected) > 1e-9 * abs(expected):
            return (f"loaded under {elsewhere.upper()} (rank 0 reads it; broadcast_from_rank0), the {n + 1}. step "
                    f"after it trains to a loss {abs(got - expected) / abs(expected):.1e} (relative) away from the "
                    "saved model's: the file must hold all the state training reads, Adam's moments and step "
                    "counts included")
    return None


_OTHER_MESHES: dict = {}


def _mesh_of_another_shape(mesh):
    """A (ddp, domain) mesh of the same ranks in another shape than ``mesh``'s: every rank its own replica
    (domain 1), or, when that is ``mesh``'s shape, one domain group of all ranks. Made once per process (every
    rank creates it together), then reused."""
    world = dist.get_world_size()
    shape = (1, world) if mesh["domain"].size() == 1 else (world, 1)
    if shape not in _OTHER_MESHES:
        _OTHER_MESHES[shape] = init_device_mesh(mesh.device_type, shape, mesh_dim_names=MESH_AXES)
    return _OTHER_MESHES[shape]


@second_hint(
    "Each rank computes its own group's sample from the mesh it is given: (step × mesh[\"ddp\"].size() + "
    "mesh.get_coordinate()[0]) % n_samples; dist.all_gather_object(everyone, mine) with everyone = [None] × "
    "dist.get_world_size(). The ranks of a domain group report the same sample: return sorted(set(everyone))."
)
def samples_of_step(samples_in_step, mesh):
    """Exercise 3: ``samples_in_step(step, mesh, n_samples)`` returns, on every rank, the sorted list of the samples
    whose gradients went into optimizer step ``step``, gathered from what each rank trained on. The judge asks for
    steps the notebook never ran, with a number of samples of its own, on its mesh and on a mesh of another
    shape; each call must gather from the ranks, and not call ``sl.data.sample_index``, the rule it rebuilds."""
    if not callable(samples_in_step):
        return (f"samples_in_step is a {type(samples_in_step).__name__}: define a function "
                "samples_in_step(step, mesh, n_samples)")
    rng = case_generator()
    n_samples = rng.randrange(9, 60)
    steps = rng.sample(range(1, 3 * n_samples), 2)
    for judged_mesh in (mesh, _mesh_of_another_shape(mesh)):
        ddp = judged_mesh["ddp"].size()
        for step in steps:
            with _watching((data, "sample_index", "sl.data.sample_index"),
                           (dist, "all_gather_object", "gathered"), (dist, "all_gather", "gathered (tensors)"),
                           (dist, "all_gather_single", "gathered (one tensor)"),
                           (dist, "all_gather_into_tensor", "gathered (one tensor)")) as watch:
                used = samples_in_step(step, judged_mesh, n_samples)
            calls = [e.name.split(" (")[0] for e in watch.calls()]
            if problem := _library_calls([c for c in calls if c.startswith("sl.")], "is the rule itself"):
                return problem
            if "gathered" not in calls:
                return ("it computed the list without asking the other ranks: gather what each rank trained on "
                        "(dist.all_gather_object)")
            right = sorted({(step * ddp + replica) % n_samples for replica in range(ddp)})
            where = f"at step {step} of {n_samples} samples on a mesh of shape {tuple(judged_mesh.mesh.shape)}"
            if not isinstance(used, (list, tuple)) or not all(isinstance(i, int) for i in used):
                return f"{where} it returned {used!r}: return a list of sample indices (ints)"
            if list(used) == right:
                continue
            if sorted(set(used)) == right:
                return (f"{where} it lists {len(used)} entries for {len(set(used))} samples: the ranks of a domain "
                        "group share one sample, so count each sample once, sorted")
            return (f"{where} these are not the samples that step trained on: each ddp replica trains on sample "
                    "(step × ddp + replica) mod n_samples, read from the mesh it was given")
    return None
