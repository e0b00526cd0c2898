"""Table, on hand-made rows."""

import pytest

from shardlab.report import Table

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


def test_title_lines_and_float_format_for_terminal_tables():
    text = str(Table([{"N": 1, "ratio": 0.51592}], title=["what", "where"], floatfmt=".4f", tablefmt="plain"))
    assert [line.split() for line in text.splitlines()] == [["#", "what"], ["#", "where"], ["N", "ratio"],
                                                             ["1", "0.5159"]]


def test_an_indented_cell_keeps_its_indent():
    text = str(Table([{"what": "total", "s": 2.0}, {"what": "  of which", "s": 1.0}], tablefmt="plain"))
    assert text.splitlines()[2].startswith("  of which")


def test_fmt_bytes_reads_in_the_largest_unit_and_the_planner_shares_it():
    from shardlab import plan, report

    assert [report.fmt_bytes(n) for n in (640, 1536, 12.3 * 2**20, 1.5 * 2**30, 200 * 2**30)] == [
        "640 B", "1.5 KiB", "12.3 MiB", "1.5 GiB", "200 GiB"]
    assert plan.fmt_bytes is report.fmt_bytes


def _loaded(held, peak, read):
    return {"held after": held, "host peak": peak, "file bytes": read, "device peak": None}


def test_lesson_rows_are_the_measurements_in_columns():
    from shardlab import report

    memory = [{"DDP": {"parameters": 40, "gradients": 40, "padding": 0, "activations": 9},
               "FSDP2": {"parameters": 24, "gradients": 24, "padding": 8, "activations": 9}}] * 2
    rows = report.wrapper_state_rows(memory, 2)
    assert rows[1] == {"rank": 1, "DDP state bytes": 80, "FSDP2 state bytes (with padding)": 56, "FSDP2 padding": 8,
                       "FSDP2 / DDP": 0.7, "1 / ddp": 0.5}  # activations are not state
    peaks = [{"DDP": {"peak above start": 300}, "FSDP2": {"peak above start": 200}}] * 2
    assert report.wrapper_state_rows(memory, 2, peaks)[0]["CUDA peak above start, FSDP2 training"] == 200
    # Each N and way: the rank that held most at its peak, and the most any rank read.
    loading = [{2: {"slab": _loaded(50, 60, 70)}}, {2: {"slab": _loaded(50, 90, 40)}}]
    assert report.largest_rank([r[2]["slab"] for r in loading])["host peak"] == 90
    assert report.loading_rows(loading, 100) == [{"N": 2, "way": "slab", "file bytes (largest rank)": "70 B",
                                                  "host peak (largest rank)": "90 B", "held after": "50 B",
                                                  "1/N of the fields": "50 B", "GPU peak": "-"}]
