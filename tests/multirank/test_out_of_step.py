"""Ranks out of step, as a learner meets them: a %%px cell fails on rank 1 only while rank 0 waits in a collective;
every later collective then finds the process group broken. The failing cell, an exercise check and a later %%px cell
each say that the ranks are out of step, why, and what to do, and the check judges nothing; cluster.restart() is the
fix it names, and after it the same cells pass. One kernel, two CPU ranks, collectives that time out after 5 s."""

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.multirank

CELLS = [
    "import shardlab as sl\ncluster = sl.start_cluster(n=2, device='cpu', timeout_s=5, keep_warm=False)",
    # rank 1 stops before the collective rank 0 enters: rank 0 waits 5 s, and the group breaks
    "%%px\nimport torch, torch.distributed as dist\nif dist.get_rank() == 1:\n    raise ValueError('on purpose')\n"
    "dist.all_reduce(torch.ones(1))",
    "%%px\nanswer = 3",
    # a judge as the exercises' are: its cases drawn by case_generator, a broadcast over the ranks
    "def judge(answer):\n    import shardlab as sl\n\n    sl.exercises.case_generator()\n"
    "    return None if answer == 3 else 'it is not 3'\n\n\n"
    "sl.exercises.on_ranks(cluster, judge, 'answer', what='the answer', hint='Count again.')",
    "%%px\ndist.all_reduce(torch.ones(1))",
    "cluster.restart()",
    "%%px\nimport torch, torch.distributed as dist\nanswer = 3\ndist.all_reduce(torch.ones(1))",
    "sl.exercises.on_ranks(cluster, judge, 'answer', what='the answer', hint='Count again.')",
    "cluster.stop()",
]
FAILED, CHECK, LATER, CHECK_AFTER_RESTART = 1, 3, 4, 7


def shown(cell) -> tuple[str, str, str]:
    """(the error's name, its traceback as shown, the printed text) of a cell that ran."""
    errors = [o for o in cell.outputs if o.output_type == "error"]
    printed = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
    if not errors:
        return "", "", printed
    return errors[0].ename, "\n".join(errors[0].traceback), printed


def test_a_broken_group_is_named_out_of_step_in_a_px_cell_and_in_a_check(no_leftovers):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=180, kernel_name="shardlab", allow_errors=True).execute()
    outcomes = [shown(cell) for cell in nb.cells]
    errors = {i: name for i, (name, _, _) in enumerate(outcomes) if name}
    assert errors == {FAILED: "CompositeError", CHECK: "OutOfStep", LATER: "CompositeError"}, outcomes

    _, failed, _ = outcomes[FAILED]
    assert failed.startswith("The ranks are out of step: rank(s) [0] found their process group broken "
                             "(RuntimeError: Timed out waiting 5000ms"), failed[:600]
    assert "Why: in this cell rank(s) [1] raised ValueError;" in failed
    assert "What to do: run cluster.restart() for fresh ranks" in failed
    assert "rank 1: ValueError: on purpose" in failed  # the per-rank summary and the tracebacks follow

    name, check, printed = outcomes[CHECK]
    assert check.startswith("OutOfStep: the answer: not checked. The ranks are out of step: rank(s) "), check
    assert "Why: an earlier %%px cell failed on rank(s) [1] only (ValueError)" in check
    assert "What to do: run cluster.restart()" in check
    assert "Traceback" not in check and "judging.py" not in check  # the message alone
    assert "✗" not in printed and "✓" not in printed and "it is not 3" not in check  # nothing judged

    _, later, _ = outcomes[LATER]
    assert later.startswith("The ranks are out of step: rank(s) [0, 1] found their process group broken"), later
    assert "Why: an earlier %%px cell failed on rank(s) [1] only (ValueError)" in later

    assert outcomes[CHECK_AFTER_RESTART] == ("", "", "✓ rank 0: the answer\n✓ rank 1: the answer\n")
