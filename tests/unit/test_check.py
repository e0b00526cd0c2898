"""Exercise checks: right answers pass, blank ones say "not answered yet", wrong ones say what is wrong
without giving the answer away (the notebooks rehearse every exercise with them: tests/notebooks/test_notebooks.py)."""

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


def test_each_check_draws_other_cases():
    draws = {tuple(check.case_generator().random() for _ in range(3)) for _ in range(5)}
    assert len(draws) == 5  # seeded afresh each time (the same on every rank: tests/multirank/test_judges_draw.py)


# Watching the work: the recorder every judge uses.

def _library_function(x):
    return x + 1


def _learner_answer(x):
    alias = _library_function  # an alias does not hide the call: the code object is the same
    return alias(x) * 2


def test_watch_records_a_watched_function_through_an_alias_with_its_arguments():
    with check.Watch(library=_library_function) as watch:
        assert _learner_answer(3) == 8
    assert [(e.name, e.arguments) for e in watch.calls()] == [("library", {"x": 3})]
    assert watch.forbidden(library="which this exercise rebuilds") == "it called library, which this exercise rebuilds"
    with check.Watch(library=_library_function) as watch:
        assert 2 * (3 + 1) == 8  # the same result, without the library
    assert watch.forbidden(library="which this exercise rebuilds") is None


def test_watch_records_c_functions_and_patched_attributes_and_restores_them():
    import torch

    class Owner:
        @staticmethod
        def count(start, step=1):
            return start + 6 * step

    with check.Watch(chunk=(torch.chunk, torch.Tensor.chunk), attributes={"count": (Owner, "count")},
                     collectives=False) as watch:
        torch.ones(4).chunk(2)
        assert Owner.count(1) == 7
    assert [e.name for e in watch.calls()] == ["chunk", "count"]
    assert watch.calls("count")[0].arguments == {"start": 1, "step": 1}  # as received, defaults filled in
    assert Owner.count.__name__ == "count" and check.sys.getprofile() is None  # all put back


def test_watch_records_collectives_with_their_group_and_the_bytes_sent():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with check.Watch(ranks_asked=dist.get_process_group_ranks) as watch:
            t = torch.ones(3)
            dist.all_reduce(t)
            dist.broadcast(torch.ones(5), src=0)
            out = torch.empty(4)
            dist.all_gather_single(out, torch.ones(4))
        assert [(e.name, e.ranks, e.bytes) for e in watch.collectives()] == [
            ("all_reduce", (0,), 12), ("broadcast", (0,), 20), ("all_gather", (0,), 16)]  # the input, not the output
        assert watch.collectives("broadcast", ranks=[0]) and not watch.collectives("broadcast", ranks=[0, 1])
        assert not watch.calls("ranks_asked")  # the recorder asks for the groups' ranks; the watched code did not
    finally:
        dist.destroy_process_group()


def test_earlier_object_names_an_object_or_storage_from_the_namespace_and_nothing_new():
    import torch

    namespace = {"x": torch.arange(6.0), "answer": (1, 2), "count": 3}
    learner = eval("lambda: None", namespace)  # a function defined in that namespace, as in a notebook cell
    said = "it returned {}, an object from earlier in the notebook"
    assert check.earlier_object(namespace["x"], learner) == said.format("x")
    assert check.earlier_object(namespace["x"][2:], learner) == said.format("x")  # a view shares the storage
    assert check.earlier_object(namespace["answer"], learner) == said.format("answer")
    assert check.earlier_object(3, learner) is None  # small constants are not objects from earlier
    assert check.earlier_object(torch.arange(6.0), learner) is None
