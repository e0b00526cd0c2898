"""GPUs that CUDA cannot use, and gpu-check's own design, with the node simulated: a fake ``nvidia-smi`` on PATH
printing what a node prints, torch's GPU count patched. A driver older than the torch wheels need makes torch count
no GPU; ``make gpu-check`` and notebook 00 must say so, not pass as a machine without GPUs. Then: gpu-check's
deadline, SIGTERM stopping what it started, and bench's and the notebooks row's rank counts on any GPU count."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import notebook_runner
from marked import marked_processes
from shardlab.ranks import devices, launch, owned, subprocesses
from shardlab.tools import bench, gpucheck, smoke

H100, V100 = ("NVIDIA H100 80GB HBM3", "9.0"), ("Tesla V100-SXM2-32GB", "7.0")
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1+cu130's
SLEEP = shutil.which("sleep")
FAKE_NVIDIA_SMI = """\
#!{python}
import sys, time
GPUS, DRIVER, FIELDS, FAILURE, HANG = {gpus!r}, {driver!r}, {fields!r}, {failure!r}, {hang!r}
if HANG:
    time.sleep(60)
if FAILURE:
    print(FAILURE[1])
    sys.exit(FAILURE[0])
if not GPUS:
    print("No devices were found")
    sys.exit(6)
if "-L" in sys.argv:
    for i, (name, cap) in enumerate(GPUS):
        print(f"GPU {{i}}: {{name}} (UUID: GPU-{{i:08x}}-0000-0000-0000-000000000000)")
    sys.exit(0)
asked = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--query-gpu=")).split(",")
for field in asked:
    if field not in FIELDS:
        print(f'Field "{{field}}" is not a valid field to query.')
        sys.exit(2)
for name, cap in GPUS:
    print(", ".join({{"name": name, "driver_version": DRIVER, "compute_cap": cap}}[f] for f in asked))
"""


def fake_nvidia_smi(folder: Path, gpus, driver="535.104.05", fields=("name", "driver_version", "compute_cap"),
                    failure=None, hang=False) -> Path:
    """``folder`` with an nvidia-smi that lists ``gpus`` ((name, compute capability) pairs) on ``driver``."""
    folder.mkdir(exist_ok=True)
    fake = folder / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI.format(python=sys.executable, gpus=list(gpus), driver=driver, fields=list(fields),
                                           failure=failure, hang=hang))
    fake.chmod(0o755)
    return folder


@pytest.fixture
def node(monkeypatch, tmp_path):
    """``node(*gpus, driver=..., cuda_sees=N)``: this machine becomes a node whose nvidia-smi lists ``gpus`` ((name,
    compute capability) pairs) on ``driver``, and whose torch counts ``cuda_sees`` GPUs, built for ``ARCHS`` with
    CUDA 13.0. ``failure`` (exit code, message), ``hang``, ``fields`` (what the driver's nvidia-smi can query);
    ``smi=False``: no nvidia-smi at all; ``driver_lists``: how many GPUs the kernel driver lists (``/proc``). PATH
    holds the fake alone."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(ARCHS))

    def make(*gpus, driver="535.104.05", cuda_sees=0, failure=None, hang=False, smi=True,
             fields=("name", "driver_version", "compute_cap"), driver_lists=0):
        if smi:
            fake_nvidia_smi(folder, gpus, driver, fields, failure, hang)
        listed = tmp_path / "proc-driver-nvidia-gpus"
        listed.mkdir(exist_ok=True)
        for bus in range(driver_lists):
            (listed / f"0000:{bus:02x}:00.0").mkdir()
        monkeypatch.setattr(devices, "NVIDIA_DRIVER_GPUS", str(listed))
        for module in (devices, gpucheck, smoke):
            monkeypatch.setattr(module, "visible_gpus", lambda: cuda_sees)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_sees)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i][0])
        return folder

    return make


# -- item 1: GPUs that CUDA cannot use ---------------------------------------------------------------------------


def test_four_h100s_on_driver_535_name_the_driver_found_the_one_needed_and_the_architectures(node):
    node(*[H100] * 4, driver="535.104.05", cuda_sees=0)
    message = devices.unusable_gpus(0)
    assert message.startswith("This node has 4 GPU(s), NVIDIA H100 80GB HBM3 (sm_90), but CUDA sees 0")
    assert "driver 535.104.05 is installed" in message and "(CUDA 13.0) need driver R580 or newer" in message
    assert "run on GPUs sm_75, sm_80, sm_86, sm_90, sm_100, sm_120" in message
    assert "Update the NVIDIA driver to R580 or newer" in message


