"""sl.measure.flight without ranks: where the ranks' records of the collectives they entered part, from records built
here (notebook 14 reads real ones after a hang; the live panel reads them while the ranks run)."""

import json
import pickle

import pytest

from shardlab.measure import flight
from shardlab.measure.flight import Entered, waits

WORLD, PAIR = (0, 1, 2, 3), (2, 3)


def record(*entries):
    return [Entered(group, seq, op, (), done, t) for t, (group, seq, op, done) in enumerate(entries, start=1)]


def test_a_rank_that_skipped_a_collective_is_named_with_its_last_one_there():
    skipped = record((WORLD, 1, "broadcast", True))
    entered = record((WORLD, 1, "broadcast", True), (WORLD, 2, "all_reduce", False))
    [wait] = waits({0: entered, 1: entered, 2: entered, 3: skipped})
    assert (wait.waiting, wait.missing, wait.entered.op, wait.entered.seq) == ((0, 1, 2), (3,), "all_reduce", 2)
    assert wait.sentence() == ("rank(s) [0, 1, 2] wait in all_reduce #2 of group [0, 1, 2, 3] for rank(s) [3], which "
                               "never entered it (rank 3's last there was broadcast #1).")


def test_records_that_agree_part_nowhere_and_a_silent_rank_counts_as_having_entered_nothing():
    same = record((WORLD, 1, "all_reduce", True), (PAIR, 1, "all_to_all", True))
    assert waits({r: same for r in WORLD}) == []
    found = waits({0: same, 1: same, 2: same})  # rank 3's record could not be read: missing in both its groups
    assert [(w.entered.group, w.missing, w.their_last) for w in found] == [(WORLD, (3,), {3: None}),
                                                                          (PAIR, (3,), {3: None})]
    assert "rank 3 entered none there" in found[0].sentence()


def test_a_cycle_of_waits_shows_both_partings():
    behind_in_world = record((PAIR, 1, "broadcast", True), (PAIR, 2, "broadcast", False))
    ahead_in_world = record((PAIR, 1, "broadcast", True), (WORLD, 1, "all_reduce", False))
    found = waits({0: ahead_in_world, 1: ahead_in_world, 2: ahead_in_world, 3: behind_in_world})
    assert {(w.entered.group, w.waiting, w.missing) for w in found} == {(WORLD, (0, 1, 2), (3,)), (PAIR, (3,), (2,))}


def test_a_record_read_before_the_others_entered_is_not_a_wait():
    old = record((WORLD, 1, "all_reduce", True))
    new = record((WORLD, 1, "all_reduce", True), (WORLD, 2, "all_reduce", False))  # entered at t = 2
    records = {0: new, 1: new, 2: new, 3: old}
    assert waits(records, read_ns={0: 5, 1: 5, 2: 5, 3: 1}) == []  # rank 3 was read at t = 1: it may be there now
    assert [w.missing for w in waits(records, read_ns={0: 5, 1: 5, 2: 5, 3: 9})] == [(3,)]


def test_two_groups_of_the_same_ranks_are_numbered_apart():
    world_group = [Entered(PAIR, 5, "all_reduce", (), True, 1, pg="0")]
    pair_group = [Entered(PAIR, 2, "broadcast", (), True, 2, pg="1")]
    assert waits({2: world_group + pair_group, 3: world_group + pair_group}) == []
    [wait] = waits({2: world_group + pair_group, 3: world_group})
    assert (wait.entered.pg, wait.waiting, wait.missing) == ("1", (2,), (3,))


# What the two recorders' JSON dumps hold on a rank whose group is NCCL (the keys as torch 2.14.1 writes them; gloo's
# recorder then holds no entries, and its dump has no "entries" key at all, as measured on a gloo rank that ran none).
def _dump(entries=None) -> bytes:
    body = {"version": "2.10", "pg_config": {}, "pg_status": {}, "comm_lib_version": "", "nccl_comm_state": {}}
    return json.dumps(body if entries is None else dict(body, entries=entries)).encode()


def _entry(seq, op, t, pg="0", state="completed", retired=True):
    return {"process_group": [pg, "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 0, "is_p2p": False,
            "profiling_name": f"nccl:{op}", "input_sizes": [[4]], "retired": retired, "state": state,
            "time_created_ns": t, "record_id": seq - 1}


@pytest.fixture
def nccl_rank(monkeypatch):
    """A rank of a 2-rank NCCL group named "0", its recorders as torch 2.14.1 keeps them: the NCCL group's entries in
    ``FlightRecorder<c10::cuda::CUDAEvent>`` (libtorch_cuda.so instantiates it: symbols
    ``_ZN4c10d14FlightRecorderIN3c104cuda9CUDAEventEE...``), which only ``_dump_nccl_trace_json`` dumps; the generic
    ``FlightRecorder<c10::Event>`` that ``_dump_fr_trace_json`` dumps holds gloo's (hooks/FlightRecorderHook.hpp,
    lines 8-14), none here. TORCH_FR_BUFFER_SIZE unset, as on a job that never set it."""
    import torch._C._distributed_c10d as c10d_c

    entries = [_entry(1, "all_reduce", 10), _entry(2, "broadcast", 20, state="started", retired=False)]
    monkeypatch.setattr(c10d_c, "_dump_fr_trace_json", lambda *_: _dump(), raising=False)
    monkeypatch.setattr(c10d_c, "_dump_nccl_trace_json", lambda *_: _dump(entries), raising=False)
    monkeypatch.setattr(flight, "group_ranks", lambda: {"0": (0, 1)})
    monkeypatch.setattr(flight, "_initialised_ns", 0)
    for name in (flight.BUFFER, "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_an_unset_buffer_size_is_torchs_default_of_2000_entries_not_off():
    """FlightRecorder.hpp (torch 2.14.1 include dir), lines 106-114: ``max_entries_ = getCvarInt(
    {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)``, ``enabled_ = max_entries_ > 0``."""
    assert flight.buffer_entries({}) == 2000
    assert flight.buffer_entries({"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}) == 64
    assert flight.buffer_entries({flight.BUFFER: "500", "TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}) == 500
    assert flight.buffer_entries({flight.BUFFER: "0"}) == 0


def test_an_nccl_ranks_collectives_are_read_from_the_nccl_recorder_with_the_variable_unset_or_set(nccl_rank,
                                                                                                   monkeypatch):
    """Issue 44 A: on a CUDA rank the NCCL group's collectives are in the NCCL recorder only."""
    expected = [((0, 1), 1, "all_reduce", True), ((0, 1), 2, "broadcast", False)]
    assert [(e.group, e.seq, e.op, e.done) for e in flight.entered()] == expected
    monkeypatch.setenv(flight.BUFFER, str(flight.BUFFER_ENTRIES))  # as sl.init_distributed sets it
    assert [(e.group, e.seq, e.op, e.done) for e in flight.entered()] == expected


def test_the_analyzers_dump_carries_the_groups_global_ranks_and_numbers_from_0(nccl_rank, monkeypatch):
    import torch._C._distributed_c10d as c10d_c

    monkeypatch.setattr(c10d_c, "_dump_fr_trace", lambda *_: pickle.dumps({"version": "2.10", "pg_config": {
        "": {"name": "", "desc": "", "ranks": "[0]"}}}), raising=False)  # gloo's, as measured: no name, local ranks
    dumped = pickle.loads(flight.dump(since_ns=15))
    assert dumped["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    assert [(e["collective_seq_id"], e["record_id"]) for e in dumped["entries"]] == [(2, 0)]
    assert dumped["version"] == "2.10"
