"""The rank panel's rows and wait sentences, from hand-made rank reports: no ranks, no widgets."""

import json

import pytest

from shardlab.ranks import beacon, panel

NOW = 1_000.0  # seconds since the epoch, for every report below
NS = 1_000_000_000


def report(rank: int, state: str = "running", written: float = NOW - 0.2, read: float = NOW - 0.2,
           newest: tuple = (), cell_started: float | None = NOW - 12.0, cell_ended: float | None = None,
           device_bytes: int | None = None) -> dict:
    """What a rank's beacon writes: ``newest``: (group, seq, op, done, started seconds) of its newest collectives."""
    return {"rank": rank, "pid": 100 + rank, "state": state, "cell_started": cell_started, "cell_ended": cell_ended,
            "written": written, "flight_read_ns": int(read * NS), "rss": 300 * 2**20, "device": "cuda:0",
            "device_bytes": device_bytes,
            "newest": [{"group": list(g), "seq": s, "op": op, "done": done, "started_ns": int(t * NS), "sizes": []}
                       for g, s, op, done, t in newest]}


WORLD = (0, 1, 2)


def test_ranks_waiting_for_one_that_never_entered_name_it():
    records = {0: report(0, newest=[(WORLD, 7, "all_reduce", False, NOW - 5)]),
               1: report(1, state="idle", newest=[(WORLD, 6, "broadcast", True, NOW - 9)], cell_ended=NOW - 8),
               2: report(2, newest=[(WORLD, 7, "all_reduce", False, NOW - 4)])}
    assert panel.wait_sentences(records, NOW) == [
        "rank(s) [0, 2] wait in all_reduce #7 of group [0, 1, 2] for rank(s) [1], which never entered it "
        "(rank 1's last there was broadcast #6)."]
    rows = panel.rank_rows(records, NOW)
    assert [r["state"] for r in rows] == ["running", "idle", "running"]
    assert rows[0]["last collective"] == "all_reduce #7 of group [0, 1, 2] (in progress)"
    assert rows[1]["last collective"] == "broadcast #6 of group [0, 1, 2] (done)"
    assert rows[0]["cell"] == "12.0 s" and rows[1]["cell"] == "4.0 s (last cell)"
    assert rows[0]["memory"] == "300 MiB RSS"


def test_a_report_read_before_the_others_entered_is_no_wait():
    # Rank 1's collectives were read 2 s before rank 0 entered #7: it may have entered it since.
    records = {0: report(0, newest=[(WORLD[:2], 7, "all_reduce", False, NOW - 3)]),
               1: report(1, read=NOW - 5, newest=[(WORLD[:2], 6, "all_reduce", True, NOW - 6)])}
    assert panel.wait_sentences(records, NOW) == []


def test_a_wait_shorter_than_a_second_is_a_rank_merely_early():
    records = {0: report(0, newest=[((0, 1), 3, "all_reduce", False, NOW - 0.3)]),
               1: report(1, newest=[((0, 1), 2, "all_reduce", True, NOW - 0.5)])}
    assert panel.wait_sentences(records, NOW) == []
    assert panel.wait_sentences(records, NOW + 1) != []


@pytest.mark.parametrize("record, gone, expected", [
    (None, False, "not answering (no report)"),
    (report(0, written=NOW - 7), False, "not answering (7 s without a report)"),
    (report(0), True, "not answering (its process is gone)"),
    (report(0, state="failed"), False, "failed"),
])
def test_states_of_ranks_that_do_not_answer(record, gone, expected):
    rows = panel.rank_rows({0: record}, NOW, watching_since=NOW - 10, gone=frozenset({0} if gone else ()))
    assert rows[0]["state"] == expected


def test_a_report_from_before_the_panel_was_shown_is_no_report_yet():
    rows = panel.rank_rows({0: report(0, written=NOW - 60)}, NOW, watching_since=NOW - 1)
    assert rows[0]["state"] == "no report yet"


def test_a_last_collective_read_seconds_ago_says_so():
    busy = report(0, read=NOW - 7, newest=[((0, 1), 900, "all_reduce", True, NOW - 7.5)])
    assert panel.rank_rows({0: busy}, NOW)[0]["last collective"] == "all_reduce #900 of group [0, 1] (done, 7 s ago)"


def test_accelerator_memory_is_shown_beside_the_host_memory():
    rows = panel.rank_rows({0: report(0, device_bytes=3 * 2**30)}, NOW)
    assert rows[0]["memory"] == "300 MiB RSS, 3.00 GiB on cuda:0"


def test_the_html_shows_each_row_and_the_wait_in_words():
    rows = panel.rank_rows({0: report(0), 1: report(1, state="failed")}, NOW)
    shown = panel.render(rows, ["rank(s) [0] wait in all_reduce #1 of group [0, 1] for rank(s) [1], ..."])
    assert shown.count("<tr>") == 3 and ">failed</b>" in shown and "for rank(s) [1]" in shown


def test_reports_are_read_back_as_written_and_a_missing_one_is_none(tmp_path):
    beacon.write_json_atomically(beacon.record_path(tmp_path, 0), report(0))
    (tmp_path / "rank-1.json").write_text("{half a fi")
    records = panel.read_records(tmp_path, [0, 1, 2])
    assert records[0] == json.loads(json.dumps(report(0))) and records[1] is None and records[2] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]  # no temporary file left
