"""Notebook 15's judge on 4 CPU ranks, as ``sl.exercises.on_ranks`` runs it on a cluster's engines: the reference batch
norm handler passes every draw, on the judge's own models and splits; each rehearsed wrong answer fails every draw:
the input gathered first (``full_tensor``, and a redistribution to ``Replicate``), statistics of the rank's own rows,
the running buffers left as they were, and the answer key (the package's own handler, called).

    .venv/bin/python -m pytest tests/multirank/test_judges_nb15.py -q -p no:cacheprovider
"""

import json
from pathlib import Path

import nbformat
import pytest

from shardlab.ranks.launch import run_job

DRAWS = 2
# Each rehearsed wrong answer (by a word of its "why") and what its verdict must say: refused for what it does.
SAID = {"full_tensor": "gathered the field", "Replicate": "gathered the field", "own statistics": "differs from one",
        "running buffers": "the running mean", "answer key": "the answer key"}
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "15_port_your_model.ipynb"

ON_RANKS = r'''
import importlib
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from physicsnemo.domain_parallel import ShardTensor

import shardlab as sl
from shardlab.exercises.judging import _judge_here
from shardlab.exercises import nb15

sl.init_distributed(120)
folder, answers = sys.argv[1], json.loads(open(sys.argv[2]).read())
sys.path.insert(0, folder)
package = importlib.import_module("srresnet_domain")  # the notebook's module: registers its handlers
mesh = sl.build_mesh(ddp=1, domain=-1)
domain = mesh["domain"]
seen = {"a draw": sl.exercises.case_generator().random()}
for name, source in answers.items():
    space = {"torch": torch, "dist": dist, "F": F, "ShardTensor": ShardTensor, "srresnet_domain": package,
             "__name__": "__main__"}  # what the notebook's ranks hold when its answer cell runs
    exec(source, space)
    seen[name] = [_judge_here(nb15.shards_batch_norm, space["batch_norm_on_shards"], domain, package)
                  for _ in range(DRAWS)]
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, seen)
if dist.get_rank() == 0:
    sl.ranks.launch.write_job_result(rows)
sl.ranks.launch.shutdown_distributed()
'''


def cells():
    """(the notebook's module source, {answer: source}): the solution and its rehearsed wrong answers, as the cells
    hold them (the %% line left out)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    body = lambda source: "\n".join(source.splitlines()[1:]) if source.startswith("%%") else source  # noqa: E731
    [module] = [c.source for c in notebook.cells if c.source.startswith("%%writefile")]
    [solution] = [c for c in notebook.cells if "solution" in c.metadata.get("tags", [])]
    answers = {"right: the reference answer": body(solution.source)}
    for wrong in solution.metadata["shardlab"]["wrong_answers"]:
        answers[f"wrong: {wrong['why']}"] = body(wrong["source"])
    return body(module), answers


@pytest.mark.multirank
def test_the_reference_handler_passes_every_draw_and_each_wrong_answer_fails_every_draw(tmp_path, no_leftovers):
    module, answers = cells()
    (tmp_path / "srresnet_domain.py").write_text(module)
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    script = tmp_path / "judges.py"
    script.write_text(ON_RANKS.replace("DRAWS)", f"{DRAWS})"))
    verdicts = run_job("torchrun", 4, script, [str(tmp_path), str(tmp_path / "answers.json")], timeout_s=600,
                       device="cpu").result
    wrong = [] if len({rank["a draw"] for rank in verdicts}) == 1 else ["the ranks drew different cases"]
    assert sum(key.startswith("wrong") for key in answers) >= 4
    for answer in answers:
        for draw in range(DRAWS):
            said = [rank[answer][draw] for rank in verdicts]
            if answer.startswith("right") and said != [None] * len(verdicts):
                wrong.append(f"{answer}, draw {draw}: refused: {said}")
            if answer.startswith("wrong") and not all(said):
                wrong.append(f"{answer}, draw {draw}: passed on a rank: {said}")
            expected = [text for word, text in SAID.items() if word in answer]
            if answer.startswith("wrong") and not (expected and all(expected[0] in (s or "") for s in said)):
                wrong.append(f"{answer}, draw {draw}: refused for another reason than {expected}: {said}")
    assert not wrong, "\n".join(wrong)
