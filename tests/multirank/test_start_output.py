"""What a learner sees when a notebook starts its ranks, in real kernels: one line that says what the start did (a
fresh start counting the ranks as they register, or a take-over of warm ranks), no warning about message signing
from the kernel, the controller or the engines, and no <defunct> child left under a kernel."""

import os
import re
import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from shardlab.ranks import owned, warm

pytestmark = pytest.mark.multirank
SIGNING = "Message signing is disabled"
START = "import shardlab as sl\ncluster = sl.start_cluster(n=2, device='cpu')"


def _outputs(kc, code: str, timeout_s: float) -> list[tuple[str, str]]:
    """(message type, text) of every output the cell sent; raises if it failed."""
    outputs = []

    def hook(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            outputs.append(("stream", content["text"]))
        elif msg["msg_type"] in ("display_data", "update_display_data"):
            outputs.append((msg["msg_type"], content["data"].get("text/plain", "")))
        elif msg["msg_type"] == "error":
            outputs.append(("error", "\n".join(content["traceback"])))

    reply = kc.execute_interactive(code, timeout=timeout_s, output_hook=hook)
    assert reply["content"]["status"] == "ok", outputs
    return outputs


def _defunct_children(pid: int, wait_s: float = 15.0) -> list[psutil.Process]:
    """The kernel's children that exited and were not reaped, once ``wait_s`` gave them every chance to be."""
    deadline = time.monotonic() + wait_s
    while True:
        defunct = [c for c in psutil.Process(pid).children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
        if not defunct or time.monotonic() > deadline:
            return defunct
        time.sleep(0.5)


def test_every_start_says_what_it_did_without_signing_warnings_or_defunct_children(no_leftovers, tmp_path):
    pool = warm.Pool.create(os.environ[owned.ORIGIN], idle_s=120)  # the processes count as this test's
    env = os.environ | {warm.POOL: str(pool.folder), "CUDA_VISIBLE_DEVICES": ""}
    kernels = {}
    try:
        for name in ("first", "next"):
            with open(tmp_path / f"{name}.stderr", "w") as stderr:
                kernels[name] = start_new_kernel(kernel_name="shardlab", startup_timeout=120, env=env, stderr=stderr)
        first, after = kernels["first"][1], kernels["next"][1]
        pids = {name: km.provisioner.process.pid for name, (km, _) in kernels.items()}

        # A fresh start: one output, updated in place while the ranks register, ending with what it did.
        shown = [(kind, text) for kind, text in _outputs(first, START, 400) if kind != "stream"]  # not a note
        assert [kind for kind, _ in shown[:1]] == ["display_data"] and {kind for kind, _ in shown[1:]} == {
            "update_display_data"}, shown
        assert any(re.fullmatch(r"starting 2 ranks: [0-2] of 2 registered", text) for _, text in shown), shown
        assert re.fullmatch(r"started 2 CPU ranks in \d+\.\d s", shown[-1][1]), shown
        assert _outputs(first, "cluster.stop(); print(cluster.parked)", 120) == [("stream", "True\n")]
        assert not _defunct_children(pids["first"], wait_s=0)

        # The next notebook takes the parked ranks over, and says so; the first kernel's keeper of the parked
        # cluster exits then, and must not stay behind as a <defunct> child of that kernel.
        shown = _outputs(after, START, 400)
        assert len(shown) == 1 and re.fullmatch(r"took over 2 warm CPU ranks from a previous notebook, reset in "
                                                r"\d+\.\d s", shown[0][1]), shown
        assert _outputs(after, "cluster.stop(); print(cluster.parked)", 120) == [("stream", "True\n")]
        assert not _defunct_children(pids["first"]), "the keeper of the cluster the first kernel parked"
        logs = "".join(path.read_text(errors="replace") for path in Path(pool.folder).glob("*/log/*"))
        assert "Completed registration" in logs and SIGNING not in logs  # the engines' and the controller's

        pool.stop()  # stops the parked cluster: its controller and launcher are children of the first kernel
        for name, pid in pids.items():
            assert not _defunct_children(pid), f"the {name} kernel"
    finally:
        for km, kc in kernels.values():
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        pool.stop()
    for name in kernels:
        said = (tmp_path / f"{name}.stderr").read_text()
        assert SIGNING not in said, f"the {name} kernel said:\n{said}"
