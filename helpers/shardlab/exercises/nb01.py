"""Judges of ``notebooks/01_launchers.ipynb``: the learner's launcher environment and each rank's identity."""

from __future__ import annotations

import random

from ..ranks.launch import LaunchError, detect_launch
from .judging import case_generator, second_hint


def torchrun_jobs(draw: random.Random) -> list[tuple[int, int, int]]:
    """(rank, world size, processes per node) of torchrun jobs, drawn anew for each check: one node, one process per
    node, and ranks on a node past the second with a non-zero local rank, for a per-node count that is a power of two
    and one that is not. Those are where copying the rank, subtracting one node's count or masking bits go wrong."""
    one_node = draw.randint(2, 8)
    nodes = draw.randint(2, 5)
    jobs = [(draw.randrange(one_node), one_node, one_node), (draw.randrange(nodes), nodes, 1)]
    for per_node in (draw.choice((3, 5, 6, 7)), draw.choice((2, 4, 8))):
        nodes = draw.randint(3, 6)
        far = draw.randint(2, nodes - 1) * per_node + draw.randint(1, per_node - 1)
        jobs += [(far, nodes * per_node, per_node), (draw.randrange(nodes * per_node), nodes * per_node, per_node)]
    draw.shuffle(jobs)
    return jobs


@second_hint(
    "The processes of node m are the ranks m × nproc_per_node up to (m + 1) × nproc_per_node − 1, in order, so "
    "LOCAL_RANK is rank % nproc_per_node on every node (not the rank, not rank − nproc_per_node). Every value is "
    "a string (str(...)), and MASTER_ADDR and MASTER_PORT are the same for every process of the job."
)
def torchrun_environment(make_env, draw: random.Random | None = None) -> str | None:
    """``make_env(rank, world_size, nproc_per_node)`` must return what torchrun gives that process: judged by
    reading it back with ``sl.detect_launch`` for ranks of jobs drawn for this check (``torchrun_jobs``, from ``draw``
    or a fresh ``case_generator``). A wrong answer is told the one job it got wrong."""
    if not callable(make_env):
        return "define a function torchrun_environment(rank, world_size, nproc_per_node) that returns a dict"
    meeting_points = set()
    for rank, world, per_node in torchrun_jobs(draw or case_generator()):
        env = make_env(rank, world, per_node)
        where = f"for rank {rank} of {world} with {per_node} process(es) per node"
        if not isinstance(env, dict):
            return f"{where} it returned a {type(env).__name__}, not a dict of variables"
        not_text = sorted(name for name, value in env.items() if not isinstance(value, str))
        if not_text:
            return (f"{where}, {', '.join(not_text)} are not strings: environment variables are always text "
                    "(os.environ refuses anything else)")
        if not {"MASTER_ADDR", "MASTER_PORT"} <= set(env):
            return "torchrun also tells every process where rank 0 listens: MASTER_ADDR and MASTER_PORT"
        try:
            info = detect_launch(env)
        except LaunchError as error:
            return f"{where}, sl.detect_launch rejects it: {error}"
        if info.launcher != "torchrun":
            return f"{where} it is read as launcher {info.launcher!r}: use the variable names torchrun sets"
        if info.rank != rank or info.world_size != world:
            return f"{where} it reads as rank {info.rank} of {info.world_size}, which is not that process"
        if info.local_rank != rank % per_node:
            return (f"{where} the local rank reads as {info.local_rank}, not {rank % per_node}: LOCAL_RANK is the "
                    "process's index on its own node (it picks the GPU), not its rank in the whole job")
        meeting_points.add((env["MASTER_ADDR"], env["MASTER_PORT"]))
    if len(meeting_points) > 1:
        return ("MASTER_ADDR/MASTER_PORT differ between processes of one job: they all meet rank 0 at the same "
                "address and port")
    return None


@second_hint(
    "Compute it in a %%px cell, so that every rank answers for itself: manager = DistributedManager(), then "
    "(manager.rank, manager.local_rank, manager.world_size). Type no number in: the ranks' answers differ, the "
    "local rank too (0 only for a node's first process)."
)
def rank_identity(answer) -> str | None:
    """On a rank: ``answer`` must be ``(rank, local_rank, world_size)`` as that rank's DistributedManager says."""
    from physicsnemo.distributed import DistributedManager

    if not isinstance(answer, tuple) or len(answer) != 3:
        return f"answer is {answer!r}: set it to a tuple of three ints, (rank, local_rank, world_size)"
    manager = DistributedManager()
    truth = {"rank": manager.rank, "local_rank": manager.local_rank, "world_size": manager.world_size}
    wrong = [name for name, got in zip(truth, answer) if got != truth[name]]
    if wrong:
        verb = "differs" if len(wrong) == 1 else "differ"
        return f"{' and '.join(wrong)} {verb} from what DistributedManager says on this rank"
    return None
