"""Notebook 12's judges on 4 CPU ranks, as ``sl.exercises.on_ranks`` runs them on a cluster's engines. Exercise 2 has no
answer key to forbid: torch's ``DistributedSampler`` over the ddp replicas passes, and so do splits by hand (with
its permutation or another one drawn from the seed and the epoch); the wrong arguments to the same sampler fail every
draw. Exercise 1's solution passes with the judge's reference scattered from the rank's device.

    .venv/bin/python -m pytest tests/multirank/test_judges_nb12.py -q -p no:cacheprovider
"""

import pytest

from shardlab.ranks.launch import run_job

DRAWS = 2

ON_RANKS = r'''
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from physicsnemo.domain_parallel import ShardTensor
from torch.distributed.tensor import Shard
from torch.utils.data import DistributedSampler

import shardlab as sl
from shardlab.exercises.judging import _judge_here
from shardlab.exercises import nb12

sl.init_distributed(120)
device = sl.ranks.launch.default_device()
world = dist.get_world_size()
mesh = sl.build_mesh(ddp=2, domain=-1)
store = Path(sys.argv[1]) / "field.zarr"
if dist.get_rank() == 0:
    sl.data.write_field_store(store, 2, 37, 9, chunk_rows=4)
dist.barrier()


def sampler_of(dataset_len, mesh, epoch, seed, replicas=None, rank=None, set_epoch=True, drop_last=True):
    replicas = mesh["ddp"].size() if replicas is None else replicas
    rank = mesh.get_coordinate()[0] if rank is None else rank
    sampler = DistributedSampler(range(dataset_len), num_replicas=replicas, rank=rank, seed=seed, drop_last=drop_last)
    if set_epoch:
        sampler.set_epoch(epoch)
    return list(sampler)


def split_by_hand(dataset_len, mesh, epoch, seed, mix=lambda seed, epoch: seed + epoch):
    ddp, replica = mesh["ddp"].size(), mesh.get_coordinate()[0]
    order = torch.randperm(dataset_len, generator=torch.Generator().manual_seed(mix(seed, epoch))).tolist()
    return order[: dataset_len // ddp * ddp][replica::ddp]


RIGHT = {
    "DistributedSampler over the ddp replicas": sampler_of,
    "by hand, DistributedSampler's permutation": split_by_hand,
    "by hand, another permutation": lambda *a: split_by_hand(*a, mix=lambda seed, epoch: seed * 1000 + epoch),
}
WRONG = {
    "over the whole world": lambda n, m, e, s: sampler_of(n, m, e, s, replicas=world, rank=dist.get_rank()),
    "rank from the domain axis": lambda n, m, e, s: sampler_of(n, m, e, s, rank=m["domain"].get_local_rank()),
    "no set_epoch": lambda n, m, e, s: sampler_of(n, m, e, s, set_epoch=False),
    "the leftover padded": lambda n, m, e, s: sampler_of(n, m, e, s, drop_last=False),
    "replica from the global rank": lambda n, m, e, s: global_rank_split(n, m, e, s),
}


def global_rank_split(dataset_len, mesh, epoch, seed):
    ddp = mesh["ddp"].size()
    order = torch.randperm(dataset_len, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[: dataset_len // ddp * ddp][dist.get_rank() % ddp :: ddp]


def read_rows(array, sample, domain):  # the notebook's solution of exercise 1
    height, width = array.shape[2:]
    n, k = domain.size(), domain.get_local_rank()
    size = -(-height // n)
    bounds = [(min(r * size, height), min((r + 1) * size, height)) for r in range(n)]
    start, stop = bounds[k]
    local = torch.from_numpy(array[sample : sample + 1, :, start:stop, :]).to(device)
    shapes = [(1, array.shape[1], b - a, width) for a, b in bounds]
    return ShardTensor.from_local(local, domain, [Shard(2)], sharding_shapes={0: shapes})


seen = {"a draw": sl.exercises.case_generator().random()}
for kind, answers in (("right", RIGHT), ("wrong", WRONG)):
    for name, answer in answers.items():
        seen[f"{kind}: {name}"] = [_judge_here(nb12.domain_group_indices, answer, mesh) for _ in range(DRAWS)]
seen["right: the slab reader"] = [_judge_here(nb12.slab_reader, read_rows, store, mesh) for _ in range(DRAWS)]
rows = [None] * world
dist.all_gather_object(rows, seen)
if dist.get_rank() == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
'''


@pytest.mark.multirank
def test_right_answers_pass_every_draw_and_wrong_arguments_fail_every_draw(tmp_path, no_leftovers):
    script = tmp_path / "judges.py"
    script.write_text(ON_RANKS.replace("DRAWS)", f"{DRAWS})"))
    verdicts = run_job("torchrun", 4, script, [str(tmp_path)], timeout_s=600, device="cpu").result
    wrong = [] if len({rank["a draw"] for rank in verdicts}) == 1 else ["the ranks drew different cases"]
    answers = sorted(key for key in verdicts[0] if key != "a draw")
    assert sum(key.startswith("wrong") for key in answers) == 5 and sum(key.startswith("right") for key in answers) == 4
    for answer in answers:
        for draw in range(DRAWS):
            said = [rank[answer][draw] for rank in verdicts]
            if answer.startswith("right") and said != [None] * len(verdicts):
                wrong.append(f"{answer}, draw {draw}: refused: {said}")
            if answer.startswith("wrong") and not any(said):
                wrong.append(f"{answer}, draw {draw}: passed on every rank")
    assert not wrong, "\n".join(wrong)
