"""Waiting for a cluster's processes to end once their owner is gone (shardlab.ranks.warden): the bound, and what
still runs when it passes."""

import time

import psutil

from shardlab.ranks import owned

ENDS_WITHIN_S = 10.0  # after the owner's death


def running(processes: list[tuple[int, float]]) -> list[str]:
    """The recorded processes still running (zombies excluded), described."""
    out = []
    for proc in owned.alive(processes):
        try:
            out.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
        except psutil.Error:
            pass
    return out


def wait_gone(processes: list[tuple[int, float]], since: float) -> list[str]:
    """Poll until none of ``processes`` runs, at most until ``since`` + ENDS_WITHIN_S; what still runs then."""
    while (left := running(processes)) and time.monotonic() < since + ENDS_WITHIN_S:
        time.sleep(0.1)
    return left
