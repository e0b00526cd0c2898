"""Where the ranks of a test that starts a fixed number of them run on this machine: decided here, once, from
shardlab.ranks.devices' rule and the GPUs this machine has, so that `make test` passes on a laptop and on a workstation
with 1, 2, 3, 4 or 8 GPUs alike (tests/gpu/test_gpu_workstation.py checks every entry of ``NEEDS`` for each count).

A test is one of two kinds:

- about CPU ranks (``cpu=True``): gloo, byte counts and predictions that are CPU-specific. Its ranks run on the CPU on
  every machine, on purpose: ``device="cpu"`` where the call takes a device (``run_job``, ``RankCluster``), and
  ``env`` (the GPUs hidden: CUDA_VISIBLE_DEVICES="") for a process that places its ranks itself (a command-line
  tool, a notebook's kernel): ranks that see no GPU are CPU ranks;
- about the program at a world size (``cpu=False``): its ranks run where the rule puts them (one GPU each when there
  are enough; CPU ranks with no GPU or one), and where the rule refuses them (2 to n-1 GPUs: NCCL needs a GPU per
  rank) on CPU ranks, the GPUs hidden: the program is rehearsed at that size all the same.

CPU ranks beyond the series' limit per core (``SHARDLAB_MAX_RANKS_PER_CORE``) would be refused by the launch path:
the test is skipped with that refusal, which says what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from shardlab.ranks import commands, devices, launch
from shardlab.ranks.devices import DeviceError, place_ranks

HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}  # what a kernel or CLI honours: its ranks see no GPU, so they are CPU ranks


@dataclass(frozen=True)
class Ranks:
    """Where a test's ``n`` ranks run with ``gpus`` GPUs here: ``device`` ("cpu" or "cuda"; None when skipped), why
    (``why``, or ``skip``: the reason, saying what it needs), and ``env`` for a process that places them itself."""

    n: int
    gpus: int
    device: str | None
    why: str
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None

    def or_skip(self) -> Ranks:
        """This decision, or the test skipped with its reason."""
        if self.skip:
            pytest.skip(self.skip)
        return self


def ranks_for_test(n: int, *, cpu: bool = False, gpus: int | None = None) -> Ranks:
    """Where ``n`` ranks of a test run on a machine whose ranks see ``gpus`` GPUs (default: this one's):
    ``cpu=True`` for a test about CPU ranks (module docstring)."""
    gpus = devices.visible_gpus() if gpus is None else gpus
    if cpu:
        why, env = "CPU ranks on purpose: the test is about CPU ranks", dict(HIDE_GPUS)
    else:
        try:
            placement = place_ranks(n, gpus)
        except DeviceError:
            why = (f"{n} ranks on {gpus} GPUs are refused (NCCL needs one GPU per rank): the program is rehearsed on "
                   f"{n} CPU ranks, the GPUs hidden")
            env = dict(HIDE_GPUS)
        else:
            if placement.device == "cuda":
                return Ranks(n, gpus, "cuda", placement.why)
            why, env = placement.why, {}  # one GPU: CPU ranks by the rule, and one-rank work keeps the GPU
    try:
        commands.check_ranks_per_core(n, devices.usable_cores())
    except ValueError as refused:
        return Ranks(n, gpus, None, why, skip=f"needs {n} CPU ranks ({why}), which this machine refuses: {refused}")
    return Ranks(n, gpus, "cpu", why, env)


@dataclass(frozen=True)
class Need:
    """A test that starts a fixed number of ranks: its file and function, the world sizes it runs, whether it is
    about CPU ranks, and why. The test takes its decision from ``ranks``; a size not listed here is refused."""

    file: str
    test: str
    sizes: tuple[int, ...]
    cpu: bool
    about: str

    def ranks(self, n: int | None = None, gpus: int | None = None) -> Ranks:
        n = self.sizes[0] if n is None else n
        if n not in self.sizes:
            raise ValueError(f"{self.file}::{self.test} runs {n} ranks: add {n} to its Need in "
                             "tests/support/world_sizes.py")
        return ranks_for_test(n, cpu=self.cpu, gpus=gpus)


SMOKE = Need("multirank/test_smoke.py", "test_distributed_checks_pass_on_every_rank", (4,), cpu=True,
             about="the smoke CLI's checks on OpenMPI CPU ranks (gloo); on CUDA ranks: make gpu-check")
MEASURE = Need("multirank/test_measure_on_ranks.py",
               "test_measurement_script_on_four_ranks_one_job_for_three_tables", (4,), cpu=True,
               about="byte ratios measured on CPU ranks; the CUDA tables: make gpu-check")
PLANNER = Need("multirank/test_plan_measured.py",
               "test_predictions_match_the_measured_ranks_and_the_step_peaks_the_allocators", (4,), cpu=True,
               about="the planner's CPU-specific predictions against CPU allocators and gloo")
DEFAULT_SIZE = Need("unit/test_cluster.py", "test_shardlab_ranks_picks_the_default_size", (2, 8), cpu=True,
                    about="the size SHARDLAB_RANKS picks, not the device")
NOTEBOOK_SIZES = Need("notebooks/test_notebooks.py", "test_notebook_runs_at_other_world_sizes", (2, 8), cpu=False,
                      about="each lesson at 2 and 8 ranks: on the GPUs where they can hold them, else CPU ranks")
NEEDS = (SMOKE, MEASURE, PLANNER, DEFAULT_SIZE, NOTEBOOK_SIZES)


def run_job_unstarted(monkeypatch, n: int, launcher: str = "torchrun", device: str = "auto"):
    """What ``launch.run_job`` decides for ``n`` ranks, without starting them: its placement, and the environment
    it would start them with."""
    seen = {}

    def fake_run(cmd, env, timeout_s, what, capture=True):
        seen["env"] = env
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(launch.subprocesses, "run_process_group", fake_run)
    monkeypatch.setattr(launch, "job_command", lambda *args, **kwargs: ["true"])
    job = launch.run_job(launcher, n, "shardlab.tools.smoke", timeout_s=1, device=device)
    return job.placement, seen["env"]
