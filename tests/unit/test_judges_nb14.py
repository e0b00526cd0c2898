"""Notebook 14's judges, without ranks, over many draws: the notebook's answers pass every time, and each wrong
answer the notebook rehearses fails every time (a judge an answer fitted to its cases passes is no judge)."""

import pytest

from shardlab.exercises import nb14
from shardlab.measure import timeline


def share(events):
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "step"]
    flying = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(("gloo:", "nccl:")))
    covered = 0.0
    for start, end in steps:
        reached = start
        for a, b in flying:
            a, b = max(a, reached), min(b, end)
            if b > a:
                covered, reached = covered + b - a, b
    return covered / sum(end - start for start, end in steps)


def partings(records):
    newest = {}
    for rank, entered in records.items():
        for e in entered:
            if (rank, e.group) not in newest or e.seq > newest[rank, e.group].seq:
                newest[rank, e.group] = e
    found = []
    for group in {g for _, g in newest}:
        numbers = {r: newest[r, group].seq if (r, group) in newest else 0 for r in group}
        top = max(numbers.values())
        if missing := [r for r in group if numbers[r] < top]:
            waiting = [r for r in group if numbers[r] == top]
            found.append({"group": group, "seq": top, "op": newest[waiting[0], group].op, "waiting": waiting,
                          "missing": missing})
    return found


def newest_only(records):
    last = max((entered[-1] for entered in records.values() if entered), key=lambda e: e.started_ns)
    waiting = [r for r, entered in records.items() if entered and entered[-1] == last]
    return [{"group": last.group, "seq": last.seq, "op": last.op, "waiting": waiting,
             "missing": [r for r in last.group if r not in waiting]}]


@pytest.mark.parametrize("draw", range(30))
def test_right_answers_pass_and_shortcuts_fail_on_every_draw(draw):
    assert nb14.share_from_trace(share) is None
    assert nb14.parting_collectives(partings) is None
    summed = lambda ev: (sum(e["dur"] for e in ev if e["name"].startswith(("gloo:", "nccl:")))  # noqa: E731
                         / sum(e["dur"] for e in ev if e["name"] == "step"))
    assert "the share is" in nb14.share_from_trace(summed)
    assert "answer key" in nb14.share_from_trace(lambda ev: timeline.communication_share(timeline.summarize(ev, 0)))
    assert "parting(s)" in nb14.parting_collectives(newest_only)
    assert "not a list" in nb14.parting_collectives(lambda records: None)
