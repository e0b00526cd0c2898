"""Notebook 14's hang cell on an NCCL rank, simulated: the code it runs on the ranks must end in an error on the ranks
that wait, on NCCL as on gloo (issue 44 B)."""

import ast
import json
from pathlib import Path

import pytest
import torch

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "14_see_every_rank.ipynb"


def hang_code() -> str:
    """The code the hang cell hands to the ranks: the string it assigns to ``hang``."""
    cell = next(c for c in json.loads(NOTEBOOK.read_text())["cells"] if c.get("id") == "14-18")
    tree = ast.parse("".join(cell["source"]))
    return next(node.value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["hang"])


class NcclGroup:
    """The ranks' view of one NCCL process group with blocking wait off (``TORCH_NCCL_BLOCKING_WAIT=0``, which
    ``sl.init_distributed`` sets; ``sl.workarounds.NCCL_ERROR_HANDLING``), as torch 2.14.1 runs it:

    - a collective only queues its kernel and returns (ProcessGroupNCCL.hpp, lines 310-317: "At this point, NCCL
      kernel has already been queued successfully"; ``wait()`` only makes the current stream wait, lines 355-368;
      ``blockingWait_ = false``, line 1455);
    - a host read of its result (``.item()``) returns once the watchdog aborted the collective at the timeout, with
      ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, ``CleanUpOnly`` (lines 165-179: the process is not torn down);
    - the rank's next collective then raises, its communicator aborted (notebook 08, section 9, sees this message).
    """

    def __init__(self, world: int, skipper: int):
        self.world, self.skipper, self.aborted = world, skipper, set()

    def rank(self, me: int):
        group = self

        class Dist:
            @staticmethod
            def get_rank():
                return me

            @staticmethod
            def get_world_size():
                return group.world

            @staticmethod
            def all_reduce(tensor, *args, **kwargs):
                if me in group.aborted:
                    raise RuntimeError(f"NCCL communicator was aborted on rank {me}.")
                group.aborted.add(me)  # rank `skipper` never joins: the watchdog aborts it at the timeout

        return Dist


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_hang_cell_raises_on_the_waiting_ranks_on_nccl_and_finishes_on_the_one_that_skipped(world):
    group, code = NcclGroup(world, skipper=world - 1), hang_code()
    for me in range(world):
        namespace = {"dist": group.rank(me), "torch": torch, "device": torch.device("cpu"), "step": lambda i: None,
                     "time": __import__("time")}
        if me == world - 1:
            exec(code, namespace)  # the rank that skipped goes on
        else:
            with pytest.raises(RuntimeError, match="communicator was aborted"):
                exec(code, namespace)
