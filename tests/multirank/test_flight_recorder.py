"""torch's Flight Recorder on gloo ranks (on by default; sl.init_distributed only shrinks it): after a rank skipped a
collective and the others timed out in it, each rank's record (read without a collective: the group is broken) says
who waited in which collective for whom, and torch's own analyzer, reading ``sl.measure.flight.dump``'s files, names the
same rank (notebook 14). Also what says when torch changes what the recorder holds.

    .venv/bin/python -m pytest tests/multirank/test_flight_recorder.py -q -p no:randomly
"""

import json

import pytest
from torch.distributed.flight_recorder.components.builder import build_db
from torch.distributed.flight_recorder.components.config_manager import JobConfig
from torch.distributed.flight_recorder.components.loader import read_dir

from shardlab.measure.flight import Entered, waits
from shardlab.ranks.launch import run_job

ON_RANKS = r'''
import dataclasses, json, sys

import torch
import torch.distributed as dist

import shardlab as sl

sl.init_distributed(4)  # collectives give up after 4 s
me, world = dist.get_rank(), dist.get_world_size()
pair = dist.new_group([2, 3])
x = torch.ones(2)
dist.all_reduce(x)
if me in (2, 3):
    dist.broadcast(x, 2, group=pair)
try:
    if me != world - 1:  # the last rank skips it
        dist.all_reduce(x)
except RuntimeError as error:
    print(f"rank {me} timed out: {str(error)[-80:]}")
with open(f"{sys.argv[1]}/rank-{me}.json", "w") as out:
    json.dump([dataclasses.asdict(e) for e in sl.measure.flight.entered()], out)
with open(f"{sys.argv[1]}/flight/rank_{me}", "wb") as out:
    out.write(sl.measure.flight.dump())
'''

UNSET = r'''
import os, sys

os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
os.environ.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
import torch
import torch.distributed as dist

import shardlab as sl

dist.init_process_group("gloo")  # not sl.init_distributed: nothing sets the buffer's size
x = torch.ones(2)
dist.all_reduce(x)
dist.broadcast(x, 0)
ops = [e.op for e in sl.measure.flight.entered(since_ns=0)]
assert ops == ["all_reduce", "broadcast"], ops
dist.destroy_process_group()
'''


@pytest.mark.multirank
def test_the_recorder_names_the_rank_that_skipped_a_collective(tmp_path, no_leftovers):
    script = tmp_path / "skip.py"
    script.write_text(ON_RANKS)
    (tmp_path / "flight").mkdir()
    run_job("torchrun", 4, script, [str(tmp_path)], timeout_s=120, device="cpu")
    records = {}
    for rank in range(4):
        rows = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        records[rank] = [Entered(**dict(row, group=tuple(row["group"]), sizes=tuple(map(tuple, row["sizes"]))))
                         for row in rows]
    world, pair = (0, 1, 2, 3), (2, 3)
    seen = {rank: [(e.group, e.seq, e.op) for e in entered] for rank, entered in records.items()}
    assert seen[0][-2:] == [(world, 1, "all_reduce"), (world, 2, "all_reduce")], seen
    assert seen[3][-2:] == [(world, 1, "all_reduce"), (pair, 1, "broadcast")], seen
    assert records[0][-1].sizes == ((2,),)
    [wait] = waits(records)
    assert (wait.entered.op, wait.entered.seq, wait.waiting, wait.missing) == ("all_reduce", 2, (0, 1, 2), (3,))
    args = JobConfig().parse_args([str(tmp_path / "flight")])  # torch's analyzer, as torchfrtrace runs it
    details, version = read_dir(args)
    database = build_db(details, args, version)
    named = [(c.collective_name, c.collective_seq_id, c.missing_ranks) for c in database.collectives if c.missing_ranks]
    assert named == [("gloo:all_reduce", 2, {3})], named


@pytest.mark.multirank
def test_the_recorder_is_on_with_its_size_unset(tmp_path, no_leftovers):
    """FlightRecorder.hpp (torch 2.14.1), lines 106-114: 2,000 entries by default, recording whenever above 0."""
    script = tmp_path / "unset.py"
    script.write_text(UNSET)
    run_job("torchrun", 2, script, timeout_s=120, device="cpu")
