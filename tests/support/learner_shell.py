"""A learner's shell for the Makefile's targets: HOME of the test's choosing, and what `make print-env` exports.
Used by tests/unit/test_home.py and tests/system/test_home_lab.py."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the Makefile points into .state, and the tools that read each (checked in their sources: jupyter_core.paths,
# jupyterlab.commands, IPython.paths, matplotlib.get_configdir, warp.config, triton.knobs, pip, uv, npm; CUDA's
# documented CUDA_CACHE_PATH).
EXPORTED = ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR",
            "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR", "MPLCONFIGDIR", "WARP_CACHE_PATH", "TRITON_HOME",
            "CUDA_CACHE_PATH", "PIP_CACHE_DIR", "UV_CACHE_DIR", "npm_config_cache")


def learners_environment(home: Path) -> dict:
    """A learner's shell: HOME is ``home``, and none of the folders this test session points elsewhere (conftest.py
    sends IPython's, Jupyter's runtime and matplotlib's to the temp folder) is set: only the Makefile's count."""
    unset = ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV", "SHARDLAB_WARM_POOL", *EXPORTED)
    return {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("JUPYTER")} | {"HOME": str(home)}


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def make_exports(env: dict | None = None) -> dict[str, str]:
    out = make("-s", "print-env", env=env)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())
