"""Each exercise check's ✓ or ✗, written for the instructor's class view, only where the instructor set one up.

Opt-in: nothing is written unless ``SHARDLAB_CLASS_DIR`` names a folder that exists (the instructor makes it, writable
by the learners: INSTRUCTORS.md, "Who is stuck"). Each learner appends to a file of their own, one JSON line a check:
who (``JUPYTERHUB_USER`` on a hub, else the account), the notebook (``JPY_SESSION_NAME``, which Jupyter sets for
a notebook's kernel), the exercise, and whether it passed, or that its reference answer was revealed
(``sl.exercises.reveal``). ``python -m shardlab.tools.class_view`` reads the folder.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import time
from pathlib import Path

CLASS_DIR = "SHARDLAB_CLASS_DIR"


def learner() -> str:
    return os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def notebook() -> str:
    """The running notebook's file name, where Jupyter says it; "" elsewhere (a script, a test)."""
    return Path(os.environ.get("JPY_SESSION_NAME", "")).name


def record(exercise: str, passed: bool, revealed: bool = False) -> Path | None:
    """Append this check's result (or, ``revealed``, that the learner asked for the reference answer) to this learner's
    file in the class folder; None when there is no class folder. A failure to write never fails the learner's check:
    the class view is the instructor's, not the lesson's."""
    folder = os.environ.get(CLASS_DIR)
    if not folder or not os.path.isdir(folder):
        return None
    who = learner()
    path = Path(folder) / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', who)}.jsonl"
    entry = {"learner": who, "notebook": notebook(), "exercise": exercise, "passed": passed, "time": time.time()}
    line = json.dumps(entry | ({"revealed": True} if revealed else {}))
    try:  # one write of one line with O_APPEND: lines of two kernels of one learner do not interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        return None
    return path


def read_class(folder: Path) -> list[dict]:
    """Every record in the class folder, oldest first; a line that is not a record is skipped."""
    records = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and {"learner", "exercise", "passed"} <= entry.keys():
                records.append(entry)
    return sorted(records, key=lambda r: r.get("time", 0))
