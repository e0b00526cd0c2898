"""Memory planner: every rank's bytes for a model, a field and a ``(ddp, domain)`` layout, before renting the GPUs.

Introduced in ``notebooks/09_memory_planner.ipynb``; ``python -m shardlab.plan --help`` is the command line.

How it predicts, per rank: the model is copied to the **meta device** (shapes and dtypes, no data) and
``sl.train.training_step``, the step ``Trainer.step`` takes, is replayed on the *local* shape that rank would hold,
so a 8192² or 512³ field is planned in well under a second without allocating it. Nothing is a per-layer formula;
autograd says what it keeps:

- **parameters, gradients, optimizer state**: the local shard of each parameter (all of it with DDP or no
  wrapper; with FSDP2, the ``torch.chunk`` of dim 0 over the ddp ranks that ``fully_shard`` keeps), and the
  optimizer's own state after a real ``step()`` on meta tensors of those shapes;
- **activations**: every tensor autograd saves for backward (``saved_tensors_hooks``, parameters excluded,
  as ``sl.measure.SavedActivations`` counts them on real ranks). Under domain parallelism each rank holds its
  ``torch.chunk`` of the sharded dim (uneven shards included), and every convolution first pads its input with
  the halo rows of its neighbours, or with its own zero padding at the edges of the domain, then convolves with no
  padding along that dim: what PhysicsNeMo's ShardTensor convolution does (``compute_halo_configs_from_conv_args``
  and ``compute_haloed_and_padded_input_shape`` in ``physicsnemo/domain_parallel/shard_utils/conv_patches.py``).
  **halos** is the part of those saved bytes that are rows beyond the rank's own;
- **transient**: how each rank gets its batch, ``loading`` (``LOADINGS``). ``"scatter"`` (the default, notebooks
  03-11): ``scatter_tensor`` broadcasts the whole tensor to every rank of the domain group before each keeps its
  slice, so the full field visits every rank. When the slice is a view (one sample, one channel, split along H), the
  full buffer even stays allocated as long as the sharded input lives. ``"slab"`` (notebook 12): each rank reads
  only its own rows from storage, into a tensor of their size, and wraps them with ``ShardTensor.from_local(...,
  sharding_shapes=...)``: no full field on any rank, transient 0, and the replayed step starts from those rows;
- **buffers** (named for the wrapper, ``BUFFERS``): DDP's gradient buckets (a second copy of every gradient,
  ``gradient_as_bucket_view=False``), or FSDP2's all-gathered parameters: two neighbouring ``fully_shard`` units at
  once, because FSDP2 prefetches the next unit's all-gather in backward by default (each shard padded to the size of
  the first);
- **temporaries**: the rest of a training step's high-water mark (gradients flowing through backward, the loss,
  the optimizer's foreach scratch), found by the replay while tracking live storages as the CUDA caching allocator
  counts them (512-byte blocks).

``total`` = the sum of the categories, at least the replayed peak: what each GPU must hold. What it cannot know
is in ``LEFT_OUT``, with typical sizes and sources; the verdict adds those as headroom.

**The peak** (``RankBytes.peak``) is the step's high-water mark per rank: the state, plus the larger of the replayed
forward with FSDP2's forward buffers, the replayed backward with FSDP2's backward buffers (the unit in hand and the
one it prefetches, or every unit still gathered without ``reshard_after_forward``, and the reduce-scatter input of
the largest unit) and the optimizer step. Planned for CPU ranks, it adds what CPU convolutions hold inside the
kernel (im2col columns on torch's slow path, oneDNN's blocked copies), which differs from CPU to CPU: ``workspace``
runs each kernel on this CPU, at a smaller size when it is large, and extrapolates. ``python -m shardlab.plan
--measure-peaks`` and ``tests/multirank/test_plan.py`` check it on 4 CPU ranks against the allocator's own peak
(``sl.measure.AllocatorPeak``, torch.profiler's memory events), ``make gpu-check`` against ``max_memory_allocated``.

**Levers** (``sl.train.Levers``, ``plan(..., levers=)`` / ``Planner.plan(..., levers=)``) are replayed, not
estimated: the meta model is checkpointed as ``sl.train.use_checkpointing`` does it and its blocks are recomputed in
backward; autocast runs as ``trace.MetaAutocast`` (the meta device has no autocast), casting the inputs of the ops
autocast lowers and caching each weight's copy; FSDP2's ``param_dtype`` makes the model, its gathered units and its
unsharded gradients that dtype (the input cast at the root), while the shards, their gradients and the optimizer
state stay in the planned dtype.

**Any other model** (points, several inputs, ShardTensor operations that need a process group): ``Planner(case,
size)`` with a parity case (``sl.parity.Case``, ``sl.model_cases``) is a ``cases.CasePlanner``. It measures one
training step on ranks at two small sizes and extrapolates the step's excess over the state per element of the split
inputs; every row says which method planned it (``METHODS``).

Modules: ``inputs`` (fields, sizes, GPUs, the model), ``trace`` (the replay on the meta device), ``workspace`` (what
this CPU's convolution kernels, or cuDNN on this machine's GPU, hold, measured), ``cases`` and ``calibrate`` (a
parity case, planned from what the ranks measured), ``records`` (what a
plan says: ``RankBytes``, ``Plan``, the headroom), ``planner`` (the planner and its verdict), ``search`` (the domain
sizes that work, and the smallest that fits), ``live`` (measured on ranks, compared), ``cli`` (``python -m
shardlab.plan``).
"""

from .cases import CasePlanner
from .cli import main
from .inputs import DTYPES, GPUS, LOADINGS, OPTIMIZERS, GiB, MiB, conv_model, fmt_bytes, parse_field, parse_size
from .live import (
    compare,
    comparison_table,
    gpu_check,
    measure_cases,
    measure_on_ranks,
    measure_rank,
    peak_cases,
    peak_table,
    predict_case,
    series_cases,
)
from .planner import Planner, Verdict, plan, verdict
from .records import ACCOUNTED, BUFFERS, CATEGORIES, LEFT_OUT, METHODS, Plan, RankBytes, headroom
from .trace import conv_halo

__all__ = ["ACCOUNTED", "BUFFERS", "CATEGORIES", "DTYPES", "GPUS", "LEFT_OUT", "LOADINGS", "METHODS", "OPTIMIZERS",
           "GiB", "MiB", "CasePlanner", "Plan", "Planner", "RankBytes", "Verdict", "compare", "comparison_table",
           "conv_halo", "conv_model", "fmt_bytes", "gpu_check", "headroom", "main", "measure_cases",
           "measure_on_ranks", "measure_rank", "parse_field", "parse_size", "peak_cases", "peak_table", "plan",
           "predict_case", "series_cases", "verdict"]
