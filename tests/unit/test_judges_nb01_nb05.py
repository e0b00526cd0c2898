"""The judges of notebooks 01 and 05 draw their cases for each check, so an answer fitted to one draw fails the
next, and notebook 01's table of launcher variables is the one ``sl.detect_launch`` reads. 05's judges on real ranks:
tests/multirank/test_judges_nb05_on_ranks.py.

    .venv/bin/python -m pytest tests/unit/test_judges_nb01_nb05.py -q -p no:cacheprovider"""

import json
import random
import re
from pathlib import Path

import pytest

import shardlab as sl
from shardlab.exercises import nb01, nb05

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
DRAWS = range(300)
OLD_TORCHRUN_CASES = ((2, 4, 4), (5, 8, 4), (7, 8, 4), (1, 2, 1))  # what 01's judge used to try, every time


def torchrun_variables(rank, world_size, local_rank):
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


def reference(rank, world_size, nproc_per_node):
    return torchrun_variables(rank, world_size, rank % nproc_per_node)


def minus_one_node(rank, world_size, nproc_per_node):
    return torchrun_variables(rank, world_size, rank - nproc_per_node if rank >= nproc_per_node else rank)


def looked_up(rank, world_size, nproc_per_node):
    """Right on the old cases by a table of them, the rank elsewhere."""
    old = {(r, w, p): r % p for r, w, p in OLD_TORCHRUN_CASES}
    return torchrun_variables(rank, world_size, old.get((rank, world_size, nproc_per_node), rank))


def bit_mask(rank, world_size, nproc_per_node):
    return torchrun_variables(rank, world_size, rank & (nproc_per_node - 1))


def old_judge_verdict(make_env):
    """The old judge's rule on its fixed cases: a fitted answer passed it."""
    return all(reference(*case) == make_env(*case) for case in OLD_TORCHRUN_CASES)


def test_the_reference_answer_passes_every_draw():
    assert all(nb01.torchrun_environment(reference, random.Random(seed)) is None for seed in DRAWS)


@pytest.mark.parametrize("fitted", [minus_one_node, looked_up])
def test_answers_fitted_to_the_old_cases_fail_every_draw(fitted):
    assert old_judge_verdict(fitted)  # fitted indeed: the old cases could not tell
    assert all(nb01.torchrun_environment(fitted, random.Random(seed)) is not None for seed in DRAWS)


def test_a_bit_mask_that_works_for_powers_of_two_fails_on_most_draws():
    failed = sum(nb01.torchrun_environment(bit_mask, random.Random(seed)) is not None for seed in DRAWS)
    assert failed >= 0.9 * len(DRAWS)


def test_every_draw_has_the_jobs_where_shortcuts_go_wrong():
    for seed in DRAWS:
        jobs = nb01.torchrun_jobs(random.Random(seed))
        assert any(world == per_node > 1 for _, world, per_node in jobs), seed  # one node
        assert any(per_node == 1 < world for _, world, per_node in jobs), seed  # one process per node
        far = [(rank, per_node) for rank, _, per_node in jobs if rank >= 2 * per_node and rank % per_node]
        assert any(per_node & (per_node - 1) for _, per_node in far), seed  # not a power of two
        assert any(not per_node & (per_node - 1) for _, per_node in far), seed  # a power of two
        assert all(0 <= rank < world and world % per_node == 0 for rank, world, per_node in jobs), seed


def test_a_failure_names_only_the_job_it_got_wrong():
    for seed in range(20):
        verdict = nb01.torchrun_environment(minus_one_node, random.Random(seed))
        named = re.findall(r"rank (\d+) of (\d+) with (\d+) process", verdict)
        assert len(named) == 1, verdict
        rank, world, per_node = map(int, named[0])
        assert minus_one_node(rank, world, per_node) != reference(rank, world, per_node)
        assert f"not {rank % per_node}:" in verdict  # what torchrun sets there


def test_each_check_draws_new_jobs():
    def recording(calls):
        def make_env(*job):
            calls.append(job)
            return reference(*job)
        return make_env

    first, second = [], []
    assert nb01.torchrun_environment(recording(first)) is None
    assert nb01.torchrun_environment(recording(second)) is None
    assert first != second


def test_notebook_01s_table_is_what_detect_launch_reads():
    """The notebook's cells that write the table out and read it back, run here: their asserts compare every
    column ``sl.detect_launch`` reads; the table must also name every launcher the library knows."""
    cells = {c["id"]: "".join(c["source"]) for c in json.loads((NOTEBOOKS / "01_launchers.ipynb").read_text())["cells"]}
    namespace = {"sl": sl}
    exec(cells["01-03"], namespace)
    exec(cells["01-05"], namespace)
    assert sorted(d["launcher"] for d in namespace["detected"][:-1]) == sorted(sl.ranks.launch.BY_NAME)


@pytest.mark.parametrize("ddp_size", range(1, 9))
def test_notebook_05s_judged_models_vary_and_never_split_evenly(ddp_size):
    shapes = [nb05.judged_shape(random.Random(seed), ddp_size) for seed in DRAWS]
    assert ddp_size == 1 or all(s["width"] % ddp_size for s in shapes)
    assert len({s["width"] for s in shapes}) > 3 and len({s["layers"] for s in shapes}) > 1
    assert len({s["seed"] for s in shapes}) > 0.9 * len(DRAWS)
