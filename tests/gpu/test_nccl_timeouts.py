"""NCCL time-outs end in an error soon after the group's timeout, and the process lives on
(``workarounds.nccl_settings``, applied by ``nccl_errors_raise`` inside ``launch.init_distributed``). No GPU here: what
a NCCL group would be created with is read from the environment at the moment ``init_process_group`` is called
(ProcessGroupNCCL's and its HeartbeatMonitor's constructors read it then), and what torch does with it is read back
from the installed library."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardlab import workarounds
from shardlab.ranks.launch import free_port

EVERY_VARIABLE = (*workarounds.NCCL_ERROR_HANDLING, *workarounds.NCCL_DUMP_AND_MONITOR)


def _clear(monkeypatch) -> None:
    """No NCCL variable in this process's environment, and every one put back as it was after the test."""
    for name in EVERY_VARIABLE:
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch restores it, even if the code under test sets it
        monkeypatch.delenv(name)


def _created_with(monkeypatch) -> dict[str, str | None]:
    """The NCCL variables at the moment a group is created inside ``nccl_errors_raise``, as ProcessGroupNCCL reads
    them (nothing is created: the call is a spy)."""
    seen = {}

    def spy(*args, **kwargs):
        seen.update({name: os.environ.get(name) for name in EVERY_VARIABLE})

    monkeypatch.setattr(dist, "init_process_group", spy)
    with workarounds.nccl_errors_raise():
        dist.init_process_group("nccl", rank=0, world_size=2)
    return seen


def test_a_group_is_created_without_the_dump_wait_and_the_monitor_that_ends_the_process(monkeypatch):
    _clear(monkeypatch)
    seen = _created_with(monkeypatch)
    # The communicator is aborted at the timeout (no 4 x 15 s wait for a dump), and nothing ends the process later.
    assert seen == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0",
                    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                    "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": None}
    # They stay set: every subgroup (a device mesh's) reads them again when it is created.
    assert all(os.environ.get(name) == value for name, value in workarounds.nccl_settings().items())


@pytest.mark.parametrize("name", workarounds.NCCL_DUMP_AND_MONITOR)
def test_your_own_dump_or_monitor_setting_wins_and_then_the_series_sets_none_of_them(monkeypatch, name):
    _clear(monkeypatch)
    monkeypatch.setenv(name, "1")
    assert workarounds.nccl_settings() == workarounds.NCCL_ERROR_HANDLING
    seen = _created_with(monkeypatch)
    assert seen[name] == "1"  # yours
    assert all(seen[other] is None for other in workarounds.NCCL_DUMP_AND_MONITOR if other != name)  # torch's
    # Error handling is always the series': PhysicsNeMo itself sets 0 (hang) just before the group is created.
    assert (seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"], seen["TORCH_NCCL_BLOCKING_WAIT"]) == ("2", "0")


def test_nccl_settings_reads_the_environment_it_is_given():
    assert workarounds.nccl_settings({}) == workarounds.NCCL_ERROR_HANDLING | workarounds.NCCL_TIMEOUT_DUMP
    assert workarounds.nccl_settings({"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "60"}) == workarounds.NCCL_ERROR_HANDLING


SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "0",
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": None}  # None: torch's default
INIT_DISTRIBUTED = """
import json, os
import torch.distributed as dist
import shardlab as sl
names = {names!r}
seen = {{}}
real = dist.init_process_group
def spy(*args, **kwargs):  # what the environment holds when DistributedManager creates the world group
    seen.update({{name: os.environ.get(name) for name in names}})
    return real(*args, **kwargs)
dist.init_process_group = spy
sl.init_distributed(10)
print("SEEN", json.dumps(seen))
print("AFTER", json.dumps({{name: os.environ.get(name) for name in names}}))
"""


def test_init_distributed_creates_the_world_group_with_the_settings_and_keeps_them_for_subgroups(fresh_python):
    """The real path: ``launch.init_distributed`` on one gloo rank (PhysicsNeMo's ``initialize`` runs, and sets its
    own TORCH_NCCL_ASYNC_ERROR_HANDLING=0 first); the NCCL variables are what a NCCL group would be created with,
    and they stay for the groups created later."""
    env = dict.fromkeys(EVERY_VARIABLE) | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = fresh_python.run(INIT_DISTRIBUTED.format(names=list(SETTINGS)), timeout_s=300, **env)
    assert out.returncode == 0, out.stderr[-3000:]
    said = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
            if line.startswith(("SEEN ", "AFTER "))}
    assert said == {"SEEN": SETTINGS, "AFTER": SETTINGS}, out.stdout


# -- what torch 2.14 does with them, read back from its library ---------------------------------------------------


def _disassembly(library: Path, symbol: str) -> list[str]:
    """The instructions of ``symbol`` in ``library`` (objdump), one line each."""
    table = subprocess.run(["nm", "-D", "-S", "--defined-only", str(library)], capture_output=True, text=True,
                           timeout=120).stdout
    found = re.search(rf"^([0-9a-f]+) ([0-9a-f]+) T {re.escape(symbol)}$", table, re.M)
    assert found, f"{symbol} is not in {library.name}: ProcessGroupNCCL changed, check workarounds.nccl_errors_raise"
    start, size = int(found.group(1), 16), int(found.group(2), 16)
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
                           f"--stop-address={start + size:#x}", str(library)], capture_output=True, text=True,
                          timeout=300).stdout.splitlines()


