"""`make lab` with a kernel and ranks writes nothing into the home folder: what Jupyter, JupyterLab, IPython,
matplotlib, Warp, Triton, CUDA, pip, uv and npm keep goes to the checkout's .state/ (the Makefile exports their
folders). The Makefile's settings, without ranks: tests/unit/test_home.py."""

import json
import os
import pty
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from learner_shell import learners_environment, make_exports

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".state"


def _files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


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
    env = learners_environment(home)
    runtime = Path(make_exports(env)["JUPYTER_RUNTIME_DIR"])
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
