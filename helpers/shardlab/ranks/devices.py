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
# One folder per GPU that the loaded NVIDIA kernel driver found: what says a node has GPUs when nvidia-smi is missing.
NVIDIA_DRIVER_GPUS = "/proc/driver/nvidia/gpus"


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
    """How many ranks a cluster starts unless told: one per GPU on the largest even number of GPUs when there are
    two or more (the lessons' domain groups are 2: 3 GPUs give 2 ranks, 7 give 6), else 4 CPU ranks."""
    return gpus - gpus % 2 if gpus >= 2 else 4


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


# Options of srun and sbatch that say how many nodes and GPUs a job gets: {what a user may type: long name}.
SLURM_OPTIONS = {"--nodes": "nodes", "-N": "nodes", "--ntasks-per-node": "ntasks-per-node", "--gpus": "gpus",
                 "-G": "gpus", "--gpus-per-task": "gpus-per-task", "--gpus-per-node": "gpus-per-node", "--gres": "gres"}


def slurm_gpus(n: int, slurm_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> int:
    """GPUs that ``n`` engines or ranks started by Slurm see in all: from the job's own options (``slurm_args``:
    ``--gpus-per-task``, ``--gpus``, ``--gpus-per-node``/``--gres=gpu:K`` times the nodes, ``slurm_nodes``), else
    from the allocation this process runs in (``SLURM_GPUS_PER_TASK``, ``SLURM_GPUS``, ``SLURM_GPUS_ON_NODE`` × the
    nodes the options ask for, else the allocation's); 0 when neither asks for GPUs. Never this process's own count:
    a login node's kernel sees none."""
    env = os.environ if env is None else env
    options = slurm_options(slurm_args)
    asked = {name: count for name in ("gpus-per-task", "gpus", "gpus-per-node", "gres")
             if name in options and (count := _gpu_count(name, options[name])) is not None}
    per_task = asked.get("gpus-per-task", _int(env.get("SLURM_GPUS_PER_TASK")) if not asked else 0)
    if per_task:
        return per_task * n
    if "gpus" in asked:
        return asked["gpus"]
    nodes = slurm_nodes(n, slurm_args) or allocation_nodes(n, env)
    per_node = asked.get("gpus-per-node") or asked.get("gres")
    if per_node:
        return per_node * nodes
    if asked:
        return 0
    if total := _int(env.get("SLURM_GPUS")):
        return total
    return (_int(env.get("SLURM_GPUS_ON_NODE")) or 0) * nodes


def allocation_nodes(n: int, env: Mapping[str, str]) -> int:
    """The nodes a step of ``n`` tasks that names none spans inside an allocation: srun spreads a step over all of
    the allocation's nodes (``SLURM_JOB_NUM_NODES``, or the older ``SLURM_NNODES``), at most one a task; 1 outside
    one."""
    nodes = _int(env.get("SLURM_JOB_NUM_NODES")) or _int(env.get("SLURM_NNODES")) or 1
    return max(1, min(nodes, n))


def slurm_options(slurm_args: Sequence[str]) -> dict[str, str]:
    """{long name: value} of the ``SLURM_OPTIONS`` among ``slurm_args``, in every spelling srun and sbatch accept:
    ``--nodes=2``, ``--nodes 2`` (one argument or two), ``-N2``, ``-N 2`` (one or two) all give {"nodes": "2"}.
    The last one given wins, as in Slurm."""
    found: dict[str, str] = {}
    args = iter(slurm_args)
    for arg in args:
        option = re.fullmatch(r"(--[\w-]+)(?:[= ](.*))?", arg, re.S) or re.fullmatch(r"(-\w)(?:[= ]?(.+))?", arg, re.S)
        if option and (name := option.group(1)) in SLURM_OPTIONS:
            value = option.group(2)  # None: the value is the next argument
            found[SLURM_OPTIONS[name]] = (next(args, "") if value is None else value).strip()
    return found


def slurm_nodes(n: int, slurm_args: Sequence[str]) -> int | None:
    """The nodes a Slurm job of ``n`` tasks spans by its options: ``--nodes``/``-N`` (a count; a range ``2-4`` only
    with ``--ntasks-per-node``, which decides it), else ``n`` over ``--ntasks-per-node``; None when they do not say.
    A range that nothing decides is refused: the GPUs per node would count for an unknown number of nodes."""
    options = slurm_options(slurm_args)
    tasks_per_node = _int(options.get("ntasks-per-node"))
    needed = -(-n // tasks_per_node) if tasks_per_node else None  # --ntasks wins: --ntasks-per-node is a maximum
    if "nodes" not in options:
        return needed
    found = re.fullmatch(r"(\d+)(?:-(\d+))?", options["nodes"])
    if not found:
        raise DeviceError(f"--nodes={options['nodes']}: give the job's node count (--nodes=2, -N 2), or a range "
                          "(--nodes=2-4) with --ntasks-per-node.")
    low, high = int(found.group(1)), int(found.group(2) or found.group(1))
    if low == high:
        return low
    if needed:
        return min(max(low, needed), high)
    raise DeviceError(f"--nodes={options['nodes']}: Slurm picks between {low} and {high} nodes when the job starts, "
                      "so the GPUs per node add up to an unknown total. Give one node count (e.g. "
                      f"--nodes={low}), or --ntasks-per-node (the nodes are then the tasks over it), or "
                      "--gpus-per-task.")


def _gpu_count(option: str, value: str) -> int | None:
    """GPUs one ``--gpus*`` or ``--gres`` value asks for ('4', 'a100:4', 'gpu:a100:4', 'gpu' = 1); None: a --gres
    without GPUs."""
    if option == "gres":
        value = next((each for each in value.split(",") if each.split(":")[0] == "gpu"), None)
        if value is None:
            return None
        return int(found.group(1)) if (found := re.search(r":(\d+)$", value)) else 1
    return _int(value)


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


# Inductor's compile workers per process; unset, torch 2.14 starts min(32, cores) of them in every process that
# compiles (torch/_inductor/config.py, decide_compile_threads): 8 ranks of a 32-core node would start 256.
COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"


def threads_per_rank(n: int) -> int:
    """The cores each of ``n`` ranks sharing this machine may use, at least 1: its intra-op threads and its compile
    workers."""
    return max(1, usable_cores() // n)


def rank_thread_environment(n: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a job of ``n`` ranks on this machine starts with so that they share its cores instead of each taking them
    all: OMP_NUM_THREADS (intra-op threads) and TORCHINDUCTOR_COMPILE_THREADS (compile workers), ``threads_per_rank``
    each; one that ``env`` (this process's environment) already sets is left out: a user's choice wins."""
    env = os.environ if env is None else env
    threads = str(threads_per_rank(n))
    return {name: threads for name in ("OMP_NUM_THREADS", COMPILE_THREADS) if name not in env}


def limit_rank_threads(threads: int) -> None:
    """Give this rank ``threads`` intra-op threads and at most ``threads`` compile workers (unless
    TORCHINDUCTOR_COMPILE_THREADS is set: a user's choice wins).

    Inductor reads the variable once, when ``torch._inductor.config`` is imported (``compile_threads =
    decide_compile_threads()``), and importing PhysicsNeMo imports it: the variable covers an import still to come
    (a fresh engine, which imports PhysicsNeMo after this), ``config.compile_threads`` one already done (a parked
    rank's reset)."""
    import sys

    import torch

    torch.set_num_threads(threads)
    if COMPILE_THREADS in os.environ:
        return
    os.environ[COMPILE_THREADS] = str(threads)
    if (config := sys.modules.get("torch._inductor.config")) is not None:
        config.compile_threads = threads


def visible_gpus() -> int:
    """GPUs CUDA can use in this process (after CUDA_VISIBLE_DEVICES): for ranks on this machine, theirs too.

    Before CUDA starts, torch counts GPUs with NVML, the driver's own library (torch 2.14.1 ``torch/cuda/__init__.py``,
    ``device_count``, lines 1231-1232): on a node whose driver is too old for the wheels that count is the node's GPUs,
    while ``is_available()`` (line 228) asks the CUDA runtime and says False. Such GPUs count as none here, and
    ``unusable_gpus`` says why."""
    import torch

    count = torch.cuda.device_count()
    return count if count and torch.cuda.is_available() else 0


# The oldest driver branch each CUDA major version runs on (NVIDIA's CUDA release notes, minor version compatibility).
CUDA_DRIVER_BRANCH = {"11": 450, "12": 525, "13": 580}


def unusable_gpus(cuda_gpus: int, env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> str:
    """Why CUDA cannot use GPUs this node has, as one message naming the driver found, the driver the installed torch
    wheels need and the GPU architectures they run on (and a GPU's own when they do not run on it); "" when the node
    has no GPU (nvidia-smi lists none; without nvidia-smi, the kernel driver's own list is empty), or when CUDA sees
    every GPU it should (``cuda_gpus``: torch's count; the node's GPUs, or as many as CUDA_VISIBLE_DEVICES selects)
    and the wheels run on each. Without this check, a driver too old for the wheels looks like a machine without
    GPUs: torch counts none, every job runs on CPU."""
    import shutil
    import subprocess

    import torch

    env = os.environ if env is None else env
    cuda, archs = torch.version.cuda, [a for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    branch = CUDA_DRIVER_BRANCH.get((cuda or "").split(".")[0], 0)
    wheels = (f"the torch {torch.__version__} wheels (CUDA {cuda}) need driver R{branch} or newer and run on GPUs "
              f"{', '.join(archs)}" if cuda else f"torch {torch.__version__} is built without CUDA")
    if (smi := shutil.which("nvidia-smi", path=env.get("PATH"))) is None:
        present = len(os.listdir(NVIDIA_DRIVER_GPUS)) if os.path.isdir(NVIDIA_DRIVER_GPUS) else 0
        if present and not cuda_gpus and env.get("CUDA_VISIBLE_DEVICES") is None:
            return (f"the NVIDIA driver found {present} GPU(s) on this node ({NVIDIA_DRIVER_GPUS}) but CUDA sees none, "
                    f"and nvidia-smi is not on PATH to say why; {wheels}. Put the driver's nvidia-smi on PATH (it "
                    "shows the driver's version) and update the driver if it is older than that.")
        return ""
    for fields in ("driver_version,compute_cap,name", "driver_version,name"):  # compute_cap: drivers R510 and newer
        try:
            smi_run = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                                     text=True, timeout=timeout_s)
            listed, said, failed = smi_run.stdout.strip(), (smi_run.stderr + smi_run.stdout).strip(), smi_run.returncode
        except (OSError, subprocess.TimeoutExpired) as error:  # a hung driver must not hang the caller
            listed, said, failed = "", str(error), True
            break
        if not failed or "No devices were found" in said:
            break
    if "No devices were found" in said or failed and cuda_gpus:  # no GPU; or CUDA works without nvidia-smi
        return ""
    if failed:
        return (f"nvidia-smi is installed but failed ({said.splitlines()[0] if said else 'no output'}) and CUDA "
                f"sees no GPU, so whatever GPUs this node has are unusable; {wheels}. Install or repair the NVIDIA "
                "driver; on a machine without GPUs, take nvidia-smi off PATH.")
    gpus = [[value.strip() for value in line.split(",", fields.count(","))] for line in listed.splitlines()]
    if not gpus:
        return ""
    driver, selected, mask = gpus[0][0], len(gpus), env.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        selected = 0
        for entry in map(str.strip, mask.split(",")):  # CUDA stops at the first entry that names no GPU here
            if not (entry.startswith(("GPU-", "MIG-")) or entry.isdigit() and int(entry) < len(gpus)):
                break
            selected = min(selected + 1, len(gpus))
    known = [gpu for gpu in gpus if len(gpu) == 3 and re.fullmatch(r"\d+\.\d+", gpu[1])]  # not "[N/A]"
    own = {f"{gpu[-1]} (sm_{gpu[1].replace('.', '')})" if gpu in known else gpu[-1]: gpu for gpu in gpus}
    foreign = [name for name, gpu in own.items() if gpu in known and not _built_for(gpu[1], archs)]
    if cuda_gpus >= selected and not (cuda and foreign):
        return ""
    if not cuda:
        fix = " Run `make env` to install the CUDA wheels of requirements.txt."
    elif not cuda_gpus and int(re.match(r"\d*", driver).group() or 0) < branch:
        fix = (f" Update the NVIDIA driver to R{branch} or newer, or pin torch wheels built for an older CUDA in "
               "requirements.in and run `make lock`.")
    elif foreign:
        fix = (f" The wheels have no code for {', '.join(foreign)}: use GPUs of {archs[0]} or newer, or pin torch "
               "wheels built for this GPU in requirements.in and run `make lock`.")
    else:
        fix = (" Driver and architectures fit, so something hides the GPUs from this process: a container started "
               "without them (docker run --gpus all), or /dev/nvidia* closed to this user.")
    chosen = f" of the {selected} that CUDA_VISIBLE_DEVICES={mask!r} selects" if mask is not None else ""
    joint = "but" if cuda_gpus < selected else "and"
    return (f"This node has {len(gpus)} GPU(s), {', '.join(own)}, {joint} CUDA sees {cuda_gpus}{chosen}: driver "
            f"{driver} is installed, and {wheels}.{fix}")


def _built_for(compute_cap: str, archs: Sequence[str]) -> bool:
    """Whether torch built for ``archs`` (``sm_XY``) has code for a GPU of ``compute_cap`` ("8.6"): a cubin runs on
    GPUs of its own major version and an equal or higher minor one (sm_80 code on sm_86, not on sm_75 nor sm_90)."""
    major, minor = map(int, compute_cap.split("."))
    return any(divmod(int(re.match(r"\d+", arch[3:]).group()), 10) in {(major, m) for m in range(minor + 1)}
               for arch in archs)
