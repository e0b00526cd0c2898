"""Measure layer: saved-activation bytes are exact, and the activation-memory script's ratios
follow 1/N + halo on real ranks (bytes are deterministic; no timing is asserted)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from shardlab import measure
from shardlab.models import conv_stack
from shardlab.ranks.launch import run_job
from world_sizes import MEASURE


def test_saved_activations_counts_unique_tensors_and_skips_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with measure.SavedActivations(exclude=lin.parameters()) as saved:
        torch.relu(lin(x))
    # Linear saves its input (4x8); relu saves its output (4x8); the weight is excluded.
    assert saved.tensors == 2 and saved.bytes == 2 * 4 * 8 * 4


def test_saved_activations_excludes_what_it_is_told_to_even_after_entering():
    lin, other = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with measure.SavedActivations() as saved:
        saved.exclude([x])  # e.g. from a forward pre-hook, for parameters FSDP2 has just gathered
        torch.relu(other(lin(x)))
    # lin saves only x (x needs no gradient, so lin's weight is not needed): excluded. other saves its input and
    # its weight (no parameter was excluded here), relu its output.
    assert saved.counted == [((4, 8), 128), ((8, 8), 256), ((4, 8), 128)]
    assert saved.bytes == 512 and saved.tensors == 3


def test_saved_activations_of_conv_stack_scale_with_the_field():
    model = conv_stack(width=4, layers=2)
    sizes = {}
    for h in (16, 32):
        with measure.SavedActivations(exclude=model.parameters()) as saved:
            model(torch.randn(1, 1, h, 16))
        sizes[h] = saved.bytes
    assert sizes[32] == 2 * sizes[16]


@pytest.mark.parametrize("n, expected", [(1, 1.0), (2, 0.5 + 2 / 64), (4, 0.25 + 2 / 64)])
def test_ideal_ratio_is_one_over_n_plus_halo(n, expected):
    assert measure.ideal_activation_ratio(n, height=64, kernel_size=3) == pytest.approx(expected)


@pytest.mark.multirank
def test_measurement_script_on_four_ranks_one_job_for_three_tables(tmp_path, no_leftovers):
    """Activation bytes follow 1/N + halo; FSDP2's state bytes follow 1/ddp; slab loading holds 1/N of the fields
    where scatter_tensor holds them whole (bytes are exact: no timing asserted)."""
    out = tmp_path / "tables.json"
    placed = MEASURE.ranks().or_skip()  # CPU ranks on any machine: the CLI places its own, so it sees no GPU
    env = os.environ | placed.env | {"TMPDIR": str(tmp_path)}  # where the store is written: this test's own folder
    proc = subprocess.run([sys.executable, "-m", "shardlab.measure", "activation-memory", "state-memory",
                           "loading-memory", "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ratio/ideal") == 2  # the table headers other runs are compared against
    loading = {(r["N"], r["loading"]): r for r in json.loads(out.read_text())["loading-memory"]["rows"]}
    for n in (2, 4):  # exact: storage held; the 1-channel scattered shard keeps the whole broadcast fields
        assert loading[(n, "slab")]["held/(fields/N)"] == 1.0 and loading[(n, "scatter_tensor")]["held/(fields/N)"] == n
        if loading[(n, "slab")]["host_peak_max_rank"] is not None:  # Linux: the kernel's counters
            assert loading[(n, "slab")]["host_peak_max_rank"] < loading[(n, "scatter_tensor")]["host_peak_max_rank"]
            assert loading[(n, "slab")]["file_bytes_max_rank"] < loading[(n, "scatter_tensor")]["file_bytes_max_rank"]
    tables = json.loads(out.read_text())
    assert {table["device"].split(":")[0] for table in tables.values()} == {placed.device}
    activation = {r["N"]: r for r in tables["activation-memory"]["rows"]}
    assert activation[1]["ratio"] == 1.0
    for n in (2, 4):
        assert abs(activation[n]["ratio/ideal"] - 1) <= 0.10, activation[n]
        assert activation[n]["ratio"] < activation[n // 2]["ratio"]
    state = {r["ddp_size"]: r for r in tables["state-memory"]["rows"]}
    assert state[1]["FSDP2/DDP"] == pytest.approx(1.0)
    for ddp in (2, 4):
        assert abs(state[ddp]["ratio/ideal"] - 1) <= 0.05, state[ddp]  # within 5 % of 1/ddp for this model


COLLECTIVES = """
import json, os, torch, torch.distributed as dist
from shardlab import measure
dist.init_process_group("gloo", rank=0, world_size=1)
with measure.collective_bytes() as cost:
    dist.all_reduce(torch.ones(4, 4))
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)
    torch.ones(100) * 2  # not a collective: counted only as the largest tensor
