"""Which collectives each rank entered, from torch's Flight Recorder, and where the ranks' sequences part.

``entered()`` reads, on a rank, the last collective each of its groups entered, from both of torch's recorders (gloo's
and NCCL's), so a hang reads the same on every backend; ``sl.ranks.panel`` shows it live, notebook 14 after a hang.
Where torch keeps the records and why both recorders are read: docs/errors.md#which-collectives-each-rank-entered.

No shardlab imports; torch loads only on a rank, in ``entered()`` and ``dump()``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

BUFFER = "TORCH_FR_BUFFER_SIZE"
TORCH_DEFAULT_ENTRIES = 2000  # FlightRecorder.hpp, line 111: what an unset variable means (recording on)
# Collectives kept per rank, fewer than torch's 2,000: a hang needs the newest of each group, and a read costs in
# proportion to what is kept (the live panel reads it while ranks run).
BUFFER_ENTRIES = 500


def buffer_entries(env=None) -> int:
    """How many collectives this process's recorders keep (0: recording off), as FlightRecorder.hpp reads it: the
    first of TORCH_FR_BUFFER_SIZE and TORCH_NCCL_TRACE_BUFFER_SIZE that is set, else 2,000."""
    env = os.environ if env is None else env
    for name in (BUFFER, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        if env.get(name, "").strip():
            return int(env[name])
    return TORCH_DEFAULT_ENTRIES


_initialised_ns = 0  # when this rank last joined a process group: what it entered before is another job's


def enable() -> None:
    """Shrink this process's recorders to ``BUFFER_ENTRIES`` (recording is on anyway; a rank's own choice wins; each
    recorder reads the variable once, when it is first used, so call this before the first process group), and note
    when this rank joined its groups."""
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


def recorded(dumps=None) -> list[dict]:
    """Every entry this rank's recorders hold, oldest first: the generic one's (gloo) and NCCL's, each the JSON its
    dump function writes. ``dumps``: those functions, for a test; by default torch's, each called with
    (includeCollectives=True, onlyActive=False). An entry both recorders hold (one group, one number) counts once."""
    if dumps is None:
        import torch._C._distributed_c10d as c10d_c

        # _dump_nccl_trace_json is missing from builds without NCCL: there only the generic recorder exists.
        dumps = [c10d_c._dump_fr_trace_json, *([c10d_c._dump_nccl_trace_json]
                                               if hasattr(c10d_c, "_dump_nccl_trace_json") else [])]
    seen, out = set(), []
    for dump in dumps:
        for entry in json.loads(dump(True, False)).get("entries", []):
            key = (entry["process_group"][0], bool(entry.get("is_p2p")), entry["collective_seq_id"],
                   entry.get("p2p_seq_id"), entry["profiling_name"])
            if key not in seen:
                seen.add(key)
                out.append(entry)
    return sorted(out, key=lambda e: e["time_created_ns"])


def _kept(entry: dict, names: dict, since_ns: int) -> bool:
    # A group this rank has torn down, a send/recv (numbered apart), or older than asked: left out.
    return entry["process_group"][0] in names and not entry.get("is_p2p") and entry["time_created_ns"] >= since_ns


def entered(since_ns: int | None = None, dumps=None) -> list[Entered]:
    """On a rank: the collectives it entered (oldest first) that its recorders still hold, from ``since_ns`` on
    (``time.time_ns()`` of an earlier moment), by default since the rank last joined a process group (a rank kept
    warm for the next notebook recorded the last one's too, under group names that are used again). Empty only when
    recording is off (a buffer size of 0, set before the first group was made). ``dumps``: as for ``recorded``."""
    if not buffer_entries():
        return []
    names, out = group_ranks(), []
    since_ns = _initialised_ns if since_ns is None else since_ns
    for entry in recorded(dumps):
        if not _kept(entry, names, since_ns):
            continue
        out.append(Entered(group=names[entry["process_group"][0]], seq=int(entry["collective_seq_id"]),
                           op=entry["profiling_name"].split(":")[-1], sizes=tuple(map(tuple, entry["input_sizes"])),
                           done=bool(entry.get("retired")) and entry.get("state") != "started",
                           started_ns=int(entry["time_created_ns"]), pg=entry["process_group"][0]))
    return out


def dump(since_ns: int | None = None, dumps=None) -> bytes:
    """This rank's record as torch's analyzer reads it (``torch.distributed.flight_recorder``: one file per rank,
    a pickle of the dump's dict, named ``<prefix><rank>``), with what ``entered()`` keeps, and two repairs:

    - ``pg_config`` from this rank's groups (their names and global ranks). The analyzer matches each entry to its
      group through it (flight_recorder/components/builder.py, ``build_groups_memberships``), and gloo's recorder
      holds one item there, named "", with the ranks numbered inside the group (measured on torch 2.14.1 gloo ranks):
      the analyzer then stops with a KeyError.
    - ``record_id`` counted again from 0: the analyzer aligns the ranks on it (components/utils.py,
      ``align_trace_from_beginning``), and it counts every collective since the process began, which differs between
      ranks of a cluster kept warm across notebooks. ``since_ns``: as for ``entered()``."""
    import pickle

    import torch._C._distributed_c10d as c10d_c
    import torch.distributed.distributed_c10d as c10d

    names = group_ranks()
    since_ns = _initialised_ns if since_ns is None else since_ns
    entries = [dict(e, record_id=i) for i, e in enumerate(e for e in recorded(dumps) if _kept(e, names, since_ns))]
    descs = {pg_name: pg.group_desc for pg, pg_name in c10d._world.pg_names.items() if pg_name in names}
    descs |= {e["process_group"][0]: e["process_group"][1] for e in entries}
    raw = pickle.loads(c10d_c._dump_fr_trace(False, False, False))  # the version and library fields, as torch writes
    return pickle.dumps(dict(raw, entries=entries, pg_config={
        name: {"name": name, "desc": descs.get(name, "undefined"), "ranks": str(list(ranks))}
        for name, ranks in names.items()}))


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
