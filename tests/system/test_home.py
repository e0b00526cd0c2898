"""`make lab` and `make test` write nothing outside the checkout and the temp folder: what Jupyter, JupyterLab,
IPython, matplotlib, Warp, Triton, CUDA, pip, uv and npm keep goes to the checkout's .state/ (the Makefile exports
their folders). `make lab` is headless and remote on request (PORT, IP, BROWSER=no), stops with Ctrl-C twice,
its pool of warm ranks with it, and opens without JupyterLab's news pop-up (lab-config/overrides.json, installed
into .venv)."""

import json
import os
import pty
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".state"
# What the Makefile points into .state, and the tools that read each (checked in their sources: jupyter_core.paths,
# jupyterlab.commands, IPython.paths, matplotlib.get_configdir, warp.config, triton.knobs, pip, uv, npm; CUDA's
# documented CUDA_CACHE_PATH).
EXPORTED = ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR",
            "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR", "MPLCONFIGDIR", "WARP_CACHE_PATH", "TRITON_HOME",
            "CUDA_CACHE_PATH", "PIP_CACHE_DIR", "UV_CACHE_DIR", "npm_config_cache")
NEWS = "@jupyterlab/apputils-extension:notification"


def _learners_environment(home: Path) -> dict:
    """A learner's shell: HOME is ``home``, and none of the folders this test session points elsewhere (conftest.py
    sends IPython's, Jupyter's runtime and matplotlib's to the temp folder) is set: only the Makefile's count."""
    unset = ("MAKEFLAGS", "MAKELEVEL", "VIRTUAL_ENV", "SHARDLAB_WARM_POOL", *EXPORTED)
    return {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("JUPYTER")} | {"HOME": str(home)}


def _make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _exported(env: dict | None = None) -> dict[str, str]:
    out = _make("-s", "print-env", env=env)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def _files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_make_exports_every_folder_into_the_checkouts_state_which_git_ignores(tmp_path):
    exported = _exported(_learners_environment(tmp_path) | {"JUPYTER_CONFIG_DIR": str(tmp_path / "mine")})
    assert sorted(exported) == sorted(EXPORTED)
    for name, value in exported.items():
        assert Path(value).is_relative_to(STATE), f"{name}={value} is not in {STATE}"
    ignored = subprocess.run(["git", "check-ignore", "-q", ".state/jupyter/x"], cwd=ROOT)
    assert ignored.returncode == 0, ".state/ is not ignored by git"


def test_make_lab_takes_port_address_and_no_browser_from_its_command_line_only():
    line = _make("-n", "lab", "PORT=8899", "IP=0.0.0.0", "BROWSER=no").stdout
    assert "--ServerApp.port=8899 --ServerApp.port_retries=0 --ServerApp.ip=0.0.0.0 --no-browser" in line, line
    # BROWSER and PORT in the environment mean other things (Python's webbrowser, a platform's port): not read.
    plain = _make("-n", "lab", env=os.environ | {"BROWSER": "no", "PORT": "1", "IP": "1.2.3.4"}).stdout
    assert "--no-browser" not in plain and "--ServerApp.port" not in plain and "1.2.3.4" not in plain, plain


def test_kernel_user_keeps_installing_into_the_users_own_data_folder():
    """The one command that writes into the home folder: with the user's JUPYTER_DATA_DIR unset, .state's is unset
    for it (ipykernel then installs into ~/.local/share/jupyter/kernels); set, it is the user's."""
    plain = _make("-n", "kernel-user", env=_learners_environment(Path("/nonexistent"))).stdout
    assert "env -u JUPYTER_DATA_DIR " in plain and "--user" in plain, plain
    mine = _make("-n", "kernel-user", env=os.environ | {"JUPYTER_DATA_DIR": "/srv/mine"}).stdout
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, body: dict | None = None):
    request = urllib.request.Request(f"{base}{path}?token={token}", method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"null")


IN_THE_KERNEL = """
import io, os
import matplotlib.pyplot as plt
import shardlab as sl
cluster = sl.start_cluster(n=2, device="cpu")
cluster.run("import torch.distributed")
print("ranks", sorted(cluster.client.ids))
cluster.stop()  # under `make lab`: parked in the pool, stopped when JupyterLab exits
plt.plot([0, 1]); plt.savefig(io.BytesIO())  # matplotlib's font cache
print("HOME", os.environ["HOME"], "IPYTHONDIR", os.environ.get("IPYTHONDIR"))
"""


