"""Which collectives each rank entered, from torch's Flight Recorder, and where the ranks' sequences part.

torch numbers the collectives of every process group on every rank (``collective_seq_id``) and, when
``TORCH_FR_BUFFER_SIZE`` is set before the group is made, keeps the last ones in a ring buffer: gloo's as well as
NCCL's (torch 2.14). ``sl.init_distributed`` sets it on every rank of the series. A hung job reads the same way on
every backend: the ranks that entered collective #k of a group wait for the members whose last one there is below
#k. ``sl.ranks.panel`` shows it live; ``notebooks/14_see_every_rank.ipynb`` reads it after a hang.

No shardlab imports; torch loads only on a rank, in ``entered()``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

BUFFER = "TORCH_FR_BUFFER_SIZE"
# Collectives kept per rank (torch's default, 0, records nothing): a hang needs the newest of each group, and a read
# costs in proportion to what is kept (the live panel reads it while ranks run).
BUFFER_ENTRIES = 500


_initialised_ns = 0  # when this rank last joined a process group: what it entered before is another job's


def enable() -> None:
    """Turn recording on for the process groups this process makes from now on (a rank's own choice wins)."""
    global _initialised_ns
    os.environ.setdefault(BUFFER, str(BUFFER_ENTRIES))
    _initialised_ns = time.time_ns()


@dataclass(frozen=True)
class Entered:
    """One collective a rank entered: its group (global ranks), its number there, what it was, and whether it is
    done."""

    group: tuple[int, ...]
    seq: int
    op: str  # "all_reduce", "broadcast", ... (the backend's prefix removed)
    sizes: tuple = ()
    done: bool = True
    started_ns: int = 0
    pg: str = ""  # the process group's name: two groups of the same ranks number their collectives apart

    def label(self) -> str:
        return f"{self.op} #{self.seq} of group {list(self.group)}"


def group_ranks() -> dict[str, tuple[int, ...]]:
    """Every process group of this rank, by the name the Flight Recorder records, as its global ranks."""
    import torch.distributed.distributed_c10d as c10d

    return {name: tuple(sorted(c10d._world.pg_group_ranks[pg])) for pg, name in c10d._world.pg_names.items()
            if isinstance(pg, c10d.ProcessGroup) and pg in c10d._world.pg_group_ranks}


def entered(since_ns: int | None = None) -> list[Entered]:
    """On a rank: the collectives it entered (oldest first) that the recorder still holds, from ``since_ns`` on
    (``time.time_ns()`` of an earlier moment), by default since the rank last joined a process group (a rank kept
    warm for the next notebook recorded the last one's too, under group names that are used again). Empty when
    recording is off."""
    import torch._C._distributed_c10d as c10d_c

    if not int(os.environ.get(BUFFER, "0") or 0):
        return []
    names, out = group_ranks(), []
    since_ns = _initialised_ns if since_ns is None else since_ns
    for entry in json.loads(c10d_c._dump_fr_trace_json(True, False)).get("entries", []):
        name = entry["process_group"][0]
        if name not in names or entry.get("is_p2p") or entry["time_created_ns"] < since_ns:
            continue  # a group this rank has torn down, a send/recv (numbered apart), or older than asked
        out.append(Entered(group=names[name], seq=int(entry["collective_seq_id"]),
                           op=entry["profiling_name"].split(":")[-1], sizes=tuple(map(tuple, entry["input_sizes"])),
                           done=bool(entry.get("retired")) and entry.get("state") != "started",
                           started_ns=int(entry["time_created_ns"]), pg=name))
    return out


@dataclass(frozen=True)
class Wait:
    """Ranks waiting in a collective that other members of its group never entered."""

    entered: Entered  # the collective they wait in (as the waiting ranks recorded it)
    waiting: tuple[int, ...]
    missing: tuple[int, ...]  # members whose last collective in the group is below it
    their_last: dict  # missing rank -> its last Entered in the group, or None

    def sentence(self) -> str:
        before = "; ".join(
            f"rank {r}'s last there was {e.op} #{e.seq}" if e else f"rank {r} entered none there"
            for r, e in sorted(self.their_last.items()))
        return (f"rank(s) {list(self.waiting)} wait in {self.entered.label()} for rank(s) {list(self.missing)}, "
                f"which never entered it ({before}).")


def waits(records: dict[int, list[Entered]], read_ns: dict[int, int] | None = None) -> list[Wait]:
    """Where the ranks' records part: for each group, the members whose newest collective there is the highest
    number, and the members who never reached it. A collective that every member entered cannot have finished
    without them, so the ranks ahead are waiting (live) or timed out waiting (read after a failed cell).

    ``records``: each rank's ``entered()``; a rank whose record could not be read is left out and counts as having
    entered nothing. ``read_ns``: when each rank's record was read, for records read while the ranks run (the
    live panel): a rank read before the others entered the collective is not counted as missing it.

    In the order the waiting ranks entered them. A rank that skipped a collective often goes on into another one and
    waits there for ranks stuck in the first: a cycle of waits, which the records show but cannot order by cause
    (each rank's clock says when it entered, not which wait came first in the program); the code of the collectives
    they name does."""
    last: dict[tuple[int, tuple], Entered] = {}  # (rank, (group's name, its ranks)) -> its newest there
    for rank, entries in records.items():
        for e in entries:
            if (rank, (e.pg, e.group)) not in last or e.seq > last[rank, (e.pg, e.group)].seq:
                last[rank, (e.pg, e.group)] = e
    found = []
    for key in {k for _, k in last}:
        newest = {r: last.get((r, key)) for r in key[1]}
        top = max(e.seq for e in newest.values() if e is not None)
        waiting = tuple(r for r, e in newest.items() if e is not None and e.seq == top)
        entered_at = min(newest[r].started_ns for r in waiting)
        missing = tuple(r for r, e in newest.items() if (e is None or e.seq < top)
                        and (read_ns is None or read_ns.get(r, 0) > entered_at))
        if missing:
            found.append(Wait(newest[waiting[0]], waiting, missing, {r: newest[r] for r in missing}))
    return sorted(found, key=lambda w: w.entered.started_ns)