def test_gpucheck_fails_on_that_node_and_notebook_00_shows_why(node, tmp_path, capsys):
    node(*[H100] * 4, driver="535.104.05", cuda_sees=0)
    out = tmp_path / "gpu-check.json"
    assert gpucheck.main(["--json", str(out)]) == 1
    said = capsys.readouterr()
    assert "No GPU is visible" not in said.out and "driver 535.104.05" in said.err and "R580" in said.err
    assert "R580" in json.loads(out.read_text())["error"]
    facts = smoke.machine_facts()  # notebook 00's inventory: the message, not a crash
    assert facts["unusable_gpus"] == devices.unusable_gpus(0) and facts["gpus"] == []


def test_a_driver_too_old_counts_its_gpus_with_nvml_yet_cuda_is_unavailable(monkeypatch, tmp_path, capsys):
    """torch 2.14.1 on a node whose driver is too old for the wheels: before CUDA starts, ``device_count()`` is NVML's
    count (``torch/cuda/__init__.py`` lines 1231-1232: ``_device_count_nvml()`` when not initialised; NVML ships with
    the driver, so it counts the node's 4 GPUs), while ``is_available()`` asks the CUDA runtime
    (``torch._C._cuda_getDeviceCount() > 0``, line 228), which fails on the old driver: False. Simulated exactly so,
    unlike the ``node`` fixture: nothing of the series' own is patched."""
    fake_nvidia_smi(tmp_path / "bin", [H100] * 4, driver="535.104.05")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(ARCHS))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # NVML's count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CUDA runtime's answer

    def no_cuda(i=0):
        raise RuntimeError("CUDA driver initialization failed")  # what get_device_name meets on that node

    monkeypatch.setattr(torch.cuda, "get_device_name", no_cuda)
    assert devices.visible_gpus() == 0
    assert "Update the NVIDIA driver to R580 or newer" in devices.unusable_gpus(devices.visible_gpus())
    out = tmp_path / "gpu-check.json"
    assert gpucheck.main(["--json", str(out)]) == 1  # not a traceback at get_device_name, not "no GPU"
    assert "driver 535.104.05" in capsys.readouterr().err
    facts = smoke.machine_facts()  # notebook 00's inventory
    assert facts["gpus"] == [] and "R580" in facts["unusable_gpus"] and facts["one_rank_runs_on"] == "cpu"
    assert devices.place_ranks(4, devices.visible_gpus()).device == "cpu"  # and it says why, in unusable_gpus


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees this machine's GPUs: the node cannot be simulated "
                                                      "in another process")
def test_python_m_shardlab_gpucheck_exits_non_zero_with_the_driver_message(tmp_path):
    folder = fake_nvidia_smi(tmp_path / "bin", [H100] * 4, driver="535.104.05")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"PATH": str(folder)}
    proc = subprocess.run([sys.executable, "-m", "shardlab.tools.gpucheck"], capture_output=True, text=True, env=env,
                          timeout=120)
    needed = devices.CUDA_DRIVER_BRANCH[torch.version.cuda.split(".")[0]]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "No GPU is visible" not in proc.stdout
    assert f"driver 535.104.05 is installed, and the torch {torch.__version__} wheels" in proc.stderr
    assert f"need driver R{needed} or newer" in proc.stderr and ", ".join(torch.cuda.get_arch_list()) in proc.stderr


@pytest.mark.parametrize("gpus, smi", [((), True), ((), False)], ids=["nvidia-smi lists none", "no nvidia-smi"])
def test_no_gpu_at_all_is_the_only_no_gpu_pass(node, capsys, gpus, smi):
    node(*gpus, smi=smi)
    assert devices.unusable_gpus(0) == ""
    assert gpucheck.main([]) == 0 and "No GPU is visible here" in capsys.readouterr().out


def test_gpus_the_driver_lists_without_nvidia_smi_are_not_taken_for_none(node, capsys, monkeypatch):
    node(smi=False, driver_lists=4)
    message = devices.unusable_gpus(0)
    assert "the NVIDIA driver found 4 GPU(s)" in message and "nvidia-smi is not on PATH" in message
    assert "need driver R580 or newer" in message
    assert gpucheck.main([]) == 1 and "No GPU is visible here" not in capsys.readouterr().out
    assert devices.unusable_gpus(4) == ""  # CUDA sees them: nothing to say
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.unusable_gpus(0) == ""  # hidden on purpose


