"""The machine check for the morning of a workshop (``make morning``, shardlab.tools.morning) with its steps stood in
for: its verdict, what it does with a failing step, a machine without a GPU, a step past its limit, a hub's widgets
front end. For real on this machine and in a learner's kit: tests/notebooks/test_morning_ready.py."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shardlab.ranks import devices
from shardlab.tools import gpucheck, morning
from shardlab.tools.morning import FAILED, OK, SKIPPED, Result


def fake(result_or_error, called=None):
    def run(limit_s):
        if called is not None:
            called.append(limit_s)
        if isinstance(result_or_error, Exception):
            raise result_or_error
        return result_or_error
    return run


def test_ready_when_no_step_failed_and_a_skipped_step_says_why():
    text, code = morning.verdict([Result("environment", OK, "fine"), Result("00_setup", OK, "5 cells"),
                                  Result("gpu", SKIPPED, "no GPU visible here")])
    assert code == 0 and text.splitlines()[-1] == "ready"
    assert "gpu skipped: no GPU visible here" in text


def test_a_failing_step_is_listed_with_what_to_do_and_the_others_still_run():
    printed, called = [], []
    runs = [("environment", 60, fake(Result("environment", OK, "fine"), called)),
            ("notebook 02_device_mesh", 60, fake(Result("02_device_mesh", FAILED, "cell 3 raised ValueError",
                                                        ["cell 3 raised ValueError: bad mesh; open it in make lab"]))),
            ("broken step", 60, fake(RuntimeError("no such thing"))),
            ("GPUs", 60, fake(Result("gpu", SKIPPED, "no GPU"), called))]
    results = morning.run_steps(runs, deadline_s=300, out=lambda *a, **k: printed.append(a[0]))
    assert len(called) == 2, "a failed step must not stop the steps after it"
    text, code = morning.verdict(results)
    assert code == 1 and "ready" != text.splitlines()[-1]
    assert "- 02_device_mesh: cell 3 raised ValueError: bad mesh; open it in make lab" in text
    assert "- broken step: RuntimeError: no such thing" in text and "make test" in text
    assert [line[:5] for line in printed if line.startswith("[")] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]


def test_a_step_that_no_longer_fits_the_deadline_is_not_run_and_fails():
    called = []
    results = morning.run_steps([("environment", 60, fake(Result("environment", OK, "fine"), called))],
                                deadline_s=morning.MIN_STEP_S - 1, out=lambda *a, **k: None)
    assert not called and results[0].status == FAILED
    assert "--deadline-s" in morning.verdict(results)[0]


def test_a_step_past_its_limit_is_stopped_and_names_what_it_waited_for():
    result = morning.child(["imports"], 0.5, "importing torch, physicsnemo, ipyparallel, shardlab")
    assert result.status == FAILED
    assert "importing torch, physicsnemo, ipyparallel, shardlab did not finish within 0 s" in result.fixes[0]


def test_no_gpu_is_skipped_saying_so(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    monkeypatch.setattr(devices, "unusable_gpus", lambda gpus: "")
    result = morning.step_gpu()
    assert result.status == SKIPPED and "no GPU visible here" in result.detail
    assert morning.verdict([result])[0].splitlines()[-1] == "ready"


@pytest.mark.parametrize("gpus, rows", [(1, ["tf32-error"]), (2, ["smoke", "tf32-error"])])
def test_with_gpus_the_quick_rows_run_and_a_failed_one_says_what_to_do(monkeypatch, gpus, rows):
    ran = []
    monkeypatch.setattr(devices, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(devices, "unusable_gpus", lambda n: "")
    monkeypatch.setattr(gpucheck, "run_row", lambda row, n: ran.append(row["name"]) or ("ran on CPU ranks", False))
    result = morning.step_gpu()
    assert ran == rows and result.status == FAILED
    assert all("make gpu-check" in fix for fix in result.fixes) and len(result.fixes) == len(rows)


def test_gpus_cuda_cannot_use_fail_before_any_row(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    monkeypatch.setattr(devices, "unusable_gpus", lambda gpus: "the driver 470 is older than the 525 torch needs")
    result = morning.step_gpu()
    assert result.status == FAILED and "driver 470" in result.fixes[0]


def test_environment_problems_each_say_what_to_do(tmp_path):
    venv, lock = tmp_path / ".venv", tmp_path / "requirements.txt"
    venv.mkdir()
    lock.write_text("torch==1\n")
    python = str(venv / "bin" / "python")
    assert morning.environment_problems(tmp_path, tmp_path, (3, 11), python, [lock])[0].startswith(
        "this Python")  # not a venv
    missing = morning.environment_problems(venv, tmp_path, (3, 12), None, [lock])
    assert ["3.12" in missing[0], "stamp" in missing[1], "ipykernel install" in missing[2]] == [True] * 3
    (venv / ".installed").touch()
    os.utime(lock, (0, 0))
    assert morning.environment_problems(venv, tmp_path, (3, 11), python, [lock]) == []
    os.utime(lock)  # the lock changed after the install
    stale = morning.environment_problems(venv, tmp_path, (3, 11), "/elsewhere/.venv/bin/python", [lock])
    assert "requirements.txt changed" in stale[0] and "make env" in stale[0]
    assert "/elsewhere/.venv/bin/python" in stale[1] and "make kernel-user" in stale[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_make_morning_runs_this_check_with_the_venvs_python():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["make", "-n", "--no-print-directory", "morning"], cwd=root, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == ".venv/bin/python -m shardlab.tools.morning", proc.stdout


class MissedWakeUp:
    """A channel whose poll notices a message only when its timeout runs out (as a missed zmq wake-up does): the
    message arrives before the ``arrives``-th poll; every poll's timeout is recorded."""

    def __init__(self, arrives: int | None):
        self.arrives, self.timeouts = arrives, []

    async def get_msg(self, timeout=None):
        import asyncio
        from queue import Empty

        self.timeouts.append(timeout)
        await asyncio.sleep(timeout)  # slept through, whatever arrived meanwhile
        if self.arrives is not None and len(self.timeouts) >= self.arrives:
            return {"msg_type": "execute_reply"}
        raise Empty


