"""Domain-parallel training of the model in model.py, as run.json describes it (written by shardlab.port).

    torchrun --nproc-per-node 8 train.py                      # the layout run.json chose
    torchrun --nproc-per-node 4 train.py --domain 2 --resume  # another layout, from the last checkpoint

Every rank runs this file. Ranks form a (ddp, domain) mesh: each domain group holds one sample, split along the
dims run.json names; the global batch is spread over the ddp replicas. The lesson each part comes from is named
where it starts. Imports torch and PhysicsNeMo only.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from model import build_model  # model.py, next to this file: written by the port for this model
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import ShardTensor, scatter_tensor, sync_module_over_mesh
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

CONFIG = json.loads((Path(__file__).resolve().parent / "run.json").read_text())


# -- ranks and the mesh (lessons 01 and 02) ---------------------------------------------------------------------------

def start(timeout_s: float = 600.0, domain: int | None = None):
    """DistributedManager from whichever launcher started this rank (torchrun, mpirun, mpiexec, srun), and the named
    (ddp, domain) mesh: ddp = world size / domain."""
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        # On CPU ranks (gloo) PhysicsNeMo 2.2.2 passes device_id=cpu, which torch refuses, and no timeout
        # (physicsnemo/distributed/manager.py:590-595; upstream issue 1936): drop the first, bound every collective.
        if getattr(kwargs.get("device_id"), "type", None) == "cpu":
            del kwargs["device_id"]
        kwargs.setdefault("timeout", timedelta(seconds=timeout_s))
        return original(*args, **kwargs)

    mpich = "PMI_RANK" in os.environ and not {"RANK", "SLURM_PROCID"} & set(os.environ)
    if mpich and not DistributedManager.is_initialized():
        # MPICH's mpiexec (hydra) says PMI_RANK, PMI_SIZE and MPI_LOCALRANKID; PhysicsNeMo 2.2.2 reads torchrun's,
        # Slurm's and OpenMPI's variables only (physicsnemo/distributed/manager.py:406-418): its ENV method, given
        # them under torchrun's names, with rank 0's address from -genv MASTER_ADDR (README).
        os.environ.update(RANK=os.environ["PMI_RANK"], WORLD_SIZE=os.environ["PMI_SIZE"],
                          LOCAL_RANK=os.environ.get("MPI_LOCALRANKID", "0"),
                          PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD="ENV")
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group = init_process_group
    try:
        DistributedManager.initialize()
    finally:
        dist.init_process_group = original
    if not torch.cuda.is_available():
        # ShardTensor's op handlers register themselves at import only when CUDA is there
        # (physicsnemo/domain_parallel/__init__.py:76-77): CPU ranks register them here.
        from physicsnemo.domain_parallel import register_custom_ops

        register_custom_ops()
    manager = DistributedManager()
    domain = domain or CONFIG["domain"]
    if manager.world_size % domain:
        raise SystemExit(f"{manager.world_size} ranks do not split into domain groups of {domain}: launch a multiple "
                         f"of {domain} ranks, or pass --domain with a divisor of {manager.world_size}.")
    return manager.initialize_mesh((manager.world_size // domain, domain), ("ddp", "domain"))


def ddp_rank(mesh) -> int:
    return mesh.get_coordinate()[0]


# -- the model, synced then wrapped (lesson 05; spatial parameters: lesson 13) ----------------------------------------

def new_model(size: int, dtype, device):
    """The model under the run's seed: the same weights on every rank (and in the parity test's reference)."""
    torch.manual_seed(CONFIG["seed"])
    return build_model(size).to(device=device, dtype=dtype)


def wrap(model, mesh):
    """Sync over domain before wrapping, then DDP for plain parameters, or spatial parameters split on domain and
    FSDP2 on ddp. Returns what to call; ``model`` itself stays the inner module (its parameters' names)."""
    if mesh["domain"].size() > 1:
        sync_module_over_mesh(model, mesh["domain"])  # DDP broadcasts over ddp only; FSDP2 broadcasts nothing
    if CONFIG["wrapper"] == "ddp":
        # find_unused_parameters: a model may leave some parameters out of a step; set False when none are.
        return DistributedDataParallel(model, process_group=mesh["ddp"].get_group(), find_unused_parameters=True)
    if mesh["ddp"].size() > 1:
        sync_module_over_mesh(model, mesh["ddp"])  # fully_shard keeps each rank's own initial weights
    for qualified, dim in CONFIG["spatial"].items():  # a table that follows the field: each rank holds its rows
        owner, _, name = qualified.rpartition(".")
        module = model.get_submodule(owner)
        tensor = getattr(module, name)
        split = distribute_tensor(tensor.detach(), mesh["domain"], [Shard(dim)])
        if isinstance(tensor, torch.nn.Parameter):
            module.register_parameter(name, torch.nn.Parameter(split, tensor.requires_grad))
        else:
            module.register_buffer(name, split, persistent=name not in module._non_persistent_buffers_set)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.contiguous()  # fully_shard refuses non-contiguous parameters
    fully_shard(model, mesh=mesh["ddp"])
    return model


# -- data: one sample per domain group (lessons 03 and 12) -------------------------------------------------------------

def at(dim, size: int) -> int:
    """A dim of run.json's shapes at ``size``: "N" is the size, "2N" twice it (a model that upsamples), a number is
    itself."""
    return int(dim[:-1] or 1) * size if isinstance(dim, str) else dim


def shapes(size: int) -> dict[str, tuple[int, ...]]:
    """Each input's and the target's shape for one sample at ``size`` (N in run.json)."""
    items = {**CONFIG["inputs"], "target": CONFIG["target"]}
    return {name: tuple(at(d, size) for d in item["shape"]) for name, item in items.items()}


class SyntheticSamples(Dataset):
    """Random samples of the right shapes, each a function of its index alone: a stand-in for your data (any
    Dataset whose items are {input name: tensor, "target": tensor} of one sample, batch dim 1, will do)."""

    def __init__(self, size: int, count: int, dtype):
        self.size, self.shapes, self.count, self.dtype = size, shapes(size), count, dtype

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(CONFIG["seed"] * 1_000_003 + i)
        return {name: torch.randn(shape, generator=generator).to(self.dtype) for name, shape in self.shapes.items()}


def write_zarr(path, dataset) -> None:
    """The samples as a zarr store: one array per input and the target, (samples, *one sample's shape[1:])."""
    import zarr

    group = zarr.open_group(str(path), mode="w-")
    for name, shape in dataset.shapes.items():
        chunks = (1, *(min(s, 256) for s in shape[1:]))
        array = group.create_array(name, shape=(len(dataset), *shape[1:]), chunks=chunks, dtype="float64")
        for i in range(len(dataset)):
            array[i] = dataset[i][name][0].double().numpy()


def rows_of(extent: int, n: int, index: int) -> tuple[int, int]:
    """The rows ``torch.chunk`` gives rank ``index`` of ``n``: scatter_tensor's split, and ours when reading slabs."""
    step = -(-extent // n)
    return min(index * step, extent), min((index + 1) * step, extent)


def split_of(name: str, dim: int, size: int, n: int) -> list[tuple[int, int]]:
    """The rows of ``name`` along ``dim`` that each of ``n`` domain ranks holds: torch.chunk's split of the size, and
    k times it along a dim of k·N, so that an upsampled target is split as the model's output is (each rank's output
    rows are k times its input rows, which torch.chunk of the k·N rows is not when the split is uneven)."""
    dim_of = {**CONFIG["inputs"], "target": CONFIG["target"]}[name]["shape"][dim]
    k = at(dim_of, 1)
    return [(k * a, k * b) for a, b in (rows_of(size, n, r) for r in range(n))]


def load(i: int, name: str, mesh, dataset, store, placement, device, dtype, sample=None):
    """Sample ``i``'s tensor ``name`` on this rank: with a store, only this rank's rows, read and wrapped with
    ShardTensor.from_local (no communication, no whole field anywhere: lesson 12); else the domain group's first
    rank holds the whole sample and scatter_tensor sends each rank its rows (lesson 03)."""
    domain = mesh["domain"]
    whole = (1, *store[name].shape[1:]) if store is not None else shapes(dataset.size)[name]
    split = isinstance(placement, Shard) and domain.size() > 1
    if split:
        bounds = split_of(name, placement.dim, dataset.size, domain.size())
        sizes = [tuple(b - a if d == placement.dim else s for d, s in enumerate(whole)) for a, b in bounds]
        rows = slice(*bounds[domain.get_local_rank()])
    if store is not None:
        index = [i] + [slice(None)] * (len(whole) - 1)
        if split:
            index[placement.dim] = rows
            local = torch.from_numpy(store[name][tuple(index)][None]).to(device=device, dtype=dtype)
            return ShardTensor.from_local(local, domain, [placement], sharding_shapes={0: sizes})
        local = torch.from_numpy(store[name][tuple(index)][None]).to(device=device, dtype=dtype)
        return local if domain.size() == 1 else ShardTensor.from_local(local, domain, [Replicate()],
                                                                        sharding_shapes="chunk", global_shape=whole)
    source = dist.get_global_rank(domain.get_group(), 0)
    tensor = sample[name].to(device) if sample is not None else None
    if domain.size() == 1:
        return tensor
    if split and bounds != [rows_of(whole[placement.dim], domain.size(), r) for r in range(domain.size())]:
        # k·N rows: not torch.chunk's split, which scatter_tensor makes. By hand, as scatter_tensor does it: the
        # first rank's sample to the group, each rank keeps its rows.
        if tensor is None:
            tensor = torch.empty(whole, device=device, dtype=dtype)
        dist.broadcast(tensor, src=source, group=domain.get_group())
        local = tensor.narrow(placement.dim, rows.start, rows.stop - rows.start).contiguous()
        return ShardTensor.from_local(local, domain, [placement], sharding_shapes={0: sizes})
    return scatter_tensor(tensor, source, domain, (placement,), global_shape=torch.Size(whole), dtype=dtype)


def placement_of(item) -> Shard | Replicate:
    return Replicate() if item["shard"] is None else Shard(item["shard"])


def batch(i: int, mesh, data, device, dtype) -> tuple[dict, object]:
    """(the inputs, the target) of sample ``i``, split over this rank's domain group."""
    dataset, store = data
    first = dist.get_global_rank(mesh["domain"].get_group(), 0) == dist.get_rank()
    sample = dataset[i] if store is None and (first or mesh["domain"].size() == 1) else None
    inputs = {name: load(i, name, mesh, dataset, store, placement_of(item), device, dtype, sample)
              for name, item in CONFIG["inputs"].items()}
    target = load(i, "target", mesh, dataset, store, placement_of(CONFIG["target"]), device, dtype, sample)
    return inputs, target


def call(model, inputs):
    return model(inputs) if CONFIG["one_dict"] else model(**inputs)


def mse(out, target):
    # sum / numel, not .mean(): PhysicsNeMo 2.2.2's sharded mean scales its gradient by a float32 1/numel
    # (physicsnemo/domain_parallel/custom_ops/_reductions.py:705), off by float32's rounding in float64.
    if isinstance(out, ShardTensor) and isinstance(target, ShardTensor):
        out_shapes, target_shapes = out._spec.sharding_shapes(), target._spec.sharding_shapes()
        if out.placements != target.placements or out_shapes != target_shapes:
            raise SystemExit(f"the output is split as {out.placements} {out_shapes}, the target as "
                             f"{target.placements} {target_shapes}: set run.json's target shard to the output's.")
    return ((out - target) ** 2).sum() / out.numel()


def value(loss) -> torch.Tensor:
    return (loss.full_tensor() if isinstance(loss, ShardTensor) else loss).detach().reshape(1).clone()


# -- the global batch over ddp: a DistributedSampler over the ddp replicas (lesson 12) ---------------------------------

def samples_of_step(step: int, sampler: DistributedSampler, global_batch: int, count: int) -> list[int]:
    """This replica's samples of global step ``step``: positions [step·B, (step+1)·B) of the epoch's shuffle, whatever
    the ddp size (replica r takes every ddp-th position from r), so another layout trains on the same samples."""
    per_replica = global_batch // sampler.num_replicas
    epoch, k = divmod(step, count // global_batch)
    sampler.set_epoch(epoch)
    return list(sampler)[k * per_replica:(k + 1) * per_replica]


# -- checkpoints that load into another layout (lessons 07 and 12) -----------------------------------------------------

def save(folder: Path, step: int, model, optimizer, mesh, global_batch: int, losses: list) -> None:
    """Model and optimizer as each rank holds them (DCP: one writer per piece), then the step, the sampler's
    position and each ddp replica's random state; renamed into place last, so a crash leaves no half checkpoint."""
    final = folder / f"step-{step:06d}"
    writing = final.with_name(final.name + ".writing")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(writing))
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, (ddp_rank(mesh), mesh["domain"].get_local_rank(), torch.get_rng_state()))
    if dist.get_rank() == 0:
        rng = {replica: state for replica, local, state in states if local == 0}
        torch.save({"step": step, "samples_seen": step * global_batch, "global_batch": global_batch,
                    "rng": [rng[r] for r in sorted(rng)], "losses": losses}, writing / "trainer.pt")
        os.replace(writing, final)
    dist.barrier()


def last_checkpoint(folder: Path) -> Path | None:
    done = sorted(p for p in folder.glob("step-*") if p.is_dir() and (p / "trainer.pt").is_file())
    return done[-1] if done else None


def restore(path: Path, model, optimizer, mesh, global_batch: int) -> tuple[int, list]:
    """The run at ``path``, into this layout: DCP reads the pieces this rank's shards need."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if trainer["global_batch"] != global_batch:
        raise SystemExit(f"{path} was trained with a global batch of {trainer['global_batch']}, not {global_batch}: "
                         f"pass --global-batch {trainer['global_batch']} to continue the same run.")
    torch.set_rng_state(trainer["rng"][ddp_rank(mesh) % len(trainer["rng"])])
    return trainer["samples_seen"] // global_batch, list(trainer["losses"])


# -- the run -----------------------------------------------------------------------------------------------------------

def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=CONFIG["size"], help="N: the points or rows of a sample")
    parser.add_argument("--domain", type=int, default=CONFIG["domain"], help="ranks per domain group")
    parser.add_argument("--steps", type=int, default=CONFIG["steps"])
    parser.add_argument("--global-batch", type=int, default=CONFIG["global_batch"], help="samples per step")
    parser.add_argument("--samples", type=int, default=CONFIG["samples"], help="synthetic samples (no --zarr)")
    parser.add_argument("--zarr", default=CONFIG["zarr"], help="read each rank's rows from this store")
    parser.add_argument("--write-zarr", help="write the synthetic samples to this new store, then stop")
    parser.add_argument("--dtype", default=CONFIG["dtype"], choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--lr", type=float, default=CONFIG["lr"])
    parser.add_argument("--checkpoints", default="checkpoints", help="folder of the checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoints")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.write_zarr:
        write_zarr(args.write_zarr, SyntheticSamples(args.size, args.samples, dtype))
        return []
    ours = not DistributedManager.is_initialized()  # a process that already was a rank keeps its process group
    mesh = start(args.timeout_s, args.domain)
    device = DistributedManager().device
    ddp = mesh["ddp"].size()
    if args.global_batch % ddp:
        raise SystemExit(f"a global batch of {args.global_batch} does not split over {ddp} ddp replicas: launch "
                         f"a divisor of it as ddp, or pass --global-batch with a multiple of {ddp}.")
    store = None
    if args.zarr:
        import zarr

        store = zarr.open_group(args.zarr, mode="r")
    dataset = SyntheticSamples(args.size, args.samples, dtype)
    count = store[next(iter(CONFIG["inputs"]))].shape[0] if store is not None else len(dataset)
    sampler = DistributedSampler(range(count), num_replicas=ddp, rank=ddp_rank(mesh), shuffle=True,
                                 seed=CONFIG["seed"], drop_last=True)
    model = new_model(args.size, dtype, device)
    wrapped = wrap(model, mesh)
    optimizer = torch.optim.Adam(wrapped.parameters(), lr=args.lr)
    torch.manual_seed(CONFIG["seed"] + 1 + ddp_rank(mesh))  # each replica its own stream; a domain group one
    folder = Path(args.checkpoints)
    first, losses = 0, []
    if args.resume and (path := last_checkpoint(folder)) is not None:
        first, losses = restore(path, wrapped, optimizer, mesh, args.global_batch)
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {first}, on ddp {ddp} x domain {mesh['domain'].size()}", flush=True)
    for step in range(first, args.steps):
        optimizer.zero_grad()
        total = torch.zeros(1, dtype=torch.float64, device=device)
        mine = samples_of_step(step, sampler, args.global_batch, count)
        for i in mine:  # a replica with several samples accumulates them: the global batch stays the same
            inputs, target = batch(i, mesh, (dataset, store), device, dtype)
            loss = mse(call(wrapped, inputs), target) / len(mine)
            loss.backward()  # DDP and FSDP2 average over ddp: with the 1/len(mine), the mean of the global batch
            total += value(loss).double()
        optimizer.step()
        dist.all_reduce(total, group=mesh["ddp"].get_group())
        losses.append(total.item() / ddp)
        if dist.get_rank() == 0:
            print(f"step {step + 1} loss {losses[-1]!r}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save(folder, step + 1, wrapped, optimizer, mesh, args.global_batch, losses)
    if ours:
        DistributedManager.cleanup(barrier=True)
    return losses


if __name__ == "__main__":
    main()
