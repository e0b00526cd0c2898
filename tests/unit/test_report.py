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
