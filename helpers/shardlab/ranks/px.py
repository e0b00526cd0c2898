"""``%%px`` wiring: blocking cells on every rank, a deadline per cell, and a per-rank summary of a failed cell; the
line a cluster's start shows while it runs (``StatusLine``).

``RankCluster.activate`` uses these; notebook 08 reads a failed cell's errors with ``rank_errors``. No shardlab
imports. Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import os
import re
import sys
import time

import ipyparallel as ipp
from ipyparallel.error import AlreadyDisplayedError, CompositeError
from IPython import get_ipython
from IPython.display import display

_TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
# What gloo raises on a rank whose peer's process vanished mid-collective (the node went down): it did not time out,
# its connection went with the peer.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer", re.IGNORECASE)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]+\.(cc|cpp|h):\d+\] ")
_SOURCE_ANYWHERE = re.compile(r"\[[^\]]+\.(cc|cpp|h):\d+\] ")


class ClusterError(RuntimeError):
    """The cluster could not start or a rank did not answer; the message names the rank and what to do."""


def rank_errors(error) -> list[tuple[int, str, str]]:
    """(rank, exception name, message) for every rank in an ipyparallel CompositeError."""
    original = getattr(error, "original_error", error)  # AlreadyDisplayedError wraps the composite one
    out = []
    for name, value, _tb, info in original.elist:
        rank = info.get("engine_id")
        if rank is None:  # a dead engine's error carries no engine id, only its message
            died = re.search(r"Engine (\d+) died", str(value))
            rank = int(died.group(1)) if died else -1
        out.append((rank, name, str(value)))
    return out


def summarize_rank_errors(errors: list[tuple[int, str, str]], ranks: list[int],
                          hosts: dict[int, str] | None = None) -> list[str]:
    """One line per failing rank, which ranks died (and on which node, from ``hosts``: rank -> host name), and which
    ranks a collective time-out was waiting for.

    ``errors`` holds (rank, exception name, message) for every rank that raised.
    """
    lines = []
    timed_out = []
    for rank, name, message in sorted(errors):
        first = next(iter((message or "").strip().splitlines()), "")
        first = _SOURCE_PREFIX.sub("", first)  # gloo prefixes its C++ file and line: noise for a learner
        lines.append(f"rank {rank}: {name}: {first[:200]}")
        if _TIMEOUT.search(f"{name} {message}") and "caused pair closure" not in message:  # an earlier time-out
            timed_out.append(rank)
    died = sorted(rank for rank, name, message in errors if name == "EngineError" and " died" in message)
    cut_off = [rank for rank, _, message in sorted(errors)
               if died and rank not in died + timed_out and _PEER_GONE.search(message or "")]
    hosts = hosts or {}
    for host in dict.fromkeys(hosts.get(rank, "an unknown node") for rank in died):
        here = [rank for rank in died if hosts.get(rank, "an unknown node") == host]
        whole = hosts and here == sorted(rank for rank, h in hosts.items() if h == host)
        lines.append(f"rank(s) {here} on {host} died: their engines stopped answering"
                     + (f" (every rank on {host}: the node went down, or all its processes were killed)." if whole
                        else "."))
    if timed_out or cut_off:
        waiting = sorted(timed_out + cut_off)
        absent = [r for r in ranks if r not in waiting]
        if absent and set(absent) <= set(died):
            how = "timed out" if not cut_off else "timed out or lost the connection"
            lines.append(f"rank(s) {waiting} {how} in a collective waiting for rank(s) {absent}, which died.")
        elif absent:
            lines.append(
                f"rank(s) {timed_out} timed out in a collective waiting for rank(s) {absent}, "
                "which never entered it (they raised first or skipped it)."
            )
        else:
            lines.append(f"every rank {timed_out} timed out: a collective nobody completed (mismatched calls?).")
    return lines


# What a collective raises once the ranks' process group is broken: gloo when a peer left a collective (timed out,
# raised, or was interrupted) and closed its connections, NCCL when its watchdog aborted the communicator. Nothing on
# the ranks mends a group after that.
_BROKEN_GROUP = re.compile(r"Connection closed by peer|Connection reset by peer|caused pair closure|Broken pipe|"
                           r"Timed out waiting \d+ ?ms|NCCL communicator was aborted|Watchdog caught collective|"
                           r"DistBackendError", re.IGNORECASE)


def broken_group(error_text: str) -> bool:
    """Whether an error ("Name: message") is a collective meeting a broken process group."""
    return bool(_BROKEN_GROUP.search(error_text))


class OutOfStep(ClusterError):
    """The ranks' process group broke: until fresh ranks start, no collective (and no check) can run. Shown as its
    message alone: the learner has one thing to do, and no traceback helps with it."""

    def _render_traceback_(self) -> list[str]:
        return [f"OutOfStep: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


def out_of_step(broken: dict[int, str], cause: str | None = None) -> list[str]:
    """What to tell the learner when rank(s) ``broken`` ({rank: "Name: message"}) found the process group broken:
    that the ranks are out of step, why, and the one thing to do. ``cause``: what failed on some ranks only, when
    known (e.g. "rank(s) [1] raised ValueError in an earlier %%px cell")."""
    first = _SOURCE_ANYWHERE.sub("", next(iter(broken.values())).strip().splitlines()[0])[:160]
    why = cause or "a cell failed, or was interrupted, on some ranks but not on the others"
    return [f"The ranks are out of step: rank(s) {sorted(broken)} found their process group broken ({first}).",
            f"Why: {why}; the other ranks went on into a collective that those never joined, waited until it timed "
            "out, and the connections between the ranks closed. A process group does not recover from that.",
            "What to do: run cluster.restart() for fresh ranks, then run the cells again from the one after "
            "sl.start_cluster() (or restart the kernel and run the notebook from the top)."]


def busy_ranks(async_result, targets: list[int]) -> list[int]:
    """The ranks among ``targets`` whose part of an ipyparallel result is not ready yet."""
    return [rank for rank, part in zip(targets, async_result.split()) if not part.ready()]


COLLECTIVE_HINT = ("If they wait in a collective, the other ranks never joined it: cluster.restart() gives fresh "
                   "ranks.")


def wait_for(async_result, targets: list[int], timeout_s: float, what: str, hint: str | None = None):
    """An ipyparallel result from ``targets`` once every rank answered; after ``timeout_s``, a ClusterError that
    names the ranks that did not, and ``hint`` (default: a collective another rank never joined)."""
    if not async_result.wait(timeout_s):
        raise ClusterError(f"rank(s) {busy_ranks(async_result, targets)} did not {what} within {timeout_s:.0f} s. "
                           + (hint or COLLECTIVE_HINT))
    return async_result.get()


CELL_TIMEOUT = "SHARDLAB_CELL_TIMEOUT_S"
DEFAULT_CELL_TIMEOUT_S = 600.0  # no lesson cell runs minutes on its ranks: past this, one of them is stuck


def resolve_cell_timeout(chosen: float | None = None) -> float:
    """The deadline of a ``%%px`` cell: ``chosen``, else ``$SHARDLAB_CELL_TIMEOUT_S``, else 10 minutes."""
    if chosen is not None:
        return chosen
    text = os.environ.get(CELL_TIMEOUT, "")
    try:
        return float(text) if text else DEFAULT_CELL_TIMEOUT_S
    except ValueError:
        raise ClusterError(f"{CELL_TIMEOUT}={text!r} is not a number of seconds: unset it, or set e.g. "
                           f"{CELL_TIMEOUT}=900") from None


def with_deadline(execute, targets: list[int], timeout_s: float):
    """``view.execute`` whose results give up waiting after ``timeout_s``: what ``%%px`` waits on."""

    def execute_with_deadline(*args, **kwargs):
        result = execute(*args, **kwargs)
        get, wait_interactive, deadline = result.get, result.wait_interactive, time.monotonic() + timeout_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def wait_interactive_until_deadline(*args, **options):  # the progress bar waits with no end of its own
            return wait_interactive(*args, **options | {"timeout": left()})

        def get_with_deadline(timeout=None, **options):
            try:
                return get(timeout=left() if timeout is None else timeout, **options)
            except ipp.error.TimeoutError:
                busy = busy_ranks(result, targets)
                result.display_outputs = lambda *args, **kwargs: None  # %%px shows outputs; none are ready
                raise ClusterError(
                    f"%%px: rank(s) {busy} did not finish within {timeout_s:.0f} s (cell_timeout_s). If they "
                    "wait in a collective, another rank never joined it. Interrupt the kernel to send them "
                    "SIGINT, or cluster.restart() for fresh ranks. A cell meant to run longer: "
                    f"sl.start_cluster(cell_timeout_s=...) or {CELL_TIMEOUT}."
                ) from None

        result.get, result.wait_interactive = get_with_deadline, wait_interactive_until_deadline
        return result

    return execute_with_deadline


PROGRESS_AFTER_S = 2  # a %%px cell still running after this shows how many ranks are done (ipyparallel's bar)


def progress_wanted(environ=None) -> bool:
    """Whether ``%%px`` cells show a progress bar: in JupyterLab (or any notebook a person watches) yes; in a notebook
    run from pytest (nbmake, the suite's own runner) no, so its saved outputs stay what the cells print. pytest sets
    PYTEST_CURRENT_TEST, which the kernel it starts inherits: the same mark ipykernel reads to leave low-level output
    alone under pytest (ipykernel 7.4, iostream.py, OutStream)."""
    return "PYTEST_CURRENT_TEST" not in (os.environ if environ is None else environ)


class PxCells:
    """``%%px`` in this IPython shell, on every rank of ``view``, blocking, with output grouped by rank and a
    per-rank summary above the tracebacks of a failing cell (the cell still fails). ``stop()`` puts the shell's
    previous exception handler back. Outside IPython, nothing is changed."""

    def __init__(self, view, ranks: list[int], progress: bool | None = None, cell_timeout_s: float | None = None,
                 hosts: dict[int, str] | None = None):
        self.shell, self.ranks, self.hosts, self._previous = get_ipython(), list(ranks), hosts, None
        self.partial_failure: str | None = None  # the last cell that failed on some ranks only: what broke a group
        if self.shell is None:
            return
        view.block = True
        view.execute = with_deadline(view.execute, self.ranks, resolve_cell_timeout(cell_timeout_s))
        view.activate()
        progress = progress_wanted() if progress is None else progress
        self.shell.run_line_magic("pxconfig", f"--no-stream --progress-after {PROGRESS_AFTER_S if progress else -1}")
        self._previous = (self.shell.custom_exceptions, self.shell.CustomTB)
        self.shell.set_custom_exc((CompositeError, AlreadyDisplayedError), self._show_summary)

    def _show_summary(self, shell, etype, value, tb, tb_offset=None):
        errors = rank_errors(value)
        summary = summarize_rank_errors(errors, self.ranks, self.hosts)
        header = ["The %%px cell failed on the cluster:", *("  " + line for line in summary), ""]
        broken = {rank: f"{name}: {message}" for rank, name, message in errors if broken_group(f"{name}: {message}")}
        stopped = sorted({rank for rank, _, _ in errors} - set(broken))  # raised on their own, here
        raised = ", ".join(sorted({name for rank, name, _ in errors if rank in stopped}))
        if broken:
            cause = f"in this cell rank(s) {stopped} raised {raised}" if stopped else self.partial_failure
            header = [*out_of_step(broken, cause), "", *header]
        if stopped and stopped != self.ranks:  # they stopped where the others went on: remembered for later cells
            self.partial_failure = f"an earlier %%px cell failed on rank(s) {stopped} only ({raised})"
        # IPython discards a custom handler's return value: the handler must show the error itself, as an
        # "error" output, or nbmake would not see the failure.
        shell._showtraceback(etype, value, header + value.render_traceback())

    def stop(self) -> None:
        if self._previous is not None:
            self.shell.custom_exceptions, self.shell.CustomTB = self._previous
            self._previous = None


class StatusLine:
    """One line that a long step (a cluster's start) rewrites as it goes, ending with what the step did. In a notebook,
    one output updated in place: also when nbmake runs it, the notebook keeps the last text only. On a terminal, a
    line rewritten with a carriage return. Anywhere else (a pipe, a log file), only the last text: a run nobody
    watches is not flooded with steps."""

    def __init__(self):
        self._in_kernel = getattr(get_ipython(), "kernel", None) is not None
        self._on_terminal = not self._in_kernel and sys.stdout.isatty()
        self._handle, self._shown = None, ""

    def update(self, text: str) -> None:
        if text == self._shown:
            return
        if self._in_kernel:
            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        elif self._on_terminal:
            print(f"\r{text:<{len(self._shown)}}", end="", flush=True)
        self._shown = text

    def done(self, text: str) -> None:
        """The last text, on a line of its own: what the step did."""
        if self._in_kernel:
            self.update(text)
        else:
            print(f"\r{text:<{len(self._shown)}}" if self._on_terminal else text, flush=True)
            self._shown = ""
