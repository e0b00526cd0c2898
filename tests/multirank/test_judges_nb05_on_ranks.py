"""Notebook 05's judges on real ranks: they pass the solutions and fail an answer fitted to their former model.
The drawn cases of 01's and 05's judges, without ranks: tests/unit/test_judges_nb01_nb05.py.

    .venv/bin/python -m pytest tests/multirank/test_judges_nb05_on_ranks.py -q -p no:cacheprovider"""

import json

import pytest

from shardlab.ranks.launch import run_job

NB05_ON_RANKS = """
import json
import random

import torch.distributed as dist
import torch.func as torch_func
from physicsnemo.domain_parallel import sync_module_over_mesh
from torch.distributed.fsdp import fully_shard
import shardlab as sl
from shardlab.exercises import nb05

sl.init_distributed(60)
mesh = sl.build_mesh(ddp=-1, domain=1)


def shard_for_fsdp2(model, mesh):
    sync_module_over_mesh(model, mesh["domain"])
    sync_module_over_mesh(model, mesh["ddp"])
    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh["ddp"])
    return fully_shard(model, mesh=mesh["ddp"])


def fitted(model, mesh):  # the weights of the model the judge always built before it drew them
    sync_module_over_mesh(model, mesh["domain"])
    sync_module_over_mesh(model, mesh["ddp"])
    model.load_state_dict(sl.models.conv_stack(width=8, layers=2, seed=100).state_dict())
    return shard_for_fsdp2(model, mesh)


def fsdp2_grads_by_hand(shards, template, x, y, group):
    n = dist.get_world_size(group)
    full = {}
    for name, p in template.named_parameters():
        rows = -(-p.shape[0] // n)
        padded = p.new_zeros((rows, *p.shape[1:]))
        padded[:len(shards[name])] = shards[name]
        gathered = p.new_empty((rows * n, *p.shape[1:]))
        dist.all_gather_single(gathered, padded, group=group)
        full[name] = gathered[:p.shape[0]].requires_grad_()
    ((torch_func.functional_call(template, full, (x,)) - y) ** 2).mean().backward()
    grads = {}
    for name, p in full.items():
        rows = -(-p.shape[0] // n)
        padded = p.new_zeros((rows * n, *p.shape[1:]))
        padded[:p.shape[0]] = p.grad
        mine = p.new_empty((rows, *p.shape[1:]))
        dist.reduce_scatter_tensor(mine, padded, group=group)
        grads[name] = mine[:len(shards[name])] / n
    return grads


def verdict(judge, answer, seed=None):
    try:  # as sl.exercises.on_ranks does: an answer that breaks the judge is a wrong answer
        return judge(answer, mesh, None if seed is None else random.Random(seed))
    except Exception as error:
        return f"raised {type(error).__name__}"


result = {
    "ready": [verdict(nb05.fsdp2_ready, shard_for_fsdp2, seed) for seed in (1, 2)],
    "fitted": [verdict(nb05.fsdp2_ready, fitted, seed) for seed in (1, 2)],
    "step": [verdict(nb05.fsdp2_step, fsdp2_grads_by_hand, seed) for seed in (1, 2)],
    "fresh draws": [verdict(nb05.fsdp2_ready, shard_for_fsdp2), verdict(nb05.fsdp2_step, fsdp2_grads_by_hand)],
}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, result)
if dist.get_rank() == 0:
    print("RESULT", json.dumps(everyone))
sl.ranks.launch.shutdown_distributed()
"""


@pytest.mark.multirank
def test_notebook_05s_judges_pass_the_solutions_and_fail_an_answer_fitted_to_their_former_model(tmp_path,
                                                                                              no_leftovers):
    script = tmp_path / "nb05_judges.py"
    script.write_text(NB05_ON_RANKS)
    job = run_job("torchrun", 2, script, [], timeout_s=300, env={"CUDA_VISIBLE_DEVICES": ""})
    ranks = json.loads(job.stdout.split("RESULT", 1)[1])
    for rank, result in enumerate(ranks):
        assert result["ready"] == [None, None] and result["step"] == [None, None], (rank, result)
        assert result["fresh draws"] == [None, None], (rank, result)  # as the notebook calls them
        assert all(result["fitted"]), (rank, result)