def test_a_driver_that_fits_and_cuda_seeing_every_gpu_is_fine(node):
    node(*[H100] * 4, driver="580.82.07", cuda_sees=4)
    assert devices.unusable_gpus(4) == ""


@pytest.mark.parametrize("mask, cuda_sees, fine", [
    ("0,1", 2, True),  # fewer on purpose
    ("0,1", 1, False),
    ("", 0, True),
    ("-1", 0, True),
    ("2,9,3", 1, True),  # CUDA stops at 9, which this node has not
    ("GPU-00000000-0000-0000-0000-000000000000", 1, True),
    ("1,2,3", 0, False),
])
def test_cuda_visible_devices_may_hide_gpus_on_purpose(node, monkeypatch, mask, cuda_sees, fine):
    node(*[H100] * 4, driver="535.104.05", cuda_sees=cuda_sees)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    message = devices.unusable_gpus(cuda_sees)
    assert (message == "") == fine, message
    if not fine:
        selected = len(mask.split(","))
        assert f"CUDA sees {cuda_sees} of the {selected} that CUDA_VISIBLE_DEVICES={mask!r} selects" in message


@pytest.mark.parametrize("cuda_sees", [0, 1])
def test_a_gpu_the_wheels_have_no_code_for_is_named_with_its_architecture(node, cuda_sees):
    node(V100, driver="580.82.07", cuda_sees=cuda_sees)  # torch may count it, yet no kernel of the wheels runs on it
    message = devices.unusable_gpus(cuda_sees)
    assert "Tesla V100-SXM2-32GB (sm_70)" in message and "run on GPUs sm_75, sm_80" in message
    assert "The wheels have no code for Tesla V100-SXM2-32GB (sm_70): use GPUs of sm_75 or newer" in message


def test_a_driver_too_old_to_report_compute_capability_is_still_named(node):
    node(*[H100] * 2, driver="470.223.02", fields=("name", "driver_version"))
    message = devices.unusable_gpus(0)
    assert "2 GPU(s), NVIDIA H100 80GB HBM3, but CUDA sees 0" in message and "driver 470.223.02" in message
    assert "Update the NVIDIA driver to R580" in message


def test_a_failing_nvidia_smi_is_reported_when_cuda_sees_nothing(node):
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    node(H100, failure=(9, said))
    message = devices.unusable_gpus(0)
    assert said in message and "R580" in message and "Install or repair the NVIDIA driver" in message
    assert devices.unusable_gpus(2) == ""  # CUDA works without it: nothing to compare


def test_a_hung_nvidia_smi_does_not_hang_the_check(node):
    node(H100, hang=True)
    t0 = time.monotonic()
    message = devices.unusable_gpus(0, timeout_s=1)
    assert time.monotonic() - t0 < 10 and "timed out after 1" in message


def test_torch_without_cuda_on_a_gpu_node_says_to_install_the_cuda_wheels(node, monkeypatch):
    node(H100, driver="580.82.07")
    monkeypatch.setattr(torch.version, "cuda", None)
    message = devices.unusable_gpus(0)
    assert "is built without CUDA" in message and "make env" in message


# -- item 6: gpu-check's own design -------------------------------------------------------------------------------


