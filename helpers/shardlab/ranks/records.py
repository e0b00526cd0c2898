"""Each cluster's record: who owns it, what it started (processes, Slurm jobs, profile folder), and its clean-up.

Each cluster writes a record into a registry folder that belongs to this user alone and is checked before it is
trusted (``folders``). A cluster's warden (``warden``) stops it once its kernel died, and a later ``start_cluster``
what a killed warden left; both ignore records they did not write, cancel only Slurm jobs named after the recorded
cluster (``slurm``), and delete only profile folders this package created.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .folders import created_profile_dir, registry, user_id
from .owned import alive, identity, same_process, stop
from .slurm import cancel_slurm_jobs


@dataclass
class Record:
    """One cluster's entry in the registry: who owns it, what it started, what it created."""

    cluster_id: str
    owner_pid: int
    owner_created: float
    profile_dir: str
    processes: list = field(default_factory=list)
    jobs: list = field(default_factory=list)  # Slurm job ids (engines submitted with sbatch)
    job_name: str = ""  # what those jobs are called: a job is cancelled only if its id still carries this name
    folder: str = ""  # where the record is kept: the registry, or a pool of warm clusters (shardlab.ranks.warm)

    @classmethod
    def for_this_kernel(cls, cluster_id: str, profile_dir: str, job_name: str = "", folder: str = "") -> Record:
        return cls(cluster_id, *identity(), profile_dir, job_name=job_name, folder=folder)

    @property
    def path(self) -> Path:
        return Path(self.folder or registry()) / f"{self.cluster_id}.json"

    def save(self) -> None:
        if self.folder and not Path(self.folder).is_dir():
            return  # a pool of warm clusters that was stopped took its records, and what they name, with it
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, self.path)  # never a half-written record

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def owner_alive(self) -> bool:
        return same_process(self.owner_pid, self.owner_created) is not None

    def clean_up(self, grace_s: float = 3.0) -> None:
        """Cancel the recorded Slurm jobs, stop the recorded processes, delete the profile folder if we created
        it, drop the record."""
        if self.jobs and self.job_name:
            cancel_slurm_jobs([str(job) for job in self.jobs], self.job_name)
        stop(alive([tuple(p) for p in self.processes]), grace_s)
        if created_profile_dir(self.profile_dir):
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self.remove()


def load_record(path: Path) -> Record | None:
    """The record at ``path``, if it is a plain file of this user's that holds one (else None: not ours)."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != user_id():
            return None
        return Record(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def records_in(folder: Path | None = None) -> list[Record]:
    """The records in ``folder`` (default: this user's registry); files that are not records we wrote are left
    alone."""
    return [r for r in map(load_record, sorted(Path(folder or registry()).glob("*.json"))) if r is not None]


def clean_stale_clusters(folder: Path | None = None) -> int:
    """Stop the clusters of this user's kernels that are gone (records in ``folder``, default: the registry);
    return how many were cleaned."""
    cleaned = 0
    for record in records_in(folder):
        if not record.owner_alive():
            record.clean_up()
            cleaned += 1
    return cleaned
