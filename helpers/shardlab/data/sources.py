"""The loading: batch sources, each the way a rank gets its (input, target) of a training sample.

A ``Trainer`` is handed one and asks it for sample ``i``; it never asks how the sample arrives:

- ``ScatterSource``: the samples are in host memory; the domain group's first rank holds the sample and
  ``scatter_tensor`` sends each rank its rows (notebooks 03, 05);
- ``SlabSource``: each rank reads only its own rows from a field store (``reader.read_slab``) and scales them
  itself: no communication (notebook 12).

Both give a domain-sharded ShardTensor when the domain axis has more than one rank, a plain tensor otherwise.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from ..mesh import domain_source
from .darcy import FIELDS, darcy_scaling, normalized_darcy
from .reader import open_store, read_slab
from .writer import write_darcy_store


class ScatterSource:
    """Samples held whole, ``inputs`` and ``targets`` of shape (N, 1, H, W) (``normalized_darcy()`` by default),
    scattered over the domain group from its first rank."""

    def __init__(self, inputs=None, targets=None):
        if (inputs is None) != (targets is None):
            raise ValueError("give both inputs and targets, or neither (the Darcy training split).")
        self.inputs, self.targets = (inputs, targets) if inputs is not None else normalized_darcy()

    def __len__(self) -> int:
        return len(self.inputs)

    def sample(self, i: int, mesh, device):
        """Sample ``i``, this rank's rows of it when the domain axis is split."""
        from physicsnemo.domain_parallel import scatter_tensor

        # A copy on CPU ranks too, as .to(cuda) makes on a GPU: the step's bytes are then the same on both.
        x, y = self.inputs[i : i + 1].to(device, copy=True), self.targets[i : i + 1].to(device, copy=True)
        if mesh["domain"].size() > 1:
            x = scatter_tensor(x, domain_source(mesh), mesh["domain"], (Shard(2),))
            y = scatter_tensor(y, domain_source(mesh), mesh["domain"], (Shard(2),))
        return x, y


class SlabSource:
    """The training samples of a Darcy store (``write_darcy_store()`` by default; it holds every sample, held-out
    first), each rank reading its own rows and scaling them pointwise as ``normalized_darcy`` scales whole samples."""

    def __init__(self, store=None):
        self.store = open_store(store if store is not None else write_darcy_store())
        self.scale = darcy_scaling()
        self.first = self.store.params.get("held_out", 0)

    def __len__(self) -> int:
        return self.store.field("permeability").shape[0] - self.first

    def sample(self, i: int, mesh, device):
        """Training sample ``i``, this rank's rows of it only, read from the store and scaled on the rank."""
        k, p = (read_slab(self.store, self.first + i, mesh, field=name, device=device).tensor for name in FIELDS)
        if mesh["domain"].size() == 1:  # a plain tensor, as ScatterSource gives
            k, p = k.to_local(), p.to_local()
        return self.scale(k, p)
