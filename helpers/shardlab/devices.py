"""Which device a job of ranks runs on, and how many cores and GPUs its ranks have: one rule for the cluster,
``run_job``, the smoke, bench, measure and gpucheck tools.

The rule (``place_ranks``), for ``n`` ranks and the GPUs those ranks will see:

- ``n`` ranks on ``n`` or more GPUs: CUDA ranks, one GPU each (NCCL when there are two or more);
- no GPU: CPU ranks (gloo), which rehearse the whole program;
- one GPU and two or more ranks: CPU ranks. NCCL cannot put two ranks on one GPU and every lesson needs a domain
  of 2, so a one-GPU learner's notebooks run on CPU ranks; what one rank shows (memory at N=1, compile timing,
  the TF32 error) runs on the GPU, as one-rank jobs;
- more ranks than GPUs on a node with two or more: refused with the reason, unless the caller asks for CPU
  ranks (device "cpu"). A row that says "CUDA" must mean CUDA.

The GPUs counted are the ranks', not this process's: engines that Slurm starts on other nodes see what their job
asked for (``slurm_gpus``), not what the login node's kernel sees. Plain inputs only, no shardlab imports, no torch
at import: every function here is tested with the GPU count simulated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """A job asked for a device its ranks do not have; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    """What a job of ranks really runs on: ``device`` ("cpu" or "cuda"), ``ranks``, and why, in words."""

    device: str
    ranks: int
    gpus: int
    why: str

    @property
    def label(self) -> str:
        """For table rows: '4 CUDA ranks' or '4 CPU ranks'."""
        return f"{self.ranks} {self.device.upper()} rank{'s' if self.ranks > 1 else ''}"


def place_ranks(n: int, gpus: int, device: str = "auto") -> Placement:
    """The device ``n`` ranks run on when they see ``gpus`` GPUs in all, by the module's rule; ``device`` "cpu" or
    "cuda" asks for one (refused when impossible), "auto" chooses."""
    if device not in DEVICES:
        raise DeviceError(f"device={device!r}: use 'auto', 'cpu' or 'cuda'.")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DeviceError(f"{n!r} ranks: a job needs a whole number of ranks, at least 1.")
    if device == "cpu":
        return Placement("cpu", n, gpus, "CPU ranks, as asked")
    if n <= gpus:
        return Placement("cuda", n, gpus, f"one GPU per rank ({gpus} visible)")
    if device == "auto" and gpus == 0:
        return Placement("cpu", n, gpus, "no GPU is visible: CPU ranks rehearse the program")
    if device == "auto" and gpus == 1:
        return Placement("cpu", n, gpus, "one GPU cannot hold two NCCL ranks: CPU ranks rehearse the program; "
                                         "one-rank jobs run on the GPU")
    fix = f"start {gpus} rank(s) (SHARDLAB_RANKS={gpus}, n={gpus}) or " if gpus else "there is no GPU here: "
    raise DeviceError(f"{n} ranks but {gpus} GPU(s) visible to them: NCCL needs one GPU per rank. {fix[0].upper()}"
                      f"{fix[1:]}pass device='cpu' for {n} CPU ranks.")  # CPU-only: the advice itself


def default_ranks(gpus: int) -> int:
    """How many ranks a cluster starts unless told: one per GPU when there are two or more, else 4 CPU ranks."""
    return gpus if gpus >= 2 else 4


def gpu_index(local_rank: int, gpus: int) -> int:
    """The GPU a rank with ``local_rank`` uses among the ``gpus`` its process sees: its local rank when every rank
    of the node sees all GPUs, 0 when it sees exactly one (Slurm's ``--gpus-per-task=1``, or a
    CUDA_VISIBLE_DEVICES slice per rank)."""
    if gpus == 1:
        return 0
    if 0 <= local_rank < gpus:
        return local_rank
    raise DeviceError(f"local rank {local_rank}, but this process sees {gpus} GPU(s): start one process per GPU "
                      f"(e.g. torchrun --nproc-per-node={gpus}), or give each task one GPU (srun --gpus-per-task=1).")


_GPU_ARGS = re.compile(r"--(gpus-per-task|gpus-per-node|gpus|gres)[= ](?:gpu:)?(?:[\w-]+:)?(\d+)$")


def slurm_gpus(n: int, slurm_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> int:
    """GPUs that ``n`` engines or ranks started by Slurm see in all: from the job's own options (``slurm_args``:
    ``--gpus-per-task``, ``--gpus``, ``--gpus-per-node``/``--gres=gpu:K`` with ``--nodes``), else from the
    allocation this process runs in (``SLURM_GPUS_PER_TASK``, ``SLURM_GPUS``, ``SLURM_GPUS_ON_NODE`` × nodes);
    0 when neither asks for GPUs. Never this process's own count: a login node's kernel sees none."""
    env = os.environ if env is None else env
    nodes = 1
    asked: dict[str, int] = {}
    for arg in slurm_args:
        if found := re.match(r"--nodes[= ](\d+)$", arg) or re.match(r"-N ?(\d+)$", arg):
            nodes = int(found.group(1))
        elif found := _GPU_ARGS.match(arg):
            asked[found.group(1)] = int(found.group(2))
    per_task = asked.get("gpus-per-task", _int(env.get("SLURM_GPUS_PER_TASK")) if not asked else 0)
    if per_task:
        return per_task * n
    if "gpus" in asked:
        return asked["gpus"]
    per_node = asked.get("gpus-per-node") or asked.get("gres")
    if per_node:
        return per_node * nodes
    if asked:
        return 0
    if total := _int(env.get("SLURM_GPUS")):
        return total
    return _int(env.get("SLURM_GPUS_ON_NODE")) * (_int(env.get("SLURM_JOB_NUM_NODES")) or 1)


def _int(value: str | None) -> int:
    """'4' -> 4; Slurm's typed counts ('a100:4') -> 4; unset or unreadable -> 0."""
    found = re.search(r"(\d+)$", value or "")
    return int(found.group(1)) if found else 0


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (a cpuset, a Slurm allocation, taskset), which
    ``os.cpu_count()`` ignores; oversubscription and threads per rank are decided from it."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS has no affinity mask
        return os.cpu_count() or 1


def visible_gpus() -> int:
    """GPUs this process sees (after CUDA_VISIBLE_DEVICES): for ranks on this machine, theirs too."""
    import torch

    return torch.cuda.device_count()
