"""The exercise of notebook 10 lets a learner register ShardTensor handlers; its judge puts the registries back from
a snapshot taken before the answer, so no learner's handler reaches a later cell or notebook."""

import torch

from shardlab.exercises import nb10
from shardlab.models import DIFFUSE


def test_restore_registry_removes_new_handlers_and_puts_back_replaced_ones():
    from physicsnemo.domain_parallel import ShardTensor

    before = nb10.registry_snapshot()
    series_roll = ShardTensor._function_registry.get(torch.roll)

    def learner_patch(func, types, args, kwargs):
        return None

    ShardTensor.register_function_handler(DIFFUSE, learner_patch)
    ShardTensor.register_named_function_handler(str(DIFFUSE), learner_patch)
    ShardTensor.register_function_handler(torch.roll, learner_patch)  # replaces the series' handler, if any
    ShardTensor.register_dispatch_handler(DIFFUSE, learner_patch)
    assert nb10.registered_handler() is learner_patch
    nb10.restore_registry(before)
    assert nb10.registry_snapshot() == before
    assert nb10.registered_handler() is None
    assert ShardTensor._function_registry.get(torch.roll) is series_roll
