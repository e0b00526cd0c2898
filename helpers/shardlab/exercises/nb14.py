"""Judges of ``notebooks/14_see_every_rank.ipynb``: a rank's communication share read from its trace, and the
collectives where the ranks' records part.

Both answers are functions of plain data, judged in the kernel on traces and records the judge makes for each
check, with the truth built in rather than computed: a trace is drawn from intervals whose total is known, then
broken into events that overlap across the process group's threads, spill past the steps and sit among ops of the
main thread; records are drawn as the collectives of several groups, with one rank skipping one of them. The calls
are watched: ``sl.measure.timeline`` and ``sl.measure.flight.waits`` (the answer keys) may not run.
"""

from __future__ import annotations

import random

from ..measure import timeline
from ..measure.flight import Entered, waits
from .judging import Watch, case_generator, second_hint

_KEYS = {"summarize": timeline.summarize, "shares": timeline.shares,
         "communication_share": timeline.communication_share, "union": timeline.union, "minus": timeline.minus,
         "waits": waits}


def _watched_call(fn, *args):
    with Watch(collectives=False, **_KEYS) as watch:
        got = fn(*args)
    return got, watch.forbidden(**{k: "the answer key the exercise rebuilds" for k in _KEYS})


def _trace(rng: random.Random) -> tuple[list[dict], float]:
    """A rank's trace with its true communication share: 2 or 3 steps with gaps between them; inside each step,
    disjoint busy stretches (the truth) each covered by 1 to 3 overlapping events on the group's threads, some
    stretches reaching past the step's edges; main-thread ops (c10d's enqueue included) that must not count."""
    events, t, busy, total = [], rng.uniform(1e3, 5e3), 0.0, 0.0
    main, threads = 11, [21, 22, 23]
    for _ in range(rng.choice((2, 3))):
        start, end = t, t + rng.uniform(2e4, 6e4)
        events.append({"ph": "X", "cat": "user_annotation", "name": "step", "ts": start, "dur": end - start,
                       "tid": main, "pid": 1})
        a = start - rng.uniform(0, 2e3)  # the first stretch may begin before the step
        while a < end:
            b = a + rng.uniform(5e2, 6e3)
            busy += max(0.0, min(b, end) - max(a, start))
            cuts = sorted(rng.uniform(a, b) for _ in range(rng.randrange(0, 3)))
            for lo, hi in zip([a, *cuts], [*cuts, b]):  # pieces that overlap their neighbours, on other threads
                lo2, hi2 = max(a, lo - rng.uniform(0, 200)), min(b, hi + rng.uniform(0, 200))
                events.append({"ph": "X", "cat": "cpu_op", "name": rng.choice(("gloo:all_reduce", "gloo:all_to_all",
                               "nccl:reduce_scatter", "gloo:broadcast")), "ts": lo2, "dur": hi2 - lo2,
                               "tid": rng.choice(threads), "pid": 1})
            a = b + rng.uniform(1e3, 8e3)
        for _ in range(rng.randrange(5, 12)):
            s = rng.uniform(start, end)
            events.append({"ph": "X", "cat": "cpu_op", "name": rng.choice(("aten::conv2d", "c10d::allreduce_",
                           "HaloPadding", "aten::mm")), "ts": s, "dur": rng.uniform(10, 3e3), "tid": main, "pid": 1})
        total += end - start
        t = end + rng.uniform(1e4, 2e4)  # a gap that is no step's: a collective there does not count
        events.append({"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "ts": end + 100, "dur": 2e3,
                       "tid": threads[0], "pid": 1})
    rng.shuffle(events)
    return events, busy / total


@second_hint(
    "Sort the collectives' (start, end) spans by start. For each step, clip every span to the step and add only "
    "the part past the end counted so far, so that overlapping collectives on several threads count once and time"
    " outside the steps not at all; divide by the steps' total duration."
)
def share_from_trace(fn) -> str | None:
    """Exercise 1: the share of a rank's steps with a collective in flight, from its trace events."""
    if not callable(fn):
        return f"communication_share must be a function, got {type(fn).__name__}"
    rng = case_generator()
    for case in range(3):
        events, truth = _trace(rng)
        got, forbidden = _watched_call(fn, [dict(e) for e in events])
        if forbidden:
            return forbidden
        if not isinstance(got, (int, float)) or abs(float(got) - truth) > 1e-9:
            return (f"on a trace of the check's own (case {case + 1}) it returned {got!r}, the share is {truth:.6f}: "
                    "count each moment once however many collectives overlap it, only inside the steps, and only "
                    "the process group's threads (gloo:/nccl: events)")
    return None


