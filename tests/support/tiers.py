"""A test folder's name says how long its tests take: tests/unit holds tests of seconds without ranks (what
`make test-fast`, ``-m unit``, runs, with the simulated-GPU tests of tests/gpu); tests/multirank, tests/notebooks and
tests/system hold only tests that start ranks, a notebook or more of the machine. conftest.py refuses, at collection,
a test in one of those that would be marked ``unit``."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SLOW_FOLDERS = ("multirank", "notebooks", "system")


def in_a_slow_folder(path: Path) -> bool:
    """Whether ``path`` (a test file) lies in one of the folders of slower tests."""
    try:
        return Path(path).resolve().relative_to(TESTS).parts[0] in SLOW_FOLDERS
    except ValueError:  # outside tests/: a notebook run with --nbmake, a test written to a temporary folder
        return False
