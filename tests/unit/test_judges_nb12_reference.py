"""Notebook 12's slab-reader judge builds its reference with ``scatter_tensor`` from the rank's own device: on NCCL a
host tensor cannot be sent, and the reference is built outside the judged call's ``try``, so a host tensor there
failed the check on every GPU node whatever the learner wrote. Without ranks: the reference's input is watched on a
domain mesh whose device is ``meta``, which no host tensor is on."""

import physicsnemo.domain_parallel
import torch

from shardlab import data
from shardlab.exercises import nb12


class MetaDomain:
    """The 1-D domain mesh the judge scatters over, on a device that is not the host's."""

    device_type = "meta"

    def get_group(self):
        return "domain group"


def test_the_reference_is_scattered_from_the_ranks_device(tmp_path, monkeypatch):
    store = data.write_field_store(tmp_path / "f.zarr", 2, 12, 5, chunk_rows=4)
    handed = []
    monkeypatch.setattr(physicsnemo.domain_parallel, "scatter_tensor",
                        lambda tensor, source, mesh, placements: handed.append((tensor, source)) or "scattered")
    monkeypatch.setattr(nb12.dist, "get_global_rank", lambda group, rank: 0)
    monkeypatch.setattr(nb12.dist, "get_rank", lambda: 0)
    assert nb12._scattered(store, 1, MetaDomain()) == "scattered"
    (tensor, source), = handed
    assert source == 0 and tensor.device == torch.device("meta") and tuple(tensor.shape) == (1, 1, 12, 5)
