"""summarize_rank_errors and Table, on hand-made inputs."""

import pytest

from shardlab.report import Table, summarize_rank_errors

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


def test_no_timeout_no_extra_line():
    assert len(summarize_rank_errors([(0, "RuntimeError", "")], [0, 1])) == 1


def test_whitespace_only_message():
    assert summarize_rank_errors([(0, "RuntimeError", "\n")], [0]) == ["rank 0: RuntimeError: "]


ROWS = [{"rank": 0, "device": "cpu", "backend": "gloo"}, {"rank": 1, "device": "cpu", "backend": "gloo"}]


@pytest.mark.parametrize("render", [str, lambda t: t._repr_html_()], ids=["text", "html"])
def test_table_renders_headers_and_values(render):
    out = render(Table(ROWS))
    for word in ("rank", "device", "backend", "cpu", "gloo"):
        assert word in out
    assert out.count("gloo") == 2  # one cell per row


def test_table_text_has_one_line_per_row_in_column_order():
    lines = str(Table(ROWS)).splitlines()
    assert lines[0].split() == ["rank", "device", "backend"]
    assert [line.split() for line in lines[2:]] == [["0", "cpu", "gloo"], ["1", "cpu", "gloo"]]


def test_table_html_is_a_table():
    html = Table(ROWS)._repr_html_()
    assert "<table>" in html and "<th" in html and "gloo" in html


def test_table_explicit_columns():
    table = Table(ROWS, columns=["backend", "rank"])
    text = str(table)
    assert "device" not in text and "cpu" not in text
    assert text.splitlines()[0].split() == ["backend", "rank"]
    assert "device" not in table._repr_html_()


def test_table_missing_cell_is_blank():
    assert "None" not in str(Table([{"a": 1}, {"b": 2}], columns=["a", "b"]))


def test_dead_engine_error_is_attributed_to_its_rank():
    from types import SimpleNamespace

    from shardlab.report import rank_errors

    dead = SimpleNamespace(elist=[("EngineError", "Engine 1 died while running task 'abc'", "", {})])
    assert rank_errors(dead) == [(1, "EngineError", "Engine 1 died while running task 'abc'")]


def test_gloo_source_prefix_is_dropped():
    message = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms"
    expected = "rank 0: RuntimeError: Timed out waiting 10000ms"
    assert summarize_rank_errors([(0, "RuntimeError", message)], [0])[0] == expected
