"""sl.flight without ranks: where the ranks' records of the collectives they entered part, from records built here
(notebook 14 reads real ones after a hang; the live panel reads them while the ranks run)."""

from shardlab.flight import Entered, waits

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
