"""sl.points without ranks: a Darcy sample seen at points holds the sample's own values at those cells, the same
points for the same seed, and bad input is refused in one line before anything runs (notebook 13)."""

import pytest
import torch

from shardlab import points
from shardlab.data import normalized_darcy


def test_each_point_holds_the_samples_values_at_its_cell():
    cloud = points.darcy_points(3, 300, seed=5, dtype=torch.float64)
    inputs, targets = normalized_darcy(samples=4, dtype=torch.float64)
    height, width = inputs.shape[-2:]
    columns = (cloud.coords[0, :, 0] * width - 0.5).round().long()
    rows = (cloud.coords[0, :, 1] * height - 0.5).round().long()
    assert len({(r, c) for r, c in zip(rows.tolist(), columns.tolist())}) == 300  # distinct cells
    assert torch.equal(cloud.features[0, :, 0], inputs[3, 0, rows, columns])
    assert torch.equal(cloud.target[0, :, 0], targets[3, 0, rows, columns])
    assert cloud.coords.min() > 0 and cloud.coords.max() < 1


def test_the_same_seed_draws_the_same_points_and_each_sample_its_own():
    first, again = points.darcy_points(0, 50, seed=1), points.darcy_points(0, 50, seed=1)
    assert torch.equal(first.coords, again.coords)
    assert not torch.equal(first.coords, points.darcy_points(1, 50, seed=1).coords)
    assert not torch.equal(first.coords, points.darcy_points(0, 50, seed=2).coords)


class _PointModel(torch.nn.Module):  # laid out as Transolver is, a preprocessing MLP first (notebook 13: the real one)
    def __init__(self, features):
        super().__init__()
        self.preprocess = torch.nn.Sequential(torch.nn.Linear(features + 2, 8), torch.nn.GELU())

    def forward(self, fx, embedding):
        return self.preprocess(torch.cat([fx, embedding], dim=-1))[..., :1]


def test_a_cloud_whose_values_per_point_the_model_does_not_take_is_refused():
    with pytest.raises(points.PointError, match=r"1 feature\(s\) and 2 coordinate\(s\).*takes 4 values.*"
                                                r"functional_dim=1"):
        points.predict(_PointModel(features=2), points.darcy_points(0, 16))
    assert points.predict(_PointModel(features=1), points.darcy_points(0, 16)).shape == (1, 16, 1)


class _Mesh:  # a domain axis of this many ranks: the refusals read its size and nothing else
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_a_split_of_anything_but_the_points_is_refused_before_any_communication():
    with pytest.raises(points.PointError, match="shards the features of every point.*dim 1"):
        points.darcy_points(0, 16).shard(_Mesh(2), dim=2)
    with pytest.raises(points.PointError, match="shards the batch"):
        points.darcy_points(0, 16).shard(_Mesh(2), dim=0)


def test_more_ranks_than_points_is_refused_before_any_communication():
    with pytest.raises(points.PointError, match="8 ranks for 5 points.*at most 5 ranks"):
        points.darcy_points(0, 5).shard(_Mesh(8))


def test_a_point_count_the_sample_cannot_hold_is_refused():
    with pytest.raises(points.PointError, match="points=5000: a Darcy sample has 4096 grid cells"):
        points.darcy_points(0, 5000)


def test_the_loss_is_the_mean_and_the_relative_error_its_norm():
    out, target = torch.tensor([[[1.0], [3.0]]]), torch.tensor([[[0.0], [4.0]]])
    assert points.mse(out, target).item() == 1.0
    assert points.relative_error(out, target) == pytest.approx(2**0.5 / 4)