def test_a_client_waits_in_slices_so_a_missed_wake_up_costs_one_slice(monkeypatch):
    import asyncio
    from queue import Empty
    from types import SimpleNamespace

    monkeypatch.setattr(morning, "POLL_SLICE_S", 0.01)
    shell, iopub = MissedWakeUp(arrives=3), MissedWakeUp(arrives=None)
    client = SimpleNamespace(kc=SimpleNamespace(shell_channel=shell, iopub_channel=iopub))
    morning.poll_in_slices(client)
    # Asked to wait up to 300 s, it finds the reply at the end of the slice it arrived in, not after 300 s.
    assert asyncio.run(client.kc.shell_channel.get_msg(timeout=300)) == {"msg_type": "execute_reply"}
    assert shell.timeouts == [0.01] * 3
    with pytest.raises(Empty):  # nothing comes: Empty when the whole timeout is spent, as before
        asyncio.run(client.kc.iopub_channel.get_msg(timeout=0.05))
    assert iopub.timeouts and max(iopub.timeouts) <= 0.01


def test_in_a_learners_kit_the_check_runs_the_handout(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_setup.ipynb").write_text("{}")
    assert morning.lesson_folder(tmp_path) == tmp_path / "notebooks"
    kit = tmp_path / "kit"  # make learner-kit's: no notebooks/, the handout in build/handout/
    assert morning.lesson_folder(kit) == kit / "build" / "handout"


def fake_lab(tmp_path, listed: str, code: int = 0) -> str:
    """A "python" whose `-m jupyterlab.labextensions list` prints ``listed`` (as JupyterLab does, to stderr)."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat >&2 <<'END'\n{listed}\nEND\nexit {code}\n")
    fake.chmod(0o755)
    return str(fake)


LISTED = ("JupyterLab v4.6.6\n/opt/hub/share/jupyter/labextensions\n"
          "        jupyterlab_pygments v0.3.0 \x1b[32menabled\x1b[0m \x1b[32mOK\x1b[0m (python, jupyterlab_pygments)\n")


@pytest.mark.parametrize("line, usable", [
    ("", False),  # none; below, ipywidgets 7's (v3), a disabled one, the right one
    ("        @jupyter-widgets/jupyterlab-manager v3.1.9 \x1b[32menabled\x1b[0m \x1b[32mOK\x1b[0m", False),
    ("        @jupyter-widgets/jupyterlab-manager v5.0.16 \x1b[31mdisabled\x1b[0m \x1b[32mOK\x1b[0m", False),
    ("        @jupyter-widgets/jupyterlab-manager v5.0.16 \x1b[32menabled\x1b[0m \x1b[32mOK\x1b[0m "
     "(python, jupyterlab_widgets)", True)])
def test_the_widgets_front_end_of_a_hubs_jupyterlab_is_checked(tmp_path, line, usable):
    lab = fake_lab(tmp_path, LISTED + line)
    problems = morning.widgets_problems(lab)
    if usable:
        assert problems == []
    else:
        assert len(problems) == 1 and f"the JupyterLab of {lab} has no widgets front end" in problems[0]
        assert f"`{lab} -m pip install 'jupyterlab_widgets>=3,<4'`" in problems[0], problems


def test_a_lab_python_that_is_no_jupyterlab_says_what_it_said(tmp_path):
    problems = morning.widgets_problems(fake_lab(tmp_path, "No module named jupyterlab", code=1))
    assert "No module named jupyterlab" in problems[0] and "LAB_PYTHON" in problems[0]


def test_this_environments_jupyterlab_has_the_widgets_front_end():
    assert morning.widgets_problems() == []