def _records(rng: random.Random, go_on: bool):
    """Each rank's collectives over the world and two halves of it, interleaved; one rank skips one collective of
    one group, and the others stop there. Then, as in real hangs: the ranks of a group that does not wait go on, and
    the rank that skipped may enter a later collective of another group, where it waits for ranks that never come
    (a second parting; always when ``go_on``). Returns the records and the truth: every parting."""
    world = rng.randrange(4, 9)
    half = world // 2
    groups = [tuple(range(world)), tuple(range(half)), tuple(range(half, world))]
    seq = {g: 0 for g in groups}
    records = {r: [] for r in range(world)}
    clock = [1_000]

    def run(g, members, done=True, op=None):
        seq[g] += 1
        op = op or rng.choice(("all_reduce", "all_to_all", "broadcast", "all_gather"))
        for r in members:
            clock[0] += 1
            records[r].append(Entered(g, seq[g], op, ((4,),), done, clock[0]))
        return op

    for _ in range(rng.randrange(4, 9)):  # collectives every member entered and finished
        run(g := rng.choice(groups), g)
    g = rng.choice(groups)
    skipper = rng.choice(g)
    op = run(g, [r for r in g if r != skipper], done=rng.random() < 0.5, op=rng.choice(("all_reduce",
                                                                                      "reduce_scatter")))
    truth = [{"group": g, "seq": seq[g], "op": op, "waiting": sorted(r for r in g if r != skipper),
              "missing": [skipper]}]
    free = [h for h in groups if not set(h) & set(g)]
    for _ in range(rng.randrange(1, 4) if free else 0):  # a group none of the stuck ranks is in goes on
        run(free[0], free[0])
    later = [h for h in groups if h != g and skipper in h and len(h) > 1]
    if later and (go_on or rng.random() < 0.5):
        h = later[0]
        op = run(h, [skipper], done=False)  # the skipper waits in turn, for ranks stuck in the first one
        truth.append({"group": h, "seq": seq[h], "op": op, "waiting": [skipper], "missing": [r for r in h
                                                                                        if r != skipper]})
    return {r: list(entries) for r, entries in records.items()}, truth


@second_hint(
    "Keep each rank's newest entry per (rank, group), not per rank: the newest collective in one group says "
    "nothing about another. Per group, the members whose newest seq is below the group's highest (0 if they "
    "entered none) are missing, the others waiting; op is the waiting members' entry's."
)
def parting_collectives(fn) -> str | None:
    """Exercise 2: every collective where the ranks' records part, who entered it and who never did."""
    if not callable(fn):
        return f"partings must be a function, got {type(fn).__name__}"
    rng = case_generator()
    for case in range(4):
        records, truth = _records(rng, go_on=case == 0)  # at least once, the skipper waits in turn
        got, forbidden = _watched_call(fn, {r: list(e) for r, e in records.items()})
        if forbidden:
            return forbidden
        if not isinstance(got, list) or not all(isinstance(p, dict) for p in got):
            return f"it returned {type(got).__name__}, not a list of dicts with keys {sorted(truth[0])}"
        got = sorted(({"group": tuple(p.get("group", ())), "seq": p.get("seq"), "op": p.get("op"),
                       "waiting": sorted(p.get("waiting", ())), "missing": sorted(p.get("missing", ()))}
                      for p in got), key=lambda p: p["group"])
        truth = sorted(truth, key=lambda p: p["group"])
        if got != truth:
            return (f"on records of the check's own ({len(records)} ranks, case {case + 1}) it found "
                    f"{len(got)} parting(s), not {len(truth)}, or not these: {truth}. Compare each group's "
                    "numbers across its members: a member below the others' highest number never entered it")
    return None
