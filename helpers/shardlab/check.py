"""Exercise checks: say what is right and what is wrong, per rank where it matters.

Every notebook from ``01_launchers`` on ends with exercises; each answer cell sets ``answer`` (or
the names the exercise asks for) and the next cell calls one of these. A blank answer (``...``)
fails with "not answered yet".

A check judges behaviour, not a constant: ``on_ranks`` runs a judge on every rank, next to the
learner's own objects (their local shards, placements, gradients), and the judge works out what
is right from that rank's state. A judge returns None when the answer is right, or a sentence
saying what is wrong without giving the answer away.
"""

from __future__ import annotations

import math

from .launch import LaunchError, detect_launch


class NotSolved(AssertionError):
    """The answer is missing or wrong; the message says which part, and a hint."""


def _blank(value) -> bool:
    return value is Ellipsis or value is None


def _same(got, expected) -> bool:
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    return got == expected


def answer(got, expected, what: str, hint: str = "") -> None:
    """One answer for the whole notebook (no ranks involved)."""
    if _blank(got):
        raise NotSolved(f"{what}: not answered yet (answer is still {got!r}).")
    if not _same(got, expected):
        raise NotSolved(f"{what}: got {got!r}, which is not right. {hint}".strip())
    print(f"✓ {what}: {got!r}")


def per_rank(got: list, expected: list, what: str, hint: str = "") -> None:
    """One answer per rank (``cluster.view.pull("answer")``), each against that rank's expected value.

    A wrong rank is named with what it answered, never with the expected value."""
    if len(got) != len(expected):
        raise NotSolved(f"{what}: {len(got)} answers for {len(expected)} ranks; set `answer` in a %%px cell.")
    _report([None if not _blank(g) and _same(g, e) else ("blank" if _blank(g) else f"{g!r} is not right")
             for g, e in zip(got, expected)], what, hint)


def _report(verdicts: list, what: str, hint: str) -> None:
    """Print one line per rank; raise NotSolved naming the wrong ranks (or saying nothing was answered)."""
    for rank, verdict in enumerate(verdicts):
        said = "" if verdict is None else ": not answered yet" if verdict == "blank" else f": {verdict}"
        print(f"{'✓' if verdict is None else '✗'} rank {rank}: {what}{said}")
    if all(v == "blank" for v in verdicts):
        raise NotSolved(f"{what}: not answered yet on any rank.")
    wrong = [rank for rank, v in enumerate(verdicts) if v is not None]
    if wrong:
        first = next((v for v in verdicts if v not in (None, "blank")), "not answered yet")
        raise NotSolved(f"{what}: wrong on rank(s) {wrong}: {first.rstrip('.')}. {hint}".strip())


def _judge_here(judge, *values):
    """Runs on a rank: the judge's verdict on that rank's values ("blank" if any is still ``...``)."""
    if any(_blank(v) for v in values):
        return "blank"
    try:
        return judge(*values)
    except Exception as error:  # the learner's object broke the judge: that is a wrong answer, said plainly
        return f"checking it raised {type(error).__name__}: {error}"


def on_ranks(cluster, judge, *names: str, what: str, hint: str = "") -> None:
    """Judge, on every rank, the learner's objects called ``names`` (``judge(*objects)`` runs where they live).

    ``judge`` returns None when the answer is right on that rank, or a sentence saying what is wrong;
    it computes what is right from the rank's own state, so nothing in the check cell gives it away.
    """
    from ipyparallel import Reference

    verdicts = cluster.view.apply_sync(_judge_here, judge, *(Reference(name) for name in names))
    _report(verdicts, what, hint)


def judged(judge, *values, what: str, hint: str = "") -> None:
    """One answer in this kernel, judged by ``judge(*values)`` like ``on_ranks`` does on the ranks."""
    verdict = _judge_here(judge, *values)
    if verdict == "blank":
        raise NotSolved(f"{what}: not answered yet.")
    if verdict is not None:
        raise NotSolved(f"{what}: {verdict.rstrip('.')}. {hint}".strip())
    print(f"✓ {what}")


def at_most(got, bound: float, what: str, hint: str = "") -> None:
    """A number (or one per rank) that must be finite and no larger than ``bound``."""
    values = got if isinstance(got, list) else [got]
    for rank, g in enumerate(values):
        if _blank(g):
            raise NotSolved(f"{what}: not answered yet" + (f" on rank {rank}." if isinstance(got, list) else "."))
        if not isinstance(g, (int, float)) or not math.isfinite(g) or g > bound:
            where = f" on rank {rank}" if isinstance(got, list) else ""
            raise NotSolved(f"{what}{where}: {g!r} is not a number ≤ {bound}. {hint}".strip())
    print(f"✓ {what}: {values} (≤ {bound})")


def launcher_environment(env, launcher: str, rank: int, world_size: int, local_rank: int) -> None:
    """An environment dict that ``sl.detect_launch`` reads as the given launcher, rank and sizes."""
    if _blank(env) or not isinstance(env, dict):
        raise NotSolved(f"not answered yet: set `answer` to a dict of environment variables (strings), got {env!r}.")
    if launcher == "torchrun" and not {"MASTER_ADDR", "MASTER_PORT"} <= set(env):
        raise NotSolved("torchrun also tells every process where rank 0 listens: MASTER_ADDR and MASTER_PORT.")
    try:
        info = detect_launch(env)
    except LaunchError as error:
        raise NotSolved(f"sl.detect_launch rejects it: {error}") from None
    got = {"launcher": info.launcher, "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank}
    expected = {"launcher": launcher, "rank": rank, "world_size": world_size, "local_rank": local_rank}
    wrong = {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    if wrong:
        raise NotSolved("read as " + ", ".join(f"{k}={g!r} (expected {e!r})" for k, (g, e) in wrong.items()))
    print(f"✓ read as {launcher}: rank {rank} of {world_size}, local rank {local_rank}")
