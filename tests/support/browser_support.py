"""What tests/system/test_browser.py needs around the browser: a Chromium and a JupyterLab server on loopback."""

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import machine_changes

CHROMIUM = "/usr/bin/chromium"
# Playwright's own browser downloads are not reachable from CI; Debian's chromium is. Launched as root in a container,
# Chromium needs --no-sandbox; the rest keep it off the network and quiet.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# A fresh settings directory, so a learner's own settings cannot change what the test sees: no news prompt over the
# page, and every cell kept in the DOM (windowing would drop cells scrolled out of view).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def find_chromium(playwright) -> str:
    """The Chromium this machine has: Debian's, else Playwright's own (`playwright install chromium`). Without either,
    Debian's is installed only when the run may set the machine up (`make test-system`, as root); otherwise the test
    skips with one line that says how to get one. A failed install fails the test, it does not skip."""
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if Path(playwright.chromium.executable_path).exists():
        return playwright.chromium.executable_path
    if not (machine_changes.setup_allowed() and os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.skip(f"no Chromium: `sudo apt-get install --no-install-recommends chromium`, or "
                    f"`{Path(sys.prefix) / 'bin' / 'playwright'} install chromium`, or `sudo make test-system`")

    def apt_get(*args: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(["apt-get", *args], capture_output=True, text=True, timeout=900,
                                  env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"})
        except subprocess.TimeoutExpired:
            pytest.fail(f"`apt-get {' '.join(args)}` took more than 15 minutes")

    install = ("install", "-y", "--no-install-recommends", "chromium")
    out = apt_get(*install)
    if out.returncode != 0:  # empty or stale package lists (fresh containers ship none): refresh once, then retry
        apt_get("update")
        out = apt_get(*install)
    assert out.returncode == 0 and Path(CHROMIUM).exists(), (
        f"could not install chromium with apt-get:\n{out.stderr[-2000:]}")
    return CHROMIUM


def chromium_environment(folder: Path) -> dict:
    """Chromium's environment: its crash reports and caches (~/.config/chromium, ~/.cache) in ``folder``."""
    return os.environ | {"XDG_CONFIG_HOME": str(folder / ".config"), "XDG_CACHE_HOME": str(folder / ".cache")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, method: str = "GET"):
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as response:
        body = response.read()
    return json.loads(body) if body else None


@contextlib.contextmanager
def lab_server(root: Path, log_path: Path, startup_timeout_s: float = 120.0):
    """`make lab`'s server, headless on 127.0.0.1 with a random token; yields (base URL, token, api). As under
    `make lab`, it runs inside ``python -m shardlab.ranks.warm run``: a notebook's stopped ranks wait for the next one.

    On the way out every kernel is shut down through the REST API (so a notebook's cluster stops with its kernel),
    then the server is terminated (the pool of warm ranks stops with it), and killed if it does not exit.
    """
    port, token = _free_port(), secrets.token_hex(24)
    settings, workspaces = root / ".lab-settings", root / ".lab-workspaces"
    for name, values in LAB_SETTINGS.items():
        path = settings / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    command = [
        sys.executable, "-m", "shardlab.ranks.warm", "run", "--",
        str(Path(sys.prefix) / "bin" / "jupyter"), "lab", "--no-browser",
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
    ]
    if os.geteuid() == 0:  # CI containers run as root, which jupyter_server refuses without this
        command.append("--ServerApp.allow_root=True")
    base = f"http://127.0.0.1:{port}"

    def api(path: str, method: str = "GET"):
        return _api(f"{base}{path}{'&' if '?' in path else '?'}token={token}", method)

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # Its config folder (~/.jupyter) and the log of the `npm prefix` it asks (~/.npm/_logs) go to the test's
        # folder: a test run writes nothing into the home.
        here = {"JUPYTER_CONFIG_DIR": str(root / ".jupyter-config"), "npm_config_cache": str(root / ".npm")}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root,
                                  env=os.environ | here)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                assert server.poll() is None, f"jupyter lab exited with {server.returncode}; see {log_path}"
                try:
                    api("/api/status")
                    break
                except OSError:
                    assert time.monotonic() < deadline, (
                        f"jupyter lab not up after {startup_timeout_s:.0f} s; see {log_path}")
                    time.sleep(0.5)
            yield base, token, api
        finally:
            with contextlib.suppress(OSError):
                for kernel in api("/api/kernels"):
                    api(f"/api/kernels/{kernel['id']}", "DELETE")
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=30)
