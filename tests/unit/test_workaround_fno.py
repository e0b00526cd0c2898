"""``sl.workarounds.fno_on_slabs``: the upstream lines it works around are still there (when this fails, upstream
changed how FNO builds its grid or drops its padding: check whether ``fno_on_slabs`` is still needed, and delete it
and its uses in shardlab/model_cases.py and notebook 13 if not), and a plain tensor still takes upstream's forward.
On ranks: tests/multirank/test_fno_grid_and_spatial.py."""

import inspect
from pathlib import Path

import torch
from physicsnemo.models.fno import FNO
from physicsnemo.nn.module.fno_layers import FNO2DEncoder

from shardlab import workarounds


def line(number: int) -> str:
    """Line ``number`` of the installed ``physicsnemo/nn/module/fno_layers.py``."""
    return Path(inspect.getsourcefile(FNO2DEncoder)).read_text().splitlines()[number - 1]


def test_fno_still_builds_the_whole_grid_from_the_global_shape_and_slices_its_padding_off():
    # a ShardTensor's shape is the global one: the grid is the whole field's on every rank
    assert "coord_feat = self._meshgrid(list(x.shape), x.device)" in line(369), (
        "FNO2DEncoder no longer builds its grid from x.shape at fno_layers.py:369: check fno_on_slabs is still needed")
    assert "x = x[..., : self.ipad[0], : self.ipad[1]]" in line(387), (
        "FNO2DEncoder no longer drops its padding by slicing at fno_layers.py:387: check fno_on_slabs is still needed")
    assert "def _meshgrid" in line(391) and "grid_x = torch.linspace(0, 1, size_x" in line(407)
    assert FNO2DEncoder()._meshgrid([1, 1, 12, 10], torch.device("cpu")).shape == (1, 2, 12, 10)


def test_a_plain_tensor_takes_upstreams_forward():
    torch.manual_seed(0)
    model = FNO(in_channels=1, out_channels=1, dimension=2, latent_channels=8, num_fno_layers=2, num_fno_modes=4,
                decoder_layers=1, decoder_layer_size=8).double()
    x = torch.randn(1, 1, 20, 18, dtype=torch.float64)
    before = model(x)
    assert torch.equal(workarounds.fno_on_slabs(model)(x), before)
    assert all(type(m).forward is not m.forward.__func__ for m in model.modules() if isinstance(m, FNO2DEncoder))
