"""Slurm, read and asked: its compact node lists as host names (what ``workarounds.slurm_rendezvous_address`` reads to
find a step's first node), and this user's jobs found by name and cancelled. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time


def slurm_hostnames(nodelist: str) -> list[str]:
    """The host names of a Slurm node list ('node[01-04,07]'): ``scontrol show hostnames`` where scontrol is on
    PATH, else ``expand_nodelist``. ValueError when neither can read it."""
    if scontrol := shutil.which("scontrol"):
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass  # the parser below reads the common syntax
    return expand_nodelist(nodelist)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact node list as host names, in order, for the common syntax: names, commas, and brackets of
    numbers and ranges, zero-padded as written ('node[01-03,07],gpu[1-2]-ib' -> node01, node02, node03, node07,
    gpu1-ib, gpu2-ib). ValueError for anything else."""
    pattern = r"(?:[^,\[\]]+|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+"
    if not re.fullmatch(rf"{pattern}(?:,{pattern})*", nodelist):
        raise ValueError(f"not a Slurm node list this parser reads: {nodelist!r}")
    hosts = []
    for name in re.findall(pattern, nodelist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]+)|\[([^\]]*)\]", name):
            choices = [text] if text else [number for each in ranges.split(",") for number in _numbers(each)]
            expanded = [head + tail for head in expanded for tail in choices]
        hosts += expanded
    return hosts


def _numbers(spec: str) -> list[str]:
    """'07' -> ['07']; '01-03' -> ['01', '02', '03'] (the width of the first bound, as Slurm pads)."""
    low, _, high = spec.partition("-")
    if int(high or low) < int(low):
        raise ValueError(f"a descending range in a Slurm node list: [{spec}]")
    return [str(number).zfill(len(low)) for number in range(int(low), int(high or low) + 1)]


def slurm_jobs_named(name: str) -> list[str]:
    """Ids of this user's Slurm jobs called ``name`` still in the queue (none without Slurm)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return []
    try:
        out = subprocess.run([squeue, "-h", "-u", str(os.getuid()), "-n", name, "-o", "%i"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split() if out.returncode == 0 else []


def cancel_slurm_jobs(job_ids: list[str], name: str, wait_s: float = 30.0) -> list[str]:
    """Cancel the recorded jobs that are still queued under ``name`` (a job id alone could be someone else's
    by now) and wait until they have left the queue; return those still there after ``wait_s``."""
    mine = [job for job in job_ids if job in slurm_jobs_named(name)]
    if not mine:
        return []
    subprocess.run([shutil.which("scancel") or "scancel", *mine], capture_output=True, timeout=30)
    deadline = time.monotonic() + wait_s
    while (left := [job for job in mine if job in slurm_jobs_named(name)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
