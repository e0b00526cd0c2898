"""Slab loading on real ranks (2 and 4, one job each): ``sl.data.read_slab`` builds what ``scatter_tensor`` builds,
values, placements and ``sharding_shapes``, with no communication at all; a leaf built from a slab gets the gradients
a scattered one gets; a Trainer handed a ``SlabSource`` trains to the same losses as one handed a ``ScatterSource``."""

import pytest

from shardlab import data
from shardlab.ranks.launch import run_job

ON_RANKS = r'''
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.debug import CommDebugMode

import shardlab as sl
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import scatter_tensor, sync_module_over_mesh

sl.init_distributed(120)
world, rank, device = dist.get_world_size(), dist.get_rank(), DistributedManager().device
folder = Path(sys.argv[1])
WIDTH = 16
HEIGHTS = {"even": 8 * world, "uneven": 8 * world - 1, "runs out": 9}  # 9 rows over 4 ranks: 3, 3, 3, 0
STORES = {name: folder / f"{name.replace(' ', '_')}-{height}.zarr" for name, height in HEIGHTS.items()}

P2P_AND_COLLECTIVES = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "all_reduce", "reduce",
                       "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "scatter",
                       "gather", "all_to_all", "all_to_all_single", "barrier", "broadcast_object_list",
                       "all_gather_object", "gather_object", "scatter_object_list")


class CallCounter:
    """Counts calls to torch.distributed's point-to-point and collective functions, wherever they are looked up."""

    def __enter__(self):
        self.calls, self.saved = [], []
        for module in (dist, dist.distributed_c10d):
            for name in P2P_AND_COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    self.saved.append((module, name, original))
                    setattr(module, name, self.counting(name, original))
        return self

    def counting(self, name, original):
        def call(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for module, name, original in self.saved:
            setattr(module, name, original)


def counted(build):
    """build()'s result and every way of counting communication while it ran."""
    with CommDebugMode() as debug, sl.measure.collective_bytes() as ops, CallCounter() as calls:
        result = build()
    return result, {"comm_debug": debug.get_total_counts(), "dispatched": sum(o["calls"] for o in ops.ops.values()),
                    "calls": len(calls.calls)}


def local_of(t):
    return t.to_local().detach().cpu()


results = {"cases": {}, "rank": rank}
meshes = {"domain": sl.build_mesh(ddp=1, domain=world)}
for name, height in HEIGHTS.items():
    for dim in (2, 3) if name == "uneven" else (2,):
        store = sl.data.open_store(STORES[name])
        full = store.field("permeability")[1:2]  # the whole sample, as a scatter source holds it
        full = torch.from_numpy(full).to(device) if rank == 0 else None
        slab, slab_counts = counted(lambda: sl.data.read_slab(store, 1, meshes["domain"], dim=dim,
                                                              expect_shape=(1, 1, height, WIDTH),
                                                              expect_dtype=torch.float32))
        x, extent = slab.tensor, (height, WIDTH)[dim - 2]
        bounds = sl.mesh.shard_bounds(extent, world)
        planned = {0: tuple(tuple(b - a if d == dim else n for d, n in enumerate((1, 1, height, WIDTH)))
                            for _, a, b in bounds)}
        case = {"rows": list(slab.rows), "planned rows": list(bounds[rank][1:]), "bytes_read": slab.bytes_read,
                "slab": slab_counts, "sharding_shapes as planned": x._spec.sharding_shapes() == planned}
        try:
            scattered, case["scatter"], error = *counted(lambda: scatter_tensor(
                full, 0, meshes["domain"]["domain"], (Shard(dim),), global_shape=(1, 1, height, WIDTH),
                dtype=torch.float32)), None
        except IndexError as failed:  # upstream: when torch.chunk runs out of rows, scatter_tensor fails on a rank
            error = repr(failed)
        errors = [None] * world
        dist.all_gather_object(errors, error)  # so that no rank goes on to a collective the others skip
        if any(errors):
            case["scatter failed"] = [e for e in errors if e][0]
        else:
            case |= {"same values": torch.equal(local_of(x), local_of(scattered)),
                     "placements": [str(x.placements), str(scattered.placements)],
                     "sharding_shapes": [repr(x._spec.sharding_shapes()), repr(scattered._spec.sharding_shapes())],
                     "global shape": [list(x.shape), list(scattered.shape)]}
        if name == "even" and dim == 2:  # gradients reach a leaf built from a slab, as one built by scatter_tensor
            conv = torch.nn.Conv2d(1, 2, 3, padding=1).to(device)
            sync_module_over_mesh(conv, meshes["domain"]["domain"])
            leaves = [sl.data.read_slab(store, 1, meshes["domain"], requires_grad=True).tensor,
                      scatter_tensor(full, 0, meshes["domain"]["domain"], (Shard(2),), requires_grad=True)]
            for leaf in leaves:
                conv(leaf).square().sum().backward()
            case["leaf"] = leaves[0].is_leaf
            case["grad same as scatter's"] = leaves[0].grad is not None and torch.equal(
                local_of(leaves[0].grad), local_of(leaves[1].grad))
            case["grad nonzero"] = bool(local_of(leaves[0].grad).abs().sum() > 0)
        results["cases"][f"{name} dim {dim}"] = case

ddp = 2 if world >= 4 else 1
meshes["trainer"] = sl.build_mesh(ddp=ddp, domain=world // ddp)
losses = {}
sources = {"scatter": sl.data.ScatterSource(), "slab": sl.data.SlabSource(folder / "darcy.zarr")}
for loading, source in sources.items():
    trainer = sl.train.Trainer(sl.models.conv_stack(width=4, layers=2, seed=0).to(device), meshes["trainer"], "ddp",
                               source=source)
    losses[loading] = [trainer.step() for _ in range(3)]
    if loading == "slab":
        _, results["trainer batch"] = counted(lambda: trainer.batch(0))
results["losses"] = losses

rows = [None] * world
dist.all_gather_object(rows, results)
if rank == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
'''


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Fields 16 wide in chunks of 4 rows, of the heights the ranks read, and the Darcy samples."""
    folder = tmp_path_factory.mktemp("stores")
    for world in (2, 4):
        for name, height in heights(world).items():
            data.write_field_store(folder / f"{name.replace(' ', '_')}-{height}.zarr", samples=3, height=height,
                                   width=16, chunk_rows=4, seed=7)
    data.write_darcy_store(folder / "darcy.zarr")
    return folder


def heights(world):
    return {"even": 8 * world, "uneven": 8 * world - 1, "runs out": 9}  # 9 rows over 4 ranks: 3, 3, 3, 0


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_slabs_are_scatter_tensor_without_communication(world, stores, tmp_path, no_leftovers):
    script = tmp_path / "slabs.py"
    script.write_text(ON_RANKS)
    rows = run_job("torchrun", world, script, [str(stores)], timeout_s=240, device="cpu").result
    height_of = heights(world)
    for rank, seen in enumerate(rows):
        for name, case in seen["cases"].items():
            where = f"rank {rank}, {name}"
            assert case["rows"] == case["planned rows"] and case["sharding_shapes as planned"], where
            assert case["slab"] == {"comm_debug": 0, "dispatched": 0, "calls": 0}, where
            if "scatter failed" in case:  # physicsnemo's _select_slice_from_replicate indexes torch.chunk's pieces
                assert world == 4 and name.startswith("runs out"), f"{where}: {case['scatter failed']}"
                continue
            assert case["same values"], where
            assert case["placements"][0] == case["placements"][1], where
            assert case["sharding_shapes"][0] == case["sharding_shapes"][1], where
            assert case["global shape"][0] == case["global shape"][1], where
            assert min(case["scatter"].values()) >= 1, f"{where}: the counters saw nothing of scatter_tensor"
            start, stop = case["rows"]
            if name.endswith("dim 2"):  # whole chunks of 4 rows × 16 columns × 4 bytes, and only those
                chunks = len(range(start // 4, -(-stop // 4))) if stop > start else 0
                assert case["bytes_read"] == chunks * 4 * 16 * 4, where
            else:  # columns cut across every chunk of the sample
                padded = -(-height_of[name.split(" dim")[0]] // 4) * 4  # the last chunk is stored whole
                assert case["bytes_read"] == padded * 16 * 4, where
        gradients = seen["cases"]["even dim 2"]
        assert gradients["leaf"] and gradients["grad same as scatter's"] and gradients["grad nonzero"], rank
        assert seen["trainer batch"] == {"comm_debug": 0, "dispatched": 0, "calls": 0}, rank
        assert seen["losses"]["slab"] == seen["losses"]["scatter"], rank
    expected = {2: [[0, 5], [5, 9]], 4: [[0, 3], [3, 6], [6, 9], [9, 9]]}[world]  # 9 rows: the last rank gets none
    assert [seen["cases"]["runs out dim 2"]["rows"] for seen in rows] == expected
