"""Point clouds (``notebooks/13_physicsnemo_models.ipynb``): Darcy samples seen at scattered points, split over the
domain ranks along the points, for PhysicsNeMo's point-cloud models (``models.transolver``).

Why Darcy at points: the series already has the samples (``data.load_darcy``, solved deterministically), and a set
of grid cells drawn from a seed is an irregular point cloud whose truth is known at every point, with no mesh
generator to install. Each point carries the scaled permeability there (its feature), its coordinates in [0, 1)
(the model's embedding) and the scaled pressure (the target), scaled as ``data.normalized_darcy`` scales fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from . import workarounds
from .data import darcy_scaling, load_darcy


class PointError(ValueError):
    """A point cloud that does not fit the model or the mesh it is given: the message says what to change."""


@dataclass
class PointCloud:
    """One sample's points: ``features`` (1, P, F), ``coords`` (1, P, D) and ``target`` (1, P, 1), the point dim 1.
    After ``shard`` each is a ShardTensor placed ``Shard(1)``: every rank holds its own points."""

    features: torch.Tensor
    coords: torch.Tensor
    target: torch.Tensor

    @property
    def points(self) -> int:
        return self.features.shape[1]

    def to(self, device=None, dtype=None) -> PointCloud:
        return replace(self, **{f.name: getattr(self, f.name).to(device=device, dtype=dtype) for f in fields(self)})

    def shard(self, mesh, dim: int = 1) -> PointCloud:
        """The same cloud with every rank of the 1-D ``mesh`` (a domain axis) holding its own points, torch.chunk's
        split as ``scatter_tensor`` makes it, from the mesh's first rank. Refuses, before any communication, a split
        of anything but the points and more ranks than points."""
        from physicsnemo.domain_parallel import scatter_tensor
        from torch.distributed.tensor import Shard

        if dim != 1:
            raise PointError(f"dim={dim} shards the {'features' if dim in (2, -1) else 'batch'} of every point: a "
                             "domain-parallel point cloud splits its points, dim 1 (Shard(1)).")
        if mesh.size() > self.points:
            raise PointError(f"{mesh.size()} ranks for {self.points} points: some ranks would hold no point. Use at "
                             f"most {self.points} ranks on the domain axis, or more points.")
        source = torch.distributed.get_global_rank(mesh.get_group(), 0)
        return PointCloud(*(scatter_tensor(getattr(self, f.name), source, mesh, (Shard(1),)) for f in fields(self)))


def darcy_points(sample: int = 0, points: int = 1024, split: str = "train", seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> PointCloud:
    """Sample ``sample`` of a Darcy split at ``points`` distinct grid cells drawn from ``seed`` and the sample's
    index (each sample its own points, as each simulation has its own mesh), on the CPU."""
    data = load_darcy(samples=sample + 1, split=split)
    permeability, pressure = darcy_scaling()(data["permeability"][sample:], data["pressure"][sample:], dtype)
    height, width = permeability.shape[-2:]
    if not 1 <= points <= height * width:
        raise PointError(f"points={points}: a Darcy sample has {height * width} grid cells; draw 1 to that many.")
    cells = torch.randperm(height * width, generator=torch.Generator().manual_seed(seed * 100_003 + sample))[:points]
    rows, columns = cells // width, cells % width
    coords = torch.stack([(columns + 0.5) / width, (rows + 0.5) / height], dim=-1).to(dtype)
    permeability, pressure = (field.reshape(-1)[cells].reshape(1, points, 1) for field in (permeability, pressure))
    return PointCloud(permeability, coords[None], pressure)


def predict(model, cloud: PointCloud) -> torch.Tensor:
    """``model(features, coords)`` for a point-cloud model with a preprocessing MLP (PhysicsNeMo's Transolver), after
    checking that the cloud's values per point are what the model's first layer takes."""
    inner = getattr(model, "module", model)  # under DDP, the model it wraps
    first = next((m for m in getattr(inner, "preprocess", inner).modules() if isinstance(m, torch.nn.Linear)), None)
    features, coords = cloud.features.shape[-1], cloud.coords.shape[-1]
    if first is not None and first.in_features != features + coords:
        raise PointError(f"the cloud has {features} feature(s) and {coords} coordinate(s) per point, and the model's "
                         f"first layer takes {first.in_features} values: build the model for {features} feature(s) "
                         f"(functional_dim={features}), or give it points with {first.in_features - coords}.")
    return model(cloud.features, cloud.coords)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error over every point (``workarounds.exact_mean``: exact gradients in float64)."""
    return workarounds.exact_mean((out - target) ** 2)


def relative_error(out: torch.Tensor, target: torch.Tensor) -> float:
    """‖out − target‖ / ‖target‖ over every point, gathering nothing: on ShardTensors each rank sums the squares over
    its own points (a ``Partial`` sum), and one all-reduce of one number makes each of the two sums whole."""
    squares = ((out - target) ** 2).sum(), (target**2).sum()
    error, norm = (_replicated(s) for s in squares)
    return (error / norm).sqrt().item()


def _replicated(t: torch.Tensor) -> torch.Tensor:
    if not hasattr(t, "redistribute"):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate()] * t.device_mesh.ndim).to_local()
