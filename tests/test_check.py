"""Exercise checks: right answers pass, blank ones say "not answered yet", wrong ones say what is wrong
without giving the answer away (the notebooks rehearse every exercise with them: tests/test_notebooks.py)."""

import math

import pytest

from shardlab import check


class _Ranks:
    """Stands in for a cluster: runs the judge on each rank's namespace, as ipyparallel does on the engines."""

    def __init__(self, namespaces):
        self.view = self
        self.namespaces = namespaces

    def apply_sync(self, fn, judge, *references):
        return [fn(judge, *(ns[ref.name] for ref in references)) for ns in self.namespaces]


def test_on_ranks_passes_right_answers_and_names_wrong_ranks(capsys):
    ranks = _Ranks([{"answer": (0, 16)}, {"answer": (16, 32)}])

    def judge(answer):  # on a real rank the judge reads dist.get_rank(); here the answer says which
        return None if answer[1] - answer[0] == 16 else "a shard of 64 rows over 4 ranks has 16 rows"
    check.on_ranks(ranks, judge, "answer", what="rows held")
    assert capsys.readouterr().out.count("✓") == 2
    ranks.namespaces[1]["answer"] = (16, 40)
    with pytest.raises(check.NotSolved, match=r"rows held: wrong on rank\(s\) \[1\]: a shard of 64 rows") as failure:
        check.on_ranks(ranks, judge, "answer", what="rows held", hint="Count the rows.")
    assert "(16, 32)" not in str(failure.value)  # the right answer is not given away


def test_on_ranks_blank_everywhere_is_not_answered_yet():
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.on_ranks(_Ranks([{"answer": ...}, {"answer": ...}]), lambda a: None, "answer", what="rows")


def test_a_judge_that_breaks_on_the_answer_is_a_wrong_answer():
    with pytest.raises(check.NotSolved, match=r"checking it raised TypeError"):
        check.on_ranks(_Ranks([{"answer": 3}]), lambda a: len(a), "answer", what="rows")


def test_per_rank_does_not_print_the_expected_value(capsys):
    with pytest.raises(check.NotSolved, match=r"wrong on rank\(s\) \[1\]: 5 is not right"):
        check.per_rank([0, 5], [0, 1], "rank")
    out = capsys.readouterr().out
    assert "✓ rank 0" in out and "✗ rank 1: rank: 5 is not right" in out and "expected" not in out
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.per_rank([..., ...], [0, 1], "rank")
    with pytest.raises(check.NotSolved, match=r"3 answers for 2 ranks"):
        check.per_rank([0, 1, 2], [0, 1], "rank")


def test_judged_in_the_kernel():
    check.judged(lambda v: None if v == 4 else "no", 4, what="batch")
    with pytest.raises(check.NotSolved, match="batch: no"):
        check.judged(lambda v: None if v == 4 else "no", 2, what="batch")
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.judged(lambda v: None, ..., what="batch")


def test_answer_tolerates_rounding_but_not_a_wrong_value():
    check.answer(0.1 + 0.2, 0.3, "float sum")
    with pytest.raises(check.NotSolved, match=r"got 0\.31, which is not right\. hint"):
        check.answer(0.31, 0.3, "float sum", hint="hint")
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.answer(..., 0.3, "float sum")


@pytest.mark.parametrize("got, match", [
    (..., "not answered yet"),
    ([1e-7, ...], "not answered yet on rank 1"),
    (2e-5, r"2e-05 is not a number ≤ 1e-05"),
    ([1e-7, math.nan], r"on rank 1: nan is not a number ≤ 1e-05"),
    ("0", "'0' is not a number"),
])
def test_at_most_rejects_blank_large_and_non_numbers(got, match):
    with pytest.raises(check.NotSolved, match=match):
        check.at_most(got, 1e-5, "error")


def test_at_most_accepts_small_numbers(capsys):
    check.at_most([0.0, 1e-6], 1e-5, "error")
    assert "✓ error" in capsys.readouterr().out


def test_launcher_environment_wrong_paths():
    with pytest.raises(check.NotSolved, match="MASTER_ADDR"):
        check.launcher_environment({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, "torchrun", 2, 4, 2)
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(check.NotSolved, match=r"rank=1 \(expected 2\)"):
        check.launcher_environment(env, "torchrun", 2, 4, 2)
    with pytest.raises(check.NotSolved, match="detect_launch rejects it"):
        check.launcher_environment(env | {"RANK": "x"}, "torchrun", 2, 4, 2)
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.launcher_environment(..., "torchrun", 2, 4, 2)
