"""Training layer, in one process: the wrapper choice is validated (FSDP1 ruled out), the data scaling and sample
order, the learning rate, evaluation, the deterministic reference, FSDP2's units, the levers (checkpointing,
autocast). Checkpoint resume and the levers on ranks: tests/multirank/test_train_on_ranks.py."""


import pytest
import torch

from shardlab import train


def test_unknown_wrapper_names_the_choices_and_rules_out_fsdp1():
    with pytest.raises(ValueError, match=r"use one of \('none', 'ddp', 'fsdp2'\)\. FSDP1 and distribute_module"):
        train.wrap(torch.nn.Linear(2, 2), mesh=None, how="fsdp1")


def test_decayed_lr_falls_in_a_straight_line():
    assert [train.decayed_lr(2.0, step, 4) for step in range(4)] == [2.0, 1.5, 1.0, 0.5]


def test_evaluate_a_perfect_a_half_and_a_zero_model():
    x = torch.randn(3, 1, 8, 8)
    model = torch.nn.Conv2d(1, 1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    assert train.evaluate(model, x, x) == pytest.approx({"loss": 0.0, "relative L2": 0.0}, abs=1e-7)
    assert train.evaluate(model, x, 2 * x) == pytest.approx({"loss": (x**2).mean().item(), "relative L2": 0.5})
    with torch.no_grad():
        model.weight.zero_()
    assert train.evaluate(model, x, x)["relative L2"] == pytest.approx(1.0)


def test_one_process_reference_is_deterministic():
    from shardlab.models import conv_stack

    a = train.train_one_process(conv_stack(seed=0), steps=2, ddp_size=2)
    b = train.train_one_process(conv_stack(seed=0), steps=2, ddp_size=2)
    assert a == b and a[1] < a[0]


def test_training_step_is_plain_pytorch_that_tools_watch_from_outside():
    """What the planner's replay relies on, seen through PyTorch's own hooks and an optimizer: the batch, the forward,
    then ``zero_grad`` just before backward, and the optimizer's step once every gradient is there."""
    from shardlab.models import conv_stack

    model = conv_stack(width=4, layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    class Recorded(torch.optim.SGD):
        def zero_grad(self, set_to_none=True):
            seen.append(("zero_grad", any(p.grad is not None for p in model.parameters())))
            super().zero_grad(set_to_none)

    optimizer = Recorded(model.parameters(), lr=0.1)
    model.register_forward_pre_hook(lambda m, args: seen.append(("forward", args[0] is x)))
    model.register_full_backward_pre_hook(lambda m, grad: seen.append(("backward", grad[0].shape == y.shape)))
    optimizer.register_step_pre_hook(
        lambda o, args, kwargs: seen.append(("step", all(p.grad is not None for p in model.parameters()))))
    x, y = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)

    def batch():
        seen.append(("batch", True))
        return x, y

    loss = train.training_step(model, optimizer, batch)
    assert seen == [("batch", True), ("forward", True), ("zero_grad", False), ("backward", True), ("step", True)]
    assert loss.item() == pytest.approx(((conv_stack(width=4, layers=2)(x) - y) ** 2).mean().item())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step moved every weight


def test_fsdp_units_are_the_trainable_children_then_the_root_with_the_rest():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.GELU(), torch.nn.Linear(3, 1))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    frozen = torch.nn.Linear(1, 1).requires_grad_(False)
    model.add_module("frozen", frozen)
    units = train.fsdp_units(model)
    assert units == [(model[0], ["weight", "bias"]), (model[2], ["weight", "bias"]),
                     (model, ["scale", "frozen.weight", "frozen.bias"])]


def test_fsdp_units_look_inside_containers_that_fully_shard_refuses():
    from shardlab.models import unet

    model = unet(width=4, levels=2)
    units = train.fsdp_units(model)
    assert not any(isinstance(unit, (torch.nn.ModuleList, torch.nn.ModuleDict)) for unit, _ in units)
    assert model.down[0] in [unit for unit, _ in units]  # a ModuleList's children are units
    where = {id(module): name for name, module in model.named_modules()}
    managed = [f"{where[id(unit)]}.{n}".lstrip(".") for unit, names in units for n in names]
    assert sorted(managed) == sorted(n for n, _ in model.named_parameters())  # each parameter in one unit