def _default_of(lines: list[str], variable: str) -> int:
    """The default a ``getCvarInt``/``getCvarBool`` call passes for ``variable``: the constant loaded into its second
    argument next to the load of the variable's name list."""
    at = next(i for i, line in enumerate(lines) if f"<_ZN4c10dL{len(variable)}{variable}E>" in line)
    end = next(i for i in range(at, len(lines)) if "call" in lines[i])
    constants = [re.search(r"mov\s+\$(0x[0-9a-f]+),%esi", line) for line in lines[max(0, at - 4):end]]
    return int([found for found in constants if found][-1].group(1), 16)


@pytest.fixture(scope="module")
def libtorch_cuda() -> Path:
    library = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    if not library.exists():
        pytest.skip("a CPU-only build of torch: no NCCL, nothing to read back")
    if not (shutil.which("objdump") and shutil.which("nm")):
        pytest.skip("no objdump/nm (binutils) here to read the library's code")
    return library


def test_torch_still_waits_for_a_dump_and_ends_the_process_unless_told_not_to(libtorch_cuda):
    """torch's own defaults, read from the installed library: the heartbeat monitor's constructor (480 s, 15 s, dump
    and monitoring on) and the watchdog's sleep of 4 dump timeouts before it aborts a failed collective's
    communicators. When this fails, torch changed what NCCL_TIMEOUT_DUMP works around: read the new
    ProcessGroupNCCL.cpp and update (or delete) it in shardlab/workarounds.py."""
    monitor = _disassembly(libtorch_cuda, "_ZN4c10d16ProcessGroupNCCL16HeartbeatMonitorC2EPS0_")
    defaults = {name: _default_of(monitor, name) for name in ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
                "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING")}
    assert defaults == {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": 480, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": 15000,
                        "TORCH_NCCL_DUMP_ON_TIMEOUT": 1, "TORCH_NCCL_ENABLE_MONITORING": 1}, defaults
    watchdog = _disassembly(libtorch_cuda, "_ZN4c10d16ProcessGroupNCCL8Watchdog7runLoopEv")
    calls = [re.search(r"call.*<\S*?(broadcastDumpSignal|getDumpTimeout|abortComms|"
                       r"handleException)", line) for line in watchdog]
    order = [found.group(1) for found in calls if found]
    assert order[:4] == ["broadcastDumpSignal", "getDumpTimeout", "abortComms", "handleException"], order
    at = next(i for i, line in enumerate(watchdog) if "getDumpTimeout" in line)
    assert any(re.search(r"lea\s+0x0\(,%rax,4\)", line) for line in watchdog[at:at + 3]), watchdog[at:at + 3]
    assert any("nanosleep" in line for line in watchdog[at:at + 30]), "no sleep after getDumpTimeout() * 4"


def test_the_monitor_says_what_it_would_have_done_when_it_may_not_end_the_process(libtorch_cuda):
    import mmap

    with libtorch_cuda.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for text in (b"ProcessGroupNCCL monitor thread is disabled, but would have terminated the process",
                     b"Terminating the process after attempting to dump debug info, due to ",
                     b"TORCH_NCCL_ENABLE_MONITORING (Whether to kill program when no watchdog heartbeat detected): "):
            assert data.find(text) >= 0, text
