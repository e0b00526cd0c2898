"""Measure layer on real ranks: the activation-memory script's ratios follow 1/N + halo, and a scattered
one-channel shard holds the whole field (bytes are deterministic; no timing is asserted). In one process:
tests/unit/test_measure.py."""

import json
import os
import subprocess
import sys

import pytest

from shardlab.ranks.launch import run_job
from world_sizes import MEASURE


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
