"""`make env` (what `make lab` and `make test` run first): the interpreter is checked before .venv exists, with
one message that says which Python is needed and how to pass one; an install that fails leaves no .venv that the
next `make` would reuse."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Python 3.10.12 as far as any check can tell: the real interpreter with the version it reports changed, so that
# the Makefile's own test of the version is what refuses it.
PYTHON_310 = f"""#!{sys.executable}
import platform, runpy, sys
sys.version_info = (3, 10, 12, "final", 0)
sys.version = "3.10.12 (main)"
platform.python_version = lambda: "3.10.12"
option, what, *rest = sys.argv[1:]
sys.argv = [what, *rest]
exec(what) if option == "-c" else runpy.run_module(what, run_name="__main__")
"""
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def make(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k not in ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("how", ["python3 on PATH", "PYTHON="])
def test_a_wrong_python_is_refused_before_venv_exists_with_what_to_pass(tmp_path, how):
    fake = tmp_path / "bin" / ("python3" if how == "python3 on PATH" else "python3.10")
    fake.parent.mkdir()
    fake.write_text(PYTHON_310)
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    if how == "PYTHON=":
        out = make("env", f"VENV={venv}", f"PYTHON={fake}")
    else:
        out = make("env", f"VENV={venv}", env=os.environ | {"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert out.returncode != 0
    shown = "python3" if how == "python3 on PATH" else fake
    assert f"make: {venv} needs Python 3.11, but PYTHON={shown} is Python 3.10.12. Pass one: make env " \
           "PYTHON=python3.11 (or PYTHON=/path/to/python3.11)." in out.stderr, out.stderr
    assert not venv.exists(), "the environment was created with the wrong Python"


def test_an_interpreter_that_does_not_run_is_refused_the_same_way(tmp_path):
    out = make("test-fast", f"VENV={tmp_path / 'venv'}", "PYTHON=python3.10-not-here")
    assert "needs Python 3.11, but PYTHON=python3.10-not-here is not a Python that runs. Pass one: make test-fast " \
           "PYTHON=python3.11" in out.stderr, out.stderr
    assert out.returncode != 0 and not (tmp_path / "venv").exists()


def test_a_failed_install_leaves_no_environment_that_the_next_make_reuses(tmp_path):
    """A copy of the repository whose lock cannot be installed: the first `make env` fails after creating .venv,
    the second finds it incomplete and makes it again from scratch; a complete one (its stamp written last) is
    reused, and an update of it that fails leaves it marked incomplete."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "helpers").mkdir()
    shutil.copy(ROOT / "helpers" / "pyproject.toml", tmp_path / "helpers")
    broken = "no-such-package-shardlab==0.0.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    (tmp_path / "requirements.txt").write_text(broken)
    env = os.environ | OFFLINE | {"PIP_FIND_LINKS": str(tmp_path / "no-wheels")}
    venv, stamp = tmp_path / ".venv", tmp_path / ".venv" / ".installed"

    first = make("env", cwd=tmp_path, env=env)
    assert first.returncode != 0 and "no-such-package-shardlab" in first.stderr, first.stderr[-2000:]
    assert (venv / "bin" / "python").exists() and not stamp.exists()
    (venv / "left-by-the-failed-install").touch()

    second = make("env", cwd=tmp_path, env=env)
    assert "make: .venv is incomplete (an earlier install did not finish): making it again" in second.stderr
    assert second.returncode != 0 and not (venv / "left-by-the-failed-install").exists()
    assert (venv / "bin" / "python").exists() and not stamp.exists()

    stamp.touch()  # as a complete install leaves it
    assert make("env", cwd=tmp_path, env=env).returncode == 0

    os.utime(tmp_path / "requirements.txt", (stamp.stat().st_mtime + 10,) * 2)  # the lock changed: an update
    update = make("env", cwd=tmp_path, env=env)
    assert update.returncode != 0 and "incomplete" not in update.stderr  # the complete one was updated in place
    assert not stamp.exists(), "a failed update left the environment marked complete"
