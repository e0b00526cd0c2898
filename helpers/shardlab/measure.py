"""Measure layer: wall-clock and byte figures taken live, side by side in one run.

Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .cluster import find_mpiexec, mpi_arguments, mpi_environment


def bare_mpiexec_seconds(n: int = 4, code: str = "import physicsnemo", timeout_s: float = 180.0) -> float:
    """Seconds for ``mpiexec -n n python -c code``: the floor under any MPI cluster start."""
    cmd = [find_mpiexec(), "-n", str(n), *mpi_arguments(n), sys.executable, "-c", code]
    env = os.environ | mpi_environment()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"mpiexec -n {n} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0
