"""Notebook 13's parity judge spoils one of its two models, in the forward or in one parameter's gradient. Over many
draws, without ranks: every spoiled pair is one the notebook's tolerances (float64, tight) tell apart on the whole
cloud. A spoiled parameter the loss ignores (Transolver's slice temperature gets no gradient) once let a right
answer fail the check."""

import random

import pytest
import torch

from shardlab.exercises import nb13
from shardlab.points import mse, predict

DRAWS = 40


def run(model, cloud):
    out = predict(model, cloud)
    mse(out, cloud.target).backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("spoil", [nb13._wrong_forward, nb13._wrong_gradient])
def test_every_spoiled_pair_is_one_the_notebooks_tolerances_tell_apart(spoil):
    for draw in range(DRAWS):
        rng = random.Random(draw)
        features, seed = rng.randint(1, 3), rng.randrange(1000)
        cloud = nb13._cloud(rng, rng.choice([2, 3, 4]), features, torch.device("cpu"))
        model, one_process, probe = (nb13._model(features, seed, "cpu") for _ in range(3))
        what = spoil(model, rng, nb13._moving(probe, cloud))
        (out, grads), (truth, true_grads) = run(model, cloud), run(one_process, cloud)
        same = torch.allclose(out, truth, rtol=1e-9, atol=1e-12) and all(
            torch.allclose(grads[name], true_grads[name], rtol=1e-7, atol=1e-12) for name in grads)
        assert not same, f"draw {draw}: {what}, and nothing the notebook compares differs"


def test_the_probe_names_only_parameters_the_loss_moves_with():
    rng = random.Random(0)
    cloud = nb13._cloud(rng, 2, 2, torch.device("cpu"))
    probe = nb13._model(2, 7, "cpu")
    moving = nb13._moving(probe, cloud)
    names = {name for name, _ in probe.named_parameters()}
    assert moving and set(moving) < names
    assert all(probe.get_parameter(name).grad.abs().max() > 1e-6 for name in moving)
