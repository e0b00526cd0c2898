"""What the Makefile exports and `make lab` takes, without starting it: every folder goes to the checkout's .state/
(which git ignores), PORT/IP/BROWSER come from the command line only, `make kernel-user` installs into the user's
data folder, and JupyterLab's news pop-up is switched off by a setting it has. `make lab` with a kernel and ranks:
tests/system/test_home_lab.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

from learner_shell import EXPORTED, learners_environment, make, make_exports

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".state"
NEWS = "@jupyterlab/apputils-extension:notification"


def test_make_exports_every_folder_into_the_checkouts_state_which_git_ignores(tmp_path):
    exported = make_exports(learners_environment(tmp_path) | {"JUPYTER_CONFIG_DIR": str(tmp_path / "mine")})
    assert sorted(exported) == sorted(EXPORTED)
    for name, value in exported.items():
        assert Path(value).is_relative_to(STATE), f"{name}={value} is not in {STATE}"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".state/jupyter/x"], cwd=ROOT)
    assert ignored.returncode == 0, ".state/ is not ignored by git"


def test_make_lab_takes_port_address_and_no_browser_from_its_command_line_only():
    line = make("-n", "lab", "PORT=8899", "IP=0.0.0.0", "BROWSER=no").stdout
    assert "--ServerApp.port=8899 --ServerApp.port_retries=0 --ServerApp.ip=0.0.0.0 --no-browser" in line, line
    # BROWSER and PORT in the environment mean other things (Python's webbrowser, a platform's port): not read.
    plain = make("-n", "lab", env=os.environ | {"BROWSER": "no", "PORT": "1", "IP": "1.2.3.4"}).stdout
    assert "--no-browser" not in plain and "--ServerApp.port" not in plain and "1.2.3.4" not in plain, plain


def test_kernel_user_keeps_installing_into_the_users_own_data_folder():
    """The one command that writes into the home folder: with the user's JUPYTER_DATA_DIR unset, .state's is unset
    for it (ipykernel then installs into ~/.local/share/jupyter/kernels); set, it is the user's."""
    plain = make("-n", "kernel-user", env=learners_environment(Path("/nonexistent"))).stdout
    assert "env -u JUPYTER_DATA_DIR " in plain and "--user" in plain, plain
    mine = make("-n", "kernel-user", env=os.environ | {"JUPYTER_DATA_DIR": "/srv/mine"}).stdout
    assert "env JUPYTER_DATA_DIR=/srv/mine " in mine, mine


def test_the_news_pop_up_is_switched_off_by_a_setting_jupyterlab_has():
    overrides = json.loads((ROOT / "lab-config" / "overrides.json").read_text())
    assert overrides == {NEWS: {"fetchNews": "false"}}
    plugin, _, file = NEWS.partition(":")
    schema_file = Path(sys.prefix) / "share/jupyter/lab/schemas" / plugin / f"{file}.json"
    schema = json.loads(schema_file.read_text())
    allowed = [choice["const"] for choice in schema["properties"]["fetchNews"]["oneOf"]]
    assert "false" in allowed, allowed  # "false" is "Never": no question, no request to a website
    # `make env` installed it as the overrides of the JupyterLab that .venv runs, where JupyterLab reads them.
    from jupyterlab.commands import get_app_dir
    from jupyterlab_server.settings_utils import _get_overrides

    installed, error = _get_overrides(str(Path(get_app_dir()) / "settings"))
    assert not error and installed.get(NEWS) == overrides[NEWS], (installed, error)