def test_levers_name_what_is_on_and_refuse_what_cannot_apply():
    assert train.Levers().label == str(train.Levers()) == "baseline"
    both = train.Levers(checkpoint=True, autocast=torch.bfloat16, param_dtype=torch.bfloat16,
                        reshard_after_forward=False)
    assert both.label == "checkpoint + autocast bf16 + param_dtype bf16 + no reshard after forward"
    with pytest.raises(ValueError, match="autocast=torch.float32: give a lower-precision dtype"):
        train.Levers(autocast=torch.float32)
    for how in ("none", "ddp"):
        with pytest.raises(ValueError, match=f"param_dtype=torch.bfloat16 is FSDP2's MixedPrecisionPolicy, and "
                                             f"how='{how}': use how='fsdp2', or autocast=torch.bfloat16"):
            train.wrap(torch.nn.Linear(2, 2), None, how, train.Levers(param_dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="reshard_after_forward=False is an FSDP2 option"):
            train.Levers(reshard_after_forward=False).check(how)
    train.Levers(param_dtype=torch.float16, reshard_after_forward=False).check("fsdp2")  # what FSDP2 takes
    with pytest.raises(ValueError, match="this model is a Linear: call torch.utils.checkpoint.checkpoint"):
        train.use_checkpointing(torch.nn.Linear(2, 2))


def test_checkpointing_keeps_the_step_and_saves_only_each_blocks_input():
    from shardlab.levers import checkpoint_blocks
    from shardlab.measure import SavedActivations
    from shardlab.models import conv_stack

    plain, checkpointed = conv_stack(width=4), train.use_checkpointing(conv_stack(width=4))
    assert [[type(m).__name__ for m in block] for block in checkpoint_blocks(checkpointed)] == [
        ["Conv2d"], ["GELU", "Conv2d"], ["GELU", "Conv2d"]]
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    x, y = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)
    saved = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        levers = train.Levers(checkpoint=name == "checkpointed")
        counter = SavedActivations(exclude=model.parameters())  # in the forward only, as measure_rank counts
        model.register_forward_pre_hook(lambda m, args, counter=counter: counter.__enter__() and None)  # args kept
        model.register_forward_hook(lambda m, args, out, counter=counter: counter.__exit__(None, None, None))
        train.training_step(model, optimizer, lambda: (x, y), levers=levers)
        saved[name] = counter.counted
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a, b)  # the same step
    width4 = ((1, 4, 8, 8), 4 * 64 * 4)
    assert saved["plain"] == [((1, 1, 8, 8), 256), *[width4] * 4]  # each conv's input and each GELU's
    assert saved["checkpointed"] == [((1, 1, 8, 8), 256), width4, width4]  # each block's input only
    with pytest.raises(ValueError, match="the model is not checkpointed: build it with sl.train.wrap"):
        train.training_step(plain, optimizer, lambda: (x, y), levers=train.Levers(checkpoint=True))


def test_autocast_runs_the_forward_in_bf16_and_keeps_the_weights_fp32():
    from shardlab.models import conv_stack

    model = conv_stack(width=4)
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)
    loss = train.training_step(model, optimizer, lambda: (x, y), levers=train.Levers(autocast=torch.bfloat16))
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_a_trainer_is_handed_samples_or_a_batch_source_not_both():
    from types import SimpleNamespace

    from shardlab import data

    x, y = torch.zeros(2, 1, 4, 4), torch.ones(2, 1, 4, 4)
    with pytest.raises(ValueError, match=r"samples= and source= both given: .*pass one of them"):
        train.Trainer(torch.nn.Conv2d(1, 1, 1), SimpleNamespace(device_type="cpu"), "none", samples=(x, y),
                      source=data.ScatterSource(x, y))
    with pytest.raises(ValueError, match="give both inputs and targets, or neither"):
        data.ScatterSource(x)
    assert len(data.ScatterSource(x, y)) == 2