print("COST", json.dumps({"ops": cost.ops, "largest": cost.largest_tensor_bytes}))
dist.destroy_process_group()
"""


def test_collective_bytes_counts_calls_and_bytes_per_collective(fresh_python):
    from shardlab.ranks.launch import free_port

    proc = fresh_python.run(COLLECTIVES, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cost = json.loads(proc.stdout.split("COST", 1)[1])
    assert cost["ops"] == {"allreduce_": {"calls": 2, "bytes": 16 * 4 + 2 * 4}, "broadcast_": {"calls": 1, "bytes": 24}}
    assert cost["largest"] == 400


def test_an_activation_at_the_address_of_a_freed_excluded_tensor_is_counted():
    """FSDP2's gathered parameters are excluded and freed after each layer; the allocator may put a later activation
    at the same address. It must still be counted (seen as a rank measuring fewer bytes than its twin)."""
    weight = torch.randn(1, requires_grad=True)
    for _ in range(100):  # until the CPU allocator hands the freed block out again
        saved = measure.SavedActivations()
        gathered = torch.empty(4096)
        saved.exclude([gathered])
        address = gathered.data_ptr()
        del gathered
        x = torch.randn(4096)
        if x.data_ptr() == address:
            break
    else:
        pytest.skip("the allocator never reused the freed block here")
    with saved:
        (x * weight).sum()
    assert saved.bytes == x.numel() * x.element_size()


def test_held_bytes_count_the_storage_behind_a_view_once():
    field = torch.randn(1, 1, 256, 256)
    one_channel = field.narrow(2, 0, 128)  # a slice along H of a one-channel field: contiguous, a view
    assert one_channel.is_contiguous() and one_channel.contiguous().data_ptr() == one_channel.data_ptr()
    assert measure.shard_bytes(one_channel) == 131_072
    assert measure.held_bytes(one_channel) == 262_144  # the whole field, for as long as the slice lives
    assert measure.held_bytes(one_channel, field, field.narrow(2, 128, 128)) == 262_144  # one storage, once
    four_channels = torch.randn(1, 4, 256, 256).narrow(2, 0, 128).contiguous()  # not contiguous: copied
    assert measure.held_bytes(four_channels) == measure.shard_bytes(four_channels) == 524_288


SCATTERED = r"""
import torch, torch.distributed as dist
import shardlab as sl
from physicsnemo.domain_parallel import scatter_tensor
from torch.distributed.tensor import Shard
sl.init_distributed(30)
mesh = sl.build_mesh(ddp=1, domain=2)
held = {}
for channels in (1, 4):
    field = torch.randn(1, channels, 256, 256) if dist.get_rank() == 0 else None
    shard = scatter_tensor(field, 0, mesh["domain"], (Shard(2),))
    del field  # the source's own tensor: only what the shard keeps is left
    held[channels] = {"shard": sl.measure.shard_bytes(shard), "held": sl.measure.held_bytes(shard)}
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, held)
if dist.get_rank() == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
def test_a_scattered_one_channel_shard_holds_the_whole_field(tmp_path, no_leftovers):
    """scatter_tensor slices the broadcast field; with one channel the slice along H is a view of all of it."""
    script = tmp_path / "scattered.py"
    script.write_text(SCATTERED)
    for rank, held in enumerate(run_job("torchrun", 2, script, timeout_s=300, device="cpu").result):
        assert held["1"] == {"shard": 131_072, "held": 262_144}, (rank, held)  # half the rows, all the field
        assert held["4"] == {"shard": 524_288, "held": 524_288}, (rank, held)  # copied out: only its rows
