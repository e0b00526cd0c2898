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

import contextlib
import inspect
import math
import sys
from dataclasses import dataclass, field

from .ranks.launch import LaunchError, detect_launch


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


# --------------------------------------------------------------------------------------------------------------
# Watching the work: what a judged call communicated, and which library functions it ran


# c10d ops (and their functional twins) by the primitive a lesson teaches.
_PRIMITIVES = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce", "barrier": "barrier",
}
# c10d ops whose first argument is the output buffer: what a rank sends is in the arguments after it.
_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_",
                 "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_", "gather_"}


@dataclass
class Event:
    """One thing a watched call did: a collective (``kind`` "collective") or a call of a watched function."""

    kind: str
    name: str  # the primitive ("all_reduce", "send", ...) or the watched function's label
    ranks: tuple = ()  # global ranks of the collective's group
    bytes: int = 0  # bytes this rank hands to the collective (its input; output buffers are not counted)
    peer: int | None = None  # global rank a send goes to or a receive comes from
    arguments: dict = field(default_factory=dict)  # a watched function's arguments, as it received them


def _group_of(args: list):
    """The process group among a c10d op's arguments (boxed as a ScriptObject by the dispatcher, or named by a
    functional collective), or None."""
    import torch
    import torch.distributed as dist

    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a
        try:
            if isinstance(a, torch.ScriptObject):
                return dist.ProcessGroup.unbox(a)
            if isinstance(a, str):
                return dist.distributed_c10d._resolve_process_group(a)
        except (RuntimeError, ValueError, KeyError, TypeError):
            continue  # another boxed object (a reduce op) or a string that names no group
    return None


def _collective_event(name: str, args, kwargs) -> Event:
    """The Event of one c10d op: its primitive, its group's global ranks, the bytes this rank hands to it."""
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_flatten

    flat = tree_flatten((args, kwargs))[0]
    group = _group_of(flat)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    sent = tree_flatten((args[1:], kwargs) if name in _OUTPUT_FIRST else (args, kwargs))[0]
    size = sum(t.numel() * t.element_size() for t in sent if isinstance(t, torch.Tensor))
    peer = None
    if _PRIMITIVES[name] in ("send", "recv") and group is not None:  # the peer is a rank of the group
        local = next((a for a in flat if isinstance(a, int) and not isinstance(a, bool)), None)
        peer = ranks[local] if local is not None and 0 <= local < len(ranks) else None
    return Event("collective", _PRIMITIVES[name], ranks, size, peer)


def _collective_recorder(events: list):
    """A dispatch mode that appends an Event for every collective run inside it, whoever calls it (the learner or
    a library). Modes see every c10d op, including those of ShardTensor's handlers (``CommDebugMode`` does not run
    on ShardTensor convolutions)."""
    from .measure import CollectiveBytes

    class Recorder(CollectiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = str(func.overloadpacket).split(".")[-1]
            if func.namespace in self.NAMESPACES and name in _PRIMITIVES:
                hook = sys.getprofile()
                sys.setprofile(None)  # this bookkeeping is the recorder's own, not the watched code's
                try:
                    events.append(_collective_event(name, args, kwargs))
                finally:
                    sys.setprofile(hook)
            return out

    return Recorder()


class Watch:
    """Inside ``with``, what the code did: ``events`` lists the collectives it ran and the calls of the watched
    ``functions`` ({label: a function, or a tuple of functions}), in order.

    Functions are matched by their code object, through a profile hook on this thread: an alias, a ``from ...
    import`` or a library that calls them on the learner's behalf all count. (Backward passes that autograd runs on
    a GPU's own thread are not watched; the functions judges watch run in the forward, on this thread.) Dynamo does
    not compile while a profile hook or a dispatch mode is set, so code that must compile is watched with
    ``collectives=False`` and through ``attributes`` ({label: (owner, attribute name)}): each attribute is replaced by
    a recording wrapper for the block's length, which records the arguments too. Code that makes many Python calls
    (a planner) also runs several times faster watched that way than under the profile hook.
    """

    def __init__(self, attributes: dict | None = None, collectives: bool = True, **functions):
        self.events: list[Event] = []
        self._codes, self._builtins = {}, {}  # Python functions by code object, C functions by name
        for label, fns in functions.items():
            for fn in fns if isinstance(fns, tuple) else (fns,):
                fn = inspect.unwrap(fn)
                if hasattr(fn, "__code__"):
                    self._codes[fn.__code__] = label
                else:
                    self._builtins[fn.__name__] = label
        self._attributes = dict(attributes or {})
        self._saved: list = []
        self._mode = _collective_recorder(self.events) if collectives else contextlib.nullcontext()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self._codes:
            self.events.append(Event("call", self._codes[frame.f_code], arguments=dict(frame.f_locals)))
        elif event == "c_call" and getattr(arg, "__name__", None) in self._builtins:
            self.events.append(Event("call", self._builtins[arg.__name__]))
        if self._previous is not None:
            self._previous(frame, event, arg)

    def _recording(self, label: str, original):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):  # a builtin without one: its arguments are not recorded
            signature = None

        def recorded(*args, **kwargs):
            arguments = {}
            if signature is not None:
                with contextlib.suppress(TypeError):  # a call the function itself will refuse
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    arguments = dict(bound.arguments)
            self.events.append(Event("call", label, arguments=arguments))
            return original(*args, **kwargs)

        return recorded

    def __enter__(self):
        for label, (owner, name) in self._attributes.items():
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._recording(label, original))
        self._mode.__enter__()
        self._previous = sys.getprofile()
        if self._codes or self._builtins:
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)
        self._mode.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def calls(self, *labels: str) -> list[Event]:
        return [e for e in self.events if e.kind == "call" and (not labels or e.name in labels)]

    def collectives(self, *names: str, ranks=None) -> list[Event]:
        """The collectives run, of the given primitives (all if none), over the group ``ranks`` (any if None)."""
        return [e for e in self.events if e.kind == "collective" and (not names or e.name in names)
                and (ranks is None or tuple(e.ranks) == tuple(ranks))]

    def forbidden(self, **why: str) -> str | None:
        """The verdict when a watched function that ``why`` names ran: "it called X, ..." with the reason."""
        for label, reason in why.items():
            if self.calls(label):
                return f"it called {label}, {reason}"
        return None


def earlier_object(value, fn) -> str | None:
    """"it returned NAME, an object from earlier in the notebook" when ``value`` (or, for a tensor, its storage) was
    already bound in the namespace ``fn`` was defined in, instead of being made from ``fn``'s arguments; else None."""
    import torch

    def storage(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.untyped_storage().data_ptr() if local.numel() else None

    namespace = {name: bound for name, bound in getattr(fn, "__globals__", {}).items() if not name.startswith("_")}
    found = None
    if not isinstance(value, (int, float, bool, str, type(None))):
        found = next((name for name, bound in namespace.items() if bound is value), None)
    mine = storage(value) if isinstance(value, torch.Tensor) else None
    if found is None and mine is not None:
        found = next((name for name, bound in namespace.items()
                      if isinstance(bound, torch.Tensor) and storage(bound) == mine), None)
    return None if found is None else f"it returned {found}, an object from earlier in the notebook"
