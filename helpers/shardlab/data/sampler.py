"""The sampler: which training sample each ddp replica takes at each step.

Every rank of a domain group takes the same sample, so the rule runs over the ``ddp`` replicas only. A data loader
needs no sampler class of ours for that: torch's ``DistributedSampler`` with
``num_replicas=mesh["ddp"].size(), rank=mesh.get_coordinate()[0]`` (notebook 12).
"""

from __future__ import annotations


def sample_index(step: int, ddp_size: int, replica: int, n_samples: int) -> int:
    """The sample ddp replica ``replica`` trains on at ``step``: each step takes the next ddp_size of the
    ``n_samples`` training samples, one per domain group, and a long run goes round them again."""
    return (step * ddp_size + replica) % n_samples
