"""%%px wiring: reading a failed cell's errors per rank and summarising them, on hand-made inputs. The live cell
deadline and summary: tests/multirank/test_faults.py and notebook 08."""

import io
import sys
from types import SimpleNamespace

import pytest

from shardlab.ranks.px import (
    CELL_TIMEOUT,
    DEFAULT_CELL_TIMEOUT_S,
    ClusterError,
    StatusLine,
    rank_errors,
    resolve_cell_timeout,
    summarize_rank_errors,
)

GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
    "Timed out waiting 8000ms for recv operation to complete"
)


def test_one_line_per_failing_rank():
    lines = summarize_rank_errors([(2, "ValueError", "bad shape\nmore detail"), (0, "KeyError", "'x'")], [0, 1, 2])
    assert lines == ["rank 0: KeyError: 'x'", "rank 2: ValueError: bad shape"]


def test_names_the_ranks_that_never_arrived():
    # Rank 1 raised before the collective, so ranks 0 and 2 waited for it until the timeout.
    errors = [(0, "DistBackendError", GLOO_TIMEOUT), (1, "ValueError", "bad shape"),
              (2, "DistBackendError", GLOO_TIMEOUT)]
    lines = summarize_rank_errors(errors, [0, 1, 2, 3])
    assert [line.split(":")[0] for line in lines[:3]] == ["rank 0", "rank 1", "rank 2"]
    assert lines[3].startswith("rank(s) [0, 2] timed out")
    assert "waiting for rank(s) [1, 3]" in lines[3] and "never entered it" in lines[3]


def test_every_rank_timed_out():
    lines = summarize_rank_errors([(r, "DistBackendError", GLOO_TIMEOUT) for r in (0, 1)], [0, 1])
    assert lines[-1].startswith("every rank [0, 1] timed out")
    assert not any("never entered" in line for line in lines)


def test_a_node_that_went_down_is_named_with_its_ranks_and_the_others_wait_for_them():
    died = "Engine {} died while running task 'abc'"
    errors = [(0, "RuntimeError", GLOO_TIMEOUT), (1, "RuntimeError", GLOO_TIMEOUT),
              (2, "EngineError", died.format(2)), (3, "EngineError", died.format(3))]
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    lines = summarize_rank_errors(errors, [0, 1, 2, 3], hosts)
    assert lines[4] == ("rank(s) [2, 3] on node2 died: their engines stopped answering (every rank on node2: the node "
                        "went down, or all its processes were killed).")
    assert lines[5] == "rank(s) [0, 1] timed out in a collective waiting for rank(s) [2, 3], which died."
    one = summarize_rank_errors(errors[:3] + [(3, "RuntimeError", GLOO_TIMEOUT)], [0, 1, 2, 3], hosts)
    assert "rank(s) [2] on node2 died: their engines stopped answering." in one
    assert summarize_rank_errors(errors, [0, 1, 2, 3])[4].startswith("rank(s) [2, 3] on an unknown node died")
    # A rank whose peer's process vanished may see its connection close before its own time-out
    closed = "Connection closed by peer [10.0.0.2]:6051. This is typically caused by a remote worker crashing."
    cut = summarize_rank_errors([(0, "RuntimeError", closed)] + errors[1:], [0, 1, 2, 3], hosts)
    assert cut[5] == ("rank(s) [0, 1] timed out or lost the connection in a collective waiting for rank(s) [2, 3], "
                      "which died.")
    # Without a death, a closed connection is a peer that left a collective: not counted as waiting
    alive = summarize_rank_errors([(0, "RuntimeError", closed), (1, "RuntimeError", GLOO_TIMEOUT)], [0, 1, 2])
    assert "rank(s) [1] timed out in a collective waiting for rank(s) [0, 2]" in alive[-1]


def test_no_timeout_no_extra_line():
    assert len(summarize_rank_errors([(0, "RuntimeError", "")], [0, 1])) == 1


def test_whitespace_only_message():
    assert summarize_rank_errors([(0, "RuntimeError", "\n")], [0]) == ["rank 0: RuntimeError: "]


def test_dead_engine_error_is_attributed_to_its_rank():
    dead = SimpleNamespace(elist=[("EngineError", "Engine 1 died while running task 'abc'", "", {})])
    assert rank_errors(dead) == [(1, "EngineError", "Engine 1 died while running task 'abc'")]


def test_gloo_source_prefix_is_dropped():
    message = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms"
    expected = "rank 0: RuntimeError: Timed out waiting 10000ms"
    assert summarize_rank_errors([(0, "RuntimeError", message)], [0])[0] == expected


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_status_line_rewrites_itself_on_a_terminal_and_prints_only_the_last_text_elsewhere(monkeypatch, capsys):
    status = StatusLine()  # captured output is no terminal: what a log file or a pipe gets
    for text in ("starting 2 ranks: 0 of 2 registered", "starting 2 ranks: 2 of 2 registered"):
        status.update(text)
    status.done("started 2 CPU ranks in 1.0 s")
    assert capsys.readouterr().out == "started 2 CPU ranks in 1.0 s\n"

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    status = StatusLine()
    status.update("starting 2 ranks: 1 of 2 registered")
    status.update("starting 2 ranks: 1 of 2 registered")  # unchanged: not written again
    status.done("started 2 ranks")  # shorter: blanks what is left of the longer line
    assert terminal.getvalue() == "\rstarting 2 ranks: 1 of 2 registered\r" + "started 2 ranks".ljust(35) + "\n"


def test_every_px_cell_has_a_deadline(monkeypatch):
    monkeypatch.delenv(CELL_TIMEOUT, raising=False)
    assert resolve_cell_timeout() == DEFAULT_CELL_TIMEOUT_S
    assert resolve_cell_timeout(30) == 30
    monkeypatch.setenv(CELL_TIMEOUT, "240")
    assert (resolve_cell_timeout(), resolve_cell_timeout(30)) == (240.0, 30)
    monkeypatch.setenv(CELL_TIMEOUT, "4 min")
    with pytest.raises(ClusterError, match="SHARDLAB_CELL_TIMEOUT_S='4 min' is not a number of seconds"):
        resolve_cell_timeout()


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
               "[127.0.0.1]:8927. This is typically caused by a remote worker crashing. GLHF!")


def test_a_cell_that_meets_a_group_broken_earlier_blames_no_rank_for_a_time_out():
    errors = [(0, "RuntimeError", "Application timeout caused pair closure"), (1, "RuntimeError", GLOO_CLOSED)]
    lines = summarize_rank_errors(errors, [0, 1])
    assert len(lines) == 2 and not any("timed out in a collective" in line for line in lines), lines


def test_out_of_step_says_which_ranks_why_and_what_to_do():
    from shardlab.ranks.px import broken_group, out_of_step

    assert broken_group(f"RuntimeError: {GLOO_CLOSED}") and broken_group(f"RuntimeError: {GLOO_TIMEOUT}")
    assert not broken_group("ValueError: expected a ShardTensor") and not broken_group("KeyError: 'x'")
    lines = out_of_step({0: f"RuntimeError: {GLOO_CLOSED}"}, "an earlier %%px cell failed on rank(s) [1] only")
    assert lines[0] == ("The ranks are out of step: rank(s) [0] found their process group broken (RuntimeError: "
                        "Connection closed by peer [127.0.0.1]:8927. This is typically caused by a remote worker "
                        "crashing. GLHF!).")
    assert lines[1].startswith("Why: an earlier %%px cell failed on rank(s) [1] only; the other ranks went on")
    assert lines[2].startswith("What to do: run cluster.restart() for fresh ranks")
