"""``%%px`` wiring: blocking cells on every rank, a deadline per cell, and a per-rank summary of a failed cell; the
line a cluster's start shows while it runs (``StatusLine``).

``MPICluster.activate`` uses these; notebook 08 reads a failed cell's errors with ``rank_errors``. No shardlab
imports. Introduced in ``notebooks/01_launchers.ipynb``.
"""

from __future__ import annotations

import os
import re
import sys

import ipyparallel as ipp
from ipyparallel.error import AlreadyDisplayedError, CompositeError
from IPython import get_ipython
from IPython.display import display

_TIMEOUT = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]+\.(cc|cpp|h):\d+\] ")


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
        if _TIMEOUT.search(f"{name} {message}"):
            timed_out.append(rank)
    died = sorted(rank for rank, name, message in errors if name == "EngineError" and " died" in message)
    hosts = hosts or {}
    for host in dict.fromkeys(hosts.get(rank, "an unknown node") for rank in died):
        here = [rank for rank in died if hosts.get(rank, "an unknown node") == host]
        whole = hosts and here == sorted(rank for rank, h in hosts.items() if h == host)
        lines.append(f"rank(s) {here} on {host} died: their engines stopped answering"
                     + (f" (every rank on {host}: the node went down, or all its processes were killed)." if whole
                        else "."))
    if timed_out:
        absent = [r for r in ranks if r not in timed_out]
        if absent and set(absent) <= set(died):
            lines.append(f"rank(s) {timed_out} timed out in a collective waiting for rank(s) {absent}, which died.")
        elif absent:
            lines.append(
                f"rank(s) {timed_out} timed out in a collective waiting for rank(s) {absent}, "
                "which never entered it (they raised first or skipped it)."
            )
        else:
            lines.append(f"every rank {timed_out} timed out: a collective nobody completed (mismatched calls?).")
    return lines


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
        get = result.get

        def get_with_deadline(timeout=None, **options):
            try:
                return get(timeout=timeout_s if timeout is None else timeout, **options)
            except ipp.error.TimeoutError:
                busy = busy_ranks(result, targets)
                result.display_outputs = lambda *args, **kwargs: None  # %%px shows outputs; none are ready
                raise ClusterError(
                    f"%%px: rank(s) {busy} did not finish within {timeout_s:.0f} s (cell_timeout_s). If they "
                    "wait in a collective, another rank never joined it. Interrupt the kernel to send them "
                    "SIGINT, or cluster.restart() for fresh ranks. A cell meant to run longer: "
                    f"sl.start_cluster(cell_timeout_s=...) or {CELL_TIMEOUT}."
                ) from None

        result.get = get_with_deadline
        return result

    return execute_with_deadline


class PxCells:
    """``%%px`` in this IPython shell, on every rank of ``view``, blocking, with output grouped by rank and a
    per-rank summary above the tracebacks of a failing cell (the cell still fails). ``stop()`` puts the shell's
    previous exception handler back. Outside IPython, nothing is changed."""

    def __init__(self, view, ranks: list[int], progress: bool = False, cell_timeout_s: float | None = None,
                 hosts: dict[int, str] | None = None):
        self.shell, self.ranks, self.hosts, self._previous = get_ipython(), list(ranks), hosts, None
        if self.shell is None:
            return
        view.block = True
        view.execute = with_deadline(view.execute, self.ranks, resolve_cell_timeout(cell_timeout_s))
        view.activate()
        self.shell.run_line_magic("pxconfig", "--no-stream" + ("" if progress else " --progress-after -1"))
        self._previous = (self.shell.custom_exceptions, self.shell.CustomTB)
        self.shell.set_custom_exc((CompositeError, AlreadyDisplayedError), self._show_summary)

    def _show_summary(self, shell, etype, value, tb, tb_offset=None):
        summary = summarize_rank_errors(rank_errors(value), self.ranks, self.hosts)
        header = ["The %%px cell failed on the cluster:", *("  " + line for line in summary), ""]
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
