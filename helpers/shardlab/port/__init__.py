"""From a model to a domain-parallel run that passes parity: ``python -m shardlab.port`` and ``sl.port.port``.

    python -m shardlab.port Transolver --points 1e6 --gpus 8 --gpu H100 --out transolver-run
    python -m shardlab.port mypackage.models:build --input x=1x1xNxN --shard x:2 --field 4096x4096 \\
        --gpus 8 --gpu 80GiB --out my-run

Steps, each printed as it happens, stopping at the first that fails with what to change:

1. **audit** (``job.py``, ``steps.audit_lines``): the model on local CPU ranks at a small size, float64, with
   ``sl.measure.audit``: each op ShardTensor has no handler for (named, with how to register one), each silent gather,
   the spatial parameters (``sl.parity.spatial_parameters``: split on ``domain``, the rest FSDP2 on ``ddp``);
2. **parity** (same job): ``sl.parity``'s comparison against one process, output and every gradient, even and uneven
   splits; no run is written when it fails, unless ``--skip-parity-gate``;
3. **plan** (``steps.candidates``): the series' planner at the target for each ``(ddp, domain)`` layout of the GPUs:
   DDP for plain parameters, spatial + FSDP2 where a table follows the field, FSDP2 where DDP's state does not fit;
4. **choice** (``steps.choose``): the smallest domain that fits, a domain group inside one node first, with the
   planner's verdict;
5. **write** (``write.py``): a new folder (never an existing one) with ``train.py``, ``test_parity.py`` (both from
   ``port/run/``), ``model.py``, ``run.json``, ``README.md`` and ``train.sbatch``. The run imports torch and
   PhysicsNeMo, never shardlab.

Bad input is caught before any rank starts where it can be (``spec.py``): one line, nothing written. docs/port.md.
"""

from .cli import main, port
from .spec import PortError

__all__ = ["PortError", "main", "port"]
