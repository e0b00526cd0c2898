"""`make kernel-user` installs the kernel spec per user, where a JupyterHub single-user server looks. Memory per
engine and per learner: tests/system/test_operations.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _as_another_server(home: Path) -> dict:
    """The environment of a Jupyter server that is not .venv's own (a JupyterHub single-user server, say): it
    searches the user's folder first. From inside .venv, jupyter would prefer .venv's own folder; this says not
    to, as a server from another environment does not even see it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_")}
    return env | {"HOME": str(home), "JUPYTER_PREFER_ENV_PATH": "0"}


def test_make_kernel_user_installs_the_kernel_where_jupyterhub_finds_it(tmp_path):
    """`make kernel-user` puts the spec in ~/.local/share/jupyter/kernels, which every Jupyter server run by this
    user (a JupyterHub single-user server included) searches first; the spec runs this environment's Python."""
    env = _as_another_server(tmp_path)
    out = subprocess.run(["make", "-s", "kernel-user"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    specs = json.loads(subprocess.run([sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"], env=env,
                                      capture_output=True, text=True, check=True).stdout)["kernelspecs"]
    spec = specs["shardlab"]
    assert Path(spec["resource_dir"]) == tmp_path / ".local/share/jupyter/kernels/shardlab"
    assert spec["spec"]["argv"][0] == sys.executable
    assert spec["spec"]["display_name"] == "Python (shardlab: PhysicsNeMo distributed)"
    # The spec found through the user's folder starts a kernel that imports the helpers.
    probe = ("from jupyter_client.manager import start_new_kernel\n"
             "km, kc = start_new_kernel(kernel_name='shardlab')\n"
             "out = []\n"
             "kc.execute_interactive('import shardlab, sys; print(sys.executable)', timeout=60,\n"
             "                       output_hook=lambda m: out.append(m['content'].get('text', '')))\n"
             "kc.stop_channels(); km.shutdown_kernel(now=True)\n"
             "print(''.join(out).strip())\n")
    ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0 and ran.stdout.strip().endswith(sys.executable), ran.stderr[-2000:]