def test_a_row_past_the_deadline_is_stopped_with_its_processes_and_later_rows_are_not_run(monkeypatch, tmp_path):
    planned = gpucheck.plan
    monkeypatch.setattr(gpucheck, "plan", lambda gpus: [row | {"budget_s": 2} for row in planned(gpus)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "simulated GPU")
    marker = uuid.uuid4().hex

    def sleeping_row(row, gpus):
        env = launch.clean_environment(SHARDLAB_TEST_MARKER=marker)
        subprocesses.run_process_group([SLEEP, "60"], env, 60, "a row that sleeps past the deadline")
        return "finished", True

    monkeypatch.setattr(gpucheck, "run_row", sleeping_row)
    t0 = time.monotonic()
    rows = gpucheck.checks(1, tmp_path / "gpu-check.json", deadline_s=3)
    assert time.monotonic() - t0 < 20
    ran = [r for r in rows if not r["status"].startswith("needs")]
    assert ran[0]["status"] == "FAILED" and "stopped at --deadline-s 3" in ran[0]["result"]
    assert {r["status"] for r in ran[1:]} == {gpucheck.NO_TIME}
    assert "not run: its 2 s budget does not fit" in ran[1]["result"]
    assert not marked_processes(marker)


def test_sigterm_stops_gpucheck_and_every_process_it_started(tmp_path):
    marker, origin = uuid.uuid4().hex, f"{owned.origin()}/sigterm-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "gpucheck_with_a_sleeping_row.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        from shardlab.tools import gpucheck
        from shardlab.ranks import launch, subprocesses
        gpucheck.visible_gpus = lambda: 1
        gpucheck.unusable_gpus = lambda count: ""

        def sleeping_row(row, gpus):
            env = launch.clean_environment(SHARDLAB_TEST_MARKER={marker!r})
            subprocess.Popen([{SLEEP!r}, "600"], env=env, start_new_session=True,  # stopped by nothing but its origin
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocesses.run_process_group([{SLEEP!r}, "600"], env, 600, "a sleeping row")

        gpucheck.run_row = sleeping_row
        sys.exit(gpucheck.main([]))
    """))
    env = os.environ | {owned.ORIGIN: origin}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while len(marked_processes(marker)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(marked_processes(marker)) == 2, proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr
        assert not marked_processes(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        owned.stop(owned.leftover_processes(origin))


@pytest.mark.parametrize("count, ranks, device", [(0, 4, "cpu"), (1, 4, "cpu"), (2, 2, "cuda"), (3, 2, "cuda"),
                                                  (4, 4, "cuda"), (8, 8, "cuda")])
def test_bench_by_default_starts_ranks_the_gpus_can_hold(monkeypatch, count, ranks, device):
    class Chosen(Exception):
        pass

    def first_job(launcher, n, name, device):
        raise Chosen(n, device)

    monkeypatch.setattr(bench, "visible_gpus", lambda: count)
    monkeypatch.setattr(bench, "_job", first_job)
    with pytest.raises(Chosen) as chosen:
        bench.main([])
    assert chosen.value.args == (ranks, device)


@pytest.mark.parametrize("count, ranks", [(2, 2), (3, 2), (4, 4), (5, 4), (7, 6), (8, 8)])
def test_the_notebooks_rows_run_the_largest_even_count_of_ranks_the_gpus_hold(monkeypatch, count, ranks):
    row = {r["name"]: r for r in gpucheck.plan(count)}["notebook 07_capstone"]
    assert row["ranks"] == ranks and row["on"] == f"{ranks} CUDA ranks"
    seen = {}

    def fake_run(cmd, env, timeout_s, what):
        seen["ranks"], seen["notebooks"] = env["SHARDLAB_RANKS"], [c for c in cmd if c.endswith(".ipynb")]
        return SimpleNamespace(returncode=0, stdout="1 passed", stderr="")

    monkeypatch.setattr(gpucheck.subprocesses, "run_process_group", fake_run)
    assert gpucheck.run_row(row, count)[1] and seen["ranks"] == str(ranks)
    assert [Path(n).name for n in seen["notebooks"]] == ["07_capstone.ipynb"]


@pytest.mark.notebook
@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees this machine's GPUs: the node cannot be simulated "
                                                      "in the kernel")
def test_notebook_00_shows_gpus_cuda_cannot_use_and_runs_on(monkeypatch, tmp_path, no_leftovers):
    folder = fake_nvidia_smi(tmp_path / "bin", [H100] * 4, driver="535.104.05")
    executed = {}
    read = notebook_runner.nbformat.read
    monkeypatch.setattr(notebook_runner.nbformat, "read", lambda *args, **kwargs: executed.setdefault(
        "notebook", read(*args, **kwargs)))
    path = Path(__file__).resolve().parents[2] / "notebooks" / "00_setup.ipynb"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    notebook_runner.run_notebook(path, rehearse=False, env=env | {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
    inventory = next(cell for cell in executed["notebook"].cells if cell.get("id") == "00-03")
    shown = "".join(output.get("text", "") for output in inventory.outputs)
    assert shown.startswith("GPUs CUDA cannot use: This node has 4 GPU(s)") and "driver 535.104.05" in shown
