"""A warm rank on CUDA draws what a fresh one draws: ``rankstate.init_rank`` notes the CUDA generators' state at a
rank's first start, as it notes the CPU generator's, for ``reset_rank`` to put back (``torch.cuda.set_rng_state_all``)
before the next notebook. On CPU ranks there is none to note. No GPU here: ``torch.cuda.is_available()`` says True
and the generators' state is a stand-in; no process group is made."""

from types import SimpleNamespace

import pytest
import torch

from shardlab.ranks import beacon, devices, launch, rankstate


@pytest.mark.parametrize("cuda", [True, False])
def test_a_cuda_rank_notes_its_cuda_generators_for_the_next_notebook(monkeypatch, cuda):
    monkeypatch.setattr(launch, "init_distributed", lambda timeout_s: SimpleNamespace(
        as_row=lambda: {"rank": 0, "device": "cuda:0" if cuda else "cpu"}))
    monkeypatch.setattr(beacon, "engine_status_folder", lambda: None)
    monkeypatch.setattr(devices, "limit_rank_threads", lambda threads: None)
    monkeypatch.setattr(rankstate, "_SERIES_STATE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["the CUDA generators' state"])
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")  # init_rank writes them; put back after
    rankstate.init_rank({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 10, 1)
    assert rankstate._SERIES_STATE["cuda_rng"] == (["the CUDA generators' state"] if cuda else None)
