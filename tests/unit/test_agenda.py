"""The workshop agenda in INSTRUCTORS.md is laid out from its timings table by
``python -m shardlab.tools.agenda``, never edited by hand: one day and two days, sessions of whole notebooks with
breaks, every notebook once."""

import re
import sys
from pathlib import Path

import pytest

from shardlab.tools import agenda

INSTRUCTORS = Path(__file__).resolve().parents[2] / "INSTRUCTORS.md"
TABLE = """| notebook | teaching time | hardware it needs |
|---|---|---|
| 00_setup | 10 min | any |
| 01_launchers | 60 min | CPU ranks |
| 02_device_mesh | 90 min | CPU ranks |
| 03_scatter | 120 min | CPU ranks |
"""


def test_the_agenda_in_instructors_md_is_the_timings_tables():
    assert agenda.main([str(INSTRUCTORS), "--check"]) == 0, (
        f"run `{sys.executable} -m shardlab.tools.agenda INSTRUCTORS.md` after changing the timings table")


def test_the_total_teaching_time_is_the_tables_sum():
    rows = agenda.timings(INSTRUCTORS.read_text())
    total = sum(r["minutes"] for r in rows)
    assert [r["notebook"][:2] for r in rows] == [f"{i:02d}" for i in range(len(rows))]
    assert f"**{agenda._hours(total)}**" in INSTRUCTORS.read_text()


@pytest.mark.parametrize("text", [TABLE, INSTRUCTORS.read_text()])
def test_every_notebook_once_in_sessions_no_longer_than_the_limit_with_breaks_between(text):
    rows = agenda.timings(text)
    one = agenda.day(rows)
    two = [agenda.day(part, open_lab=True) for part in agenda.split_in_two(rows)]
    for days in ([one], two):
        taught = [s["what"] for slots in days for s in slots if s["lesson"]]
        assert taught == [r["notebook"] for r in rows]
        for slots in days:
            assert all(a["end"] == b["start"] for a, b in zip(slots, slots[1:])), "gaps or overlaps"
            assert slots[0]["start"] == agenda.START and slots[-1]["what"] != "break"
            session = 0
            for s in slots:
                session = 0 if s["what"] in ("break", "lunch") else session + s["minutes"]
                assert session <= agenda.SESSION_MAX_MIN or s["minutes"] > agenda.SESSION_MAX_MIN
            assert sum(s["what"] == "lunch" for s in slots) <= 1
    assert [r["minutes"] for r in agenda.timings(TABLE)] == [10, 60, 90, 120]


def test_no_measured_time_is_typed_into_the_timings_table():
    """Run times are measured, so they live in docs/timings.md, written by `make timings`."""
    table = INSTRUCTORS.read_text().split("## Timings and hardware")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| 0") or line.startswith("| 1")]
    assert rows and not [row for row in rows if re.search(r"\d s\b", row)], rows


def test_the_two_days_are_as_even_as_whole_notebooks_allow():
    first, second = agenda.split_in_two(agenda.timings(TABLE))
    assert [r["notebook"] for r in first] == ["00_setup", "01_launchers", "02_device_mesh"]  # 160 vs 120 min
    assert [r["notebook"] for r in second] == ["03_scatter"]


def test_rewrite_replaces_only_the_block_between_the_markers():
    text = f"intro\n{agenda.BEGIN}\nhand-edited\n{agenda.END}\n\n{TABLE}"
    new = agenda.rewrite(text)
    assert "hand-edited" not in new and new.startswith("intro\n") and new.endswith(TABLE)
    assert agenda.rewrite(new) == new
    with pytest.raises(ValueError, match="markers"):
        agenda.rewrite(TABLE)
