"""Probes that need an interpreter of their own, started in a fraction of a second instead of five.

`python -c CODE` spends most of its time importing torch and PhysicsNeMo. A `FreshPython` is a server process that
imports them once (and nothing of shardlab), then forks a child per probe: each child starts with the import-time
state a new `python -c` would have, and none of the process-group, registry or environment state that another probe
or the test process holds. Tests that check a command's own start-up, signals or exit path still run the command.
"""

import json
import subprocess
import sys
import textwrap

# The server: reads one JSON request per line, forks, and answers with the child's exit status and output.
SERVER = r'''
import json, os, signal, sys, tempfile, time, traceback
import torch, physicsnemo.distributed, physicsnemo.domain_parallel  # the slow part, done once
requests, replies = sys.stdin, os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # nothing the server prints can be taken for a reply
base = dict(os.environ)
for line in requests:
    request = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own process group: a timeout stops whatever the probe started too
            os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
            os.environ.clear()
            os.environ.update({k: v for k, v in {**base, **request["env"]}.items() if v is not None})
            sys.argv = ["-c", *request["argv"]]
            status = 0
            try:
                exec(compile(request["code"], "<probe>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:  # as the interpreter ends on it: None is 0, a message is 1
                status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
        deadline, status = time.monotonic() + request["timeout_s"], None
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else time.sleep(0.02)
        if status is None:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
        replies.write(json.dumps({"returncode": status, "stdout": texts[0], "stderr": texts[1]}) + "\n")
        replies.flush()
'''


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ProbeTimedOut(AssertionError):
    pass


class FreshPython:
    """``run(code, argv=(), timeout_s=120, **env)`` is ``subprocess.run([python, "-c", code, *argv])`` with ``env``
    added to the server's environment (a None value removes a variable); use it as a context manager, which stops
    the server. The server never initializes CUDA, so its environment must hide the GPUs: probes run on CPU."""

    def __init__(self, env: dict):
        self._server = subprocess.Popen([sys.executable, "-c", SERVER], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def run(self, code: str, argv=(), timeout_s: float = 120, **env) -> subprocess.CompletedProcess:
        request = {"code": textwrap.dedent(code), "argv": list(argv), "env": env, "timeout_s": timeout_s}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe server ended (exit status {self._server.wait(10)}): see its stderr above")
        reply = json.loads(line)
        if reply["returncode"] is None:
            raise ProbeTimedOut(f"the probe ran past {timeout_s} s and was stopped:\n{reply['stderr'][-3000:]}")
        return subprocess.CompletedProcess(["-c", code, *argv], reply["returncode"], reply["stdout"], reply["stderr"])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._server.stdin.close()
        try:
            self._server.wait(30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._server.stdout.close()
