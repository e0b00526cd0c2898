"""What a test run changed on this machine outside the checkout and the temp folder.

conftest.py takes a snapshot when a run starts and compares at its end: installed packages (dpkg's
status file), every file under /etc, whether the other system folders scripts/local-slurm.sh makes exist
(what is in them is the running daemons' spool and logs, which change while a Slurm that was up before
runs jobs), and daemons running (processes whose program lives in an sbin folder: munged, slurmctld...).
Without SHARDLAB_SYSTEM_SETUP=1 (``make test-system``) any difference fails the run; with it, the run
may set the machine up (apt-get, /etc/slurm, /etc/munge, a single-node Slurm) and lists what it did.

SHARDLAB_MACHINE_ROOT stands in for ``/`` (tests/unit/test_machine_changes.py plants changes under one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SYSTEM_SETUP = "SHARDLAB_SYSTEM_SETUP"
ROOT_VARIABLE = "SHARDLAB_MACHINE_ROOT"
# Every file under these; of the folders scripts/local-slurm.sh makes elsewhere, whether they exist.
WATCHED = ("etc",)
MADE_BY_THE_SET_UP = ("run/shardlab-slurm", "var/spool/slurmctld", "var/spool/slurmd", "var/log/slurm", "run/munge",
                      "var/lib/munge", "var/log/munge")
SBIN = ("usr/sbin", "sbin", "usr/local/sbin")
DPKG_STATUS = "var/lib/dpkg/status"


def setup_allowed() -> bool:
    """Whether this run may install packages, write system files and start daemons (``make test-system``)."""
    return os.environ.get(SYSTEM_SETUP) == "1"


def machine_root() -> Path:
    return Path(os.environ.get(ROOT_VARIABLE) or "/")


@dataclass
class Snapshot:
    packages: dict[str, str] = field(default_factory=dict)  # "name:arch" -> version, installed ones only
    files: dict[str, tuple] = field(default_factory=dict)  # path -> (kind, size, mtime_ns, mode, uid, link target)
    daemons: dict[int, str] = field(default_factory=dict)  # pid -> program


def installed_packages(status_file: Path) -> dict[str, str]:
    """dpkg's view, read from its status file (no dpkg needed; empty where there is none)."""
    try:
        text = status_file.read_text(errors="replace")
    except OSError:
        return {}
    packages = {}
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line[0].isspace())
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            packages[f"{fields['Package']}:{fields.get('Architecture', '')}"] = fields.get("Version", "")
    return packages


def files_under(root: Path, folders=WATCHED, only_the_folder=MADE_BY_THE_SET_UP) -> dict[str, tuple]:
    """Every file, folder and link under ``folders`` (as far as this user can read them), and whether each of
    ``only_the_folder`` exists."""
    seen = {}

    def record(path: str) -> None:
        try:
            st = os.lstat(path)
        except OSError:
            return
        link = os.readlink(path) if os.path.islink(path) else None
        kind = "link" if link is not None else "dir" if os.path.isdir(path) else "file"
        # A folder's size and mtime change with what is in it; its entries are recorded on their own.
        size, mtime = (None, None) if kind == "dir" else (st.st_size, st.st_mtime_ns)
        seen[path] = (kind, size, mtime, st.st_mode, st.st_uid, link)

    for folder in only_the_folder:
        if os.path.isdir(root / folder):
            seen[str(root / folder)] = ("dir",)
    for folder in folders:
        top = str(root / folder)
        record(top)
        for parent, dirs, names in os.walk(top):
            for name in dirs + names:
                record(os.path.join(parent, name))
    return seen


def daemons_running(root: Path) -> dict[int, str]:
    """pid -> program of every process whose program is in an sbin folder of ``root``."""
    sbin = tuple(str(root / folder) + "/" for folder in SBIN)
    running = {}
    for proc in psutil.process_iter(["exe", "cmdline"]):
        program = proc.info["exe"] or next(iter(proc.info["cmdline"] or []), "")
        if not program.startswith("/"):  # another user's process, started by name: find it in the sbin folders
            program = next((d + program for d in sbin if program and os.path.exists(d + program)), program)
        if program.startswith(sbin):
            running[proc.pid] = program
    return running


def snapshot() -> Snapshot:
    root = machine_root()
    return Snapshot(installed_packages(root / DPKG_STATUS), files_under(root), daemons_running(root))


def compare(before: Snapshot, after: Snapshot) -> list[str]:
    """What changed, one phrase per kind of change (empty when nothing did)."""
    changes = []

    def listed(what: str, names) -> None:
        names = sorted(names)
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            changes.append(f"{what} {shown}")

    listed("installed", (p for p in after.packages if p not in before.packages))
    listed("removed", (p for p in before.packages if p not in after.packages))
    listed("upgraded", (p for p in after.packages if p in before.packages and after.packages[p] != before.packages[p]))
    listed("created", (f for f in after.files if f not in before.files))
    listed("deleted", (f for f in before.files if f not in after.files))
    listed("modified", (f for f in after.files if f in before.files and after.files[f] != before.files[f]))
    still = [pid for pid in after.daemons if pid not in before.daemons and psutil.pid_exists(pid)]
    listed("started daemons", (f"{after.daemons[pid]} (pid {pid})" for pid in still))
    return changes
