"""`make lab-handout` opens in JupyterLab the folder `make handout` writes (and `make lab` the notebooks), read off
`make -n`, so no JupyterLab starts."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def dry_run(*args: str, makefile: Path | None = None) -> str:
    proc = subprocess.run(["make", "-n", "--no-print-directory", "-f", str(makefile or MAKEFILE), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def folder(pattern: str, commands: str) -> Path:
    found = re.findall(pattern, commands)
    assert len(found) == 1, f"{pattern!r} in:\n{commands}"
    return Path(found[0].rstrip("/"))


def handout_folder(commands: str) -> Path:
    return folder(r"-m shardlab\.tools\.handout \S+ (\S+)", commands)


def lab_folder(commands: str) -> Path:
    return folder(r"/jupyter lab (\S+)", commands)


def check(makefile: Path | None = None) -> None:
    handout = handout_folder(dry_run("handout", makefile=makefile))
    both = dry_run("lab-handout", makefile=makefile)
    assert handout_folder(both) == handout and lab_folder(both) == handout
    assert both.index("shardlab.tools.handout") < both.index("jupyter lab"), "the handout is built before it opens"
    assert lab_folder(dry_run("lab", makefile=makefile)) == Path("notebooks")
    assert lab_folder(dry_run("lab", f"LAB_DIR={handout}/", makefile=makefile)) == handout


def test_lab_handout_opens_the_folder_make_handout_writes():
    check()


def test_the_folder_lab_handout_opens_holds_every_notebook_without_solutions(tmp_path):
    from shardlab.tools.handout import make_handout

    opened = tmp_path / lab_folder(dry_run("lab-handout"))
    written = make_handout(ROOT / "notebooks", opened)
    assert sorted(p.name for p in written) == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(opened.glob("*.ipynb")) == sorted(written)
