"""Checkpoints layer, without ranks: bad names and folders are refused with one line before anything changes. The
resume of a sharded checkpoint in other layouts, on ranks: tests/multirank/test_checkpoint_resume.py."""


import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardlab import checkpoints
from shardlab.models import conv_stack, unet


def test_a_folder_that_is_missing_or_not_a_checkpoint_is_named(tmp_path):
    model = conv_stack()
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint folder at .*nowhere: give the folder save_sharded"):
        checkpoints.load_into_one_process(model, optimizer, tmp_path / "nowhere")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(FileNotFoundError, match=r"is not a torch.distributed.checkpoint folder \(no .metadata file\)"):
        checkpoints.load_into_one_process(model, optimizer, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process is what this save asks for
def test_other_names_or_shapes_are_named_before_anything_changes(tmp_path):
    saved = conv_stack(width=16, seed=0)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=tmp_path / "conv", no_dist=True)  # one process, no group
    for model, match in ((unet(levels=2), r"missing bottom\.bias, bottom\.weight, down\.0\.bias, down\.0\.weight and "
                                          r"\d+ more, unexpected 0\.bias, 0\.weight, 2\.bias, 2\.weight and 2 more\. "
                                          r"Load it into the model it was saved from, or rename"),
                         (conv_stack(width=8), r"other shapes than this model: 0\.bias \(16,\) saved, \(8,\) here")):
        optimizer = torch.optim.Adam(model.parameters())
        before = {name: t.clone() for name, t in model.state_dict().items()}
        with pytest.raises(ValueError, match=match) as refused:
            checkpoints.load_into_one_process(model, optimizer, tmp_path / "conv")
        assert "\n" not in str(refused.value)
        assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
        assert not optimizer.state  # not even the zero step get_state_dict gives an optimizer with no state
