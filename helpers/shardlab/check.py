"""Exercise checks: say what is right and what is wrong, per rank where it matters.

Every notebook from ``01_launchers`` on ends with exercises; each answer cell sets ``answer``
and the next cell calls one of these. A blank answer (``...``) fails with "not answered yet".
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
    """One answer per rank (``cluster.view.pull("answer")``), each against that rank's expected value."""
    if len(got) != len(expected):
        raise NotSolved(f"{what}: {len(got)} answers for {len(expected)} ranks; set `answer` in a %%px cell.")
    wrong = []
    for rank, (g, e) in enumerate(zip(got, expected)):
        ok = not _blank(g) and _same(g, e)
        print(f"{'✓' if ok else '✗'} rank {rank}: {what} = {g!r}" + ("" if ok else f" (expected {e!r})"))
        if not ok:
            wrong.append(rank)
    if wrong:
        blank = all(_blank(g) for g in got)
        reason = "not answered yet" if blank else f"wrong on rank(s) {wrong}"
        raise NotSolved(f"{what}: {reason}. {'' if blank else hint}".strip())


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
