"""The owner-only folders shardlab trusts and creates: this user's registry of clusters, and their profile folders.

A folder is trusted only if it is a plain folder of this user's, closed to others; a profile folder is deleted only
if this package created it (our name prefix, ours, with the marker file written at creation). Standard library only.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def user_id() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def profile_prefix() -> str:
    """Name prefix of the profile folders clusters create in the system temp folder (one per user)."""
    return f"shardlab-{user_id()}-"


class UnsafeFolder(RuntimeError):
    """A folder shardlab would trust belongs to someone else or is open to others; the message says what to do."""


def check_owner_only(path: Path) -> None:
    """Refuse a folder that is not a plain folder of this user's, closed to others (UnsafeFolder says why)."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UnsafeFolder(f"{path} is not a plain folder: remove it, shardlab will recreate it.")
    if info.st_uid != user_id():
        raise UnsafeFolder(f"{path} belongs to user id {info.st_uid}, not to you ({user_id()}): shardlab will not "
                           "trust records there. Set SHARDLAB_REGISTRY to a folder of yours.")
    if info.st_mode & 0o077:
        raise UnsafeFolder(f"{path} is open to other users (mode {info.st_mode & 0o777:o}): run chmod 700 on it, or "
                           "remove it.")


def registry_name() -> str:
    """The name of this user's registry folder in the temp folder."""
    return f"shardlab-{user_id()}-registry"


def registry() -> Path:
    """This user's registry folder (``$SHARDLAB_REGISTRY``, else one per user in the temp folder), owner-only."""
    path = Path(os.environ.get("SHARDLAB_REGISTRY") or Path(tempfile.gettempdir()) / registry_name())
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_owner_only(path)
    return path


PROFILE_MARKER = ".shardlab-profile"  # written into every profile folder at creation: its own path


def created_profile_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a profile folder this package created: our name prefix, a plain folder of ours,
    holding the marker file (ours too) that names this very folder. Wherever it lives (the temp folder, or a
    shared folder every node of a job can read), nothing else is ever deleted."""
    path = Path(path)
    try:
        info, marker = path.lstat(), (path / PROFILE_MARKER).lstat()
        named = (path / PROFILE_MARKER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return (path.is_absolute() and path.name.startswith(profile_prefix()) and stat.S_ISDIR(info.st_mode)
            and info.st_uid == user_id() and stat.S_ISREG(marker.st_mode) and marker.st_uid == user_id()
            and named == str(path))


def make_profile_dir(cluster_id: str, root: str | os.PathLike | None = None) -> str:
    """A new owner-only profile folder for one cluster (connection files hold its encryption keys), in the temp
    folder, or in ``root`` (e.g. a shared home or scratch folder that every node of a Slurm job can read)."""
    if root is not None:
        root = Path(root).expanduser().absolute()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{profile_prefix()}{cluster_id}-", dir=root))  # mkdtemp makes it 0700
    (path / PROFILE_MARKER).write_text(str(path))
    return str(path)
