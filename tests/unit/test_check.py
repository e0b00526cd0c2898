"""Exercise checks: right answers pass, blank ones say "not answered yet", wrong ones say what is wrong
without giving the answer away (the notebooks rehearse every exercise with them: tests/notebooks/test_notebooks.py)."""

import pytest

from shardlab.exercises import judging as check
from shardlab.ranks import px as sl_px


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


SHELL_PROBE = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance(colors="nocolor")
result = shell.run_cell('''
import shardlab as sl
sl.exercises.judged(lambda value: "it read 1216 bytes, where this rank's rows lie in 320", 3, what="the slab read",
                hint="Index the array with this rank's rows before converting it.")
''')
print("FAILED WITH", type(result.error_in_exec).__name__)
"""


def test_a_wrong_answer_shows_its_message_and_hint_and_none_of_the_judges_code(fresh_python):
    """In IPython, as in a notebook: one line for the learner, no traceback into judging.py; the cell still fails."""
    out = fresh_python.run(SHELL_PROBE, timeout_s=60).stdout
    shown = out.split("FAILED WITH")[0].strip().splitlines()
    assert shown == ["NotSolved: the slab read: it read 1216 bytes, where this rank's rows lie in 320. Index the array "
                     "with this rank's rows before converting it."], out
    assert out.strip().endswith("FAILED WITH NotSolved"), out


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
               "[127.0.0.1]:8927. This is typically caused by a remote worker crashing. GLHF!")


def test_a_judge_that_meets_a_broken_process_group_judges_nothing_and_says_the_ranks_are_out_of_step(capsys):
    def judge(answer):  # a right answer; the judge's own broadcast finds the group broken on rank 1
        if answer == "rank 1":
            raise RuntimeError(GLOO_CLOSED)
        return None

    ranks = _Ranks([{"answer": "rank 0"}, {"answer": "rank 1"}])
    with pytest.raises(sl_px.OutOfStep) as raised:
        check.on_ranks(ranks, judge, "answer", what="the slab", hint="Read fewer rows.")
    message = str(raised.value)
    assert message.startswith("the slab: not checked. The ranks are out of step: rank(s) [1] found their process "
                              "group broken (RuntimeError: Connection closed by peer [127.0.0.1]:8927."), message
    assert "an earlier cell failed" not in message and "a cell failed, or was interrupted, on some ranks" in message
    assert "run cluster.restart()" in message and "Read fewer rows" not in message
    assert capsys.readouterr().out == ""  # no ✓ or ✗: nothing was judged
    assert raised.value._render_traceback_()[0].startswith("OutOfStep: the slab: not checked.")


def test_an_error_that_is_not_about_the_process_group_is_still_the_answers_fault():
    with pytest.raises(check.NotSolved, match=r"checking it raised RuntimeError: expected a ShardTensor"):
        check.on_ranks(_Ranks([{"answer": 3}]), lambda a: (_ for _ in ()).throw(RuntimeError("expected a ShardTensor")),
                       "answer", what="rows")


def test_in_the_learners_copy_a_failed_check_says_so_and_lets_run_all_go_on(monkeypatch, capsys):
    from shardlab.exercises import judging as check

    monkeypatch.setenv(check.CHECKS, "report")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # as in a learner's kernel
    check.answer(3, 4, "the number of ranks", hint="Count the engines.")  # no exception
    said = capsys.readouterr().err
    assert said.startswith("NotSolved: the number of ranks: got 3, which is not right. Count the engines.")
    assert "Run All goes on" in said
    check.judged(lambda v: None, 1, what="the answer")  # a right one still says ✓
    assert "✓ the answer" in capsys.readouterr().out


def test_under_pytest_and_in_the_instructor_copy_a_failed_check_fails_the_cell(monkeypatch):
    from shardlab.exercises import judging as check

    monkeypatch.setenv(check.CHECKS, "report")  # pytest is running: nbmake must see the failure
    with pytest.raises(check.NotSolved):
        check.answer(3, 4, "the number of ranks")
    monkeypatch.delenv(check.CHECKS)
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    with pytest.raises(check.NotSolved):
        check.answer(3, 4, "the number of ranks")


def test_each_check_reports_to_the_class_folder_where_one_is_set_up(monkeypatch, tmp_path):
    from shardlab.exercises import judging as check
    from shardlab.exercises import progress

    monkeypatch.setenv(progress.CLASS_DIR, str(tmp_path))
    monkeypatch.setenv("JUPYTERHUB_USER", "ana")
    with pytest.raises(check.NotSolved):
        check.answer(3, 4, "the number of ranks")
    check.answer(4, 4, "the number of ranks")
    with pytest.raises(check.NotSolved, match="not answered yet"):
        check.answer(..., 4, "the number of ranks")  # a blank is not a try
    assert [(r["exercise"], r["passed"]) for r in progress.read_class(tmp_path)] == [
        ("the number of ranks", False), ("the number of ranks", True)]