@pytest.mark.multirank
def test_make_lab_with_a_kernel_and_ranks_writes_nothing_into_the_home_folder(tmp_path, no_leftovers):
    """The real `make lab PORT=… BROWSER=no`, as a learner runs it in a terminal (stdin a terminal, HOME an empty
    folder): a kernel started through the server's REST API runs a 2-rank cluster, stops it (parked in `make lab`'s
    pool), draws a figure; Ctrl-C twice stops JupyterLab, its kernel and the parked ranks; HOME is still empty, and
    the terminal showed neither the unencrypted-kernel nor the unsigned-messages warning."""
    home = tmp_path / "home"
    home.mkdir()
    env = _learners_environment(home)
    runtime = Path(_exported(env)["JUPYTER_RUNTIME_DIR"])
    port, token = _free_port(), secrets.token_hex(16)
    base = f"http://localhost:{port}"
    controller, terminal = pty.openpty()  # Jupyter asks before it stops on Ctrl-C only when stdin is a terminal
    log_path = tmp_path / "make-lab.log"
    with open(log_path, "w") as log:
        lab = subprocess.Popen(["make", "--no-print-directory", "lab", f"PORT={port}", "BROWSER=no",
                                f"LAB_ARGS=--IdentityProvider.token={token}"], cwd=ROOT, env=env, stdin=terminal,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(terminal)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert lab.poll() is None, f"make lab exited with {lab.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                _api(base, token, "/api/status")
                break
            except OSError:
                assert time.monotonic() < deadline, f"make lab not up in 240 s:\n{log_path.read_text()[-3000:]}"
                time.sleep(1)
        kernel = _api(base, token, "/api/kernels", {"name": "shardlab"})
        connection_file = runtime / f"kernel-{kernel['id']}.json"
        from jupyter_client import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(connection_file))
        client.load_connection_file()
        client.start_channels(hb=False)  # a heartbeat not yet beating reads as a dead kernel to wait_for_ready
        try:
            client.wait_for_ready(timeout=180)
            said, errors = [], []
            reply = client.execute_interactive(
                IN_THE_KERNEL, timeout=400, output_hook=lambda m: (
                    said.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else
                    errors.append(m["content"].get("traceback", m["content"])) if m["msg_type"] == "error" else None))
        finally:
            client.stop_channels()
        assert reply["content"]["status"] == "ok", errors
        text = "".join(said)
        assert "ranks [0, 1]" in text and f"IPYTHONDIR {STATE / 'ipython'}" in text, text
    finally:
        for _ in range(2):  # Ctrl-C in the terminal: the first one asks, the second one stops
            if lab.poll() is None:
                os.killpg(lab.pid, signal.SIGINT)
                time.sleep(1)
        try:
            lab.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait(timeout=30)
            raise
        finally:
            os.close(controller)
    deadline = time.monotonic() + 60  # make may return before JupyterLab and the pool's clean-up are done
    while _processes_of_group(lab.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_of_group(lab.pid), "JupyterLab or shardlab.ranks.warm still running after Ctrl-C twice"
    assert _files_in(home) == [], f"written into HOME: {_files_in(home)}"
    assert (STATE / "ipython" / "profile_default").is_dir()  # the kernel's IPython wrote into .state instead
    terminal_text = log_path.read_text()  # JupyterLab's, and its kernel's, whose stderr goes to the terminal
    # The last two: what `make lab` leaves out of JupyterLab (the Makefile says why); the third, IPython's fallback
    # when its folder's parent is missing.
    for warning in ("running over TCP without encryption", "Message signing is disabled",
                    "_jupyter_server_extension_points", "Skipped non-installed server", "not a writable location"):
        assert warning not in terminal_text, f"make lab's terminal shows {warning!r}:\n{terminal_text[-3000:]}"
    # What Ctrl-C stopped, said once: JupyterLab, then the kernel's 2 ranks, parked for the next notebook.
    assert "shardlab: JupyterLab stopped; stopped 2 warm ranks." in terminal_text, terminal_text[-3000:]


def _processes_of_group(pgid: int) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(process.pid) == pgid:
                found.append(process.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return found
