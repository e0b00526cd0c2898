"""Notebook 09's first exercise: what one replica holds on its device, judged against the judge's own measurement.

Run: .venv/bin/python -m pytest tests/unit/test_nb09_state.py -q -p no:cacheprovider
"""

import torch

from shardlab.exercises import nb09
from shardlab.plan import conv_model


def shard_rows(rows: int, ddp: int, replica: int, wrapper: str) -> int:
    if wrapper != "fsdp2":
        return rows
    per_replica = -(-rows // ddp)  # torch.chunk's split of dim 0
    return max(0, min(per_replica, rows - replica * per_replica))


def on_device(model, ddp, replica, wrapper):
    """Parameter, gradient and Adam's two moments of this replica's shard: four times its bytes."""
    return sum(4 * shard_rows(p.shape[0], ddp, replica, wrapper) * p[0].nbytes for p in model.parameters())


def with_step_counts(model, ddp, replica, wrapper):
    return on_device(model, ddp, replica, wrapper) + 4 * len(list(model.parameters()))


def with_padding(model, ddp, replica, wrapper):
    """Parameters and gradients as FSDP2 stores them, every shard padded to the first's rows."""
    if wrapper != "fsdp2":
        return on_device(model, ddp, replica, wrapper)
    padded = sum(2 * -(-p.shape[0] // ddp) * p[0].nbytes for p in model.parameters())
    return padded + on_device(model, ddp, replica, wrapper) // 2


def test_adam_keeps_its_step_counts_off_the_parameters_device():
    p = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    p.grad = torch.zeros_like(p)
    optimizer = torch.optim.Adam([p])
    optimizer.step()
    state = optimizer.state[p]
    assert state["step"].device.type == "cpu"
    assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"


def test_the_judge_counts_steps_apart_and_shards_with_empty_ones():
    model = conv_model(2, width=16, depth=3)  # the output conv has one row: replica 1 of 2 has an empty shard
    right, on_cpu = nb09._state_truth(model, 2, 1, "fsdp2")
    assert right == on_device(model, 2, 1, "fsdp2")
    assert on_cpu == 4 * len(list(model.parameters()))
    assert nb09._padded(model, 2) > right // 2  # FSDP2 stores that empty shard's row anyway


def test_the_right_answer_passes():
    assert nb09.state_by_hand(on_device) is None


def test_counting_adams_step_counts_on_the_device_is_refused_with_why():
    message = nb09.state_by_hand(with_step_counts)
    assert message is not None and "step counts" in message and "CPU" in message


def test_counting_fsdp2s_padding_is_refused_with_why():
    message = nb09.state_by_hand(with_padding)
    assert message is not None and "padding" in message


def test_a_function_that_ignores_its_arguments_is_refused():
    assert "every model and layout" in nb09.state_by_hand(lambda model, ddp, replica, wrapper: 1234)


def test_the_whole_state_divided_by_ddp_is_told_so_even_where_it_equals_the_padded_bytes():
    def divided(model, ddp, replica, wrapper):
        whole = sum(4 * p.nbytes for p in model.parameters())
        return whole // ddp if wrapper == "fsdp2" else whole

    assert "divided by ddp" in nb09.state_by_hand(divided)
