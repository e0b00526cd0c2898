"""How an answer is judged: on every rank next to the learner's objects, or in the kernel; what is right, what is wrong.

Every notebook from ``01_launchers`` on ends with exercises; each answer cell sets ``answer`` (or
the names the exercise asks for) and the next cell calls one of these. A blank answer (``...``)
fails with "not answered yet".

A check judges behaviour, not a constant: ``on_ranks`` runs a judge on every rank, next to the
learner's own objects (their local shards, placements, gradients), and the judge works out what
is right from that rank's state. A judge returns None when the answer is right, or a sentence
saying what is wrong. Its cases are drawn afresh for every check (``case_generator``), always among
them the ones where a plausible shortcut goes wrong; a message names only the one case that failed
(with what was expected there), never the list.

A learner who is stuck gets, from the second failed try of an exercise in a kernel, the judge's second hint
(``second_hint``), then the call that shows the reference answer (``reveal``); cells that build on an exercise take
the reference answer where the learner's has not passed, in the learners' copy (``yours_or_reference``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import random
import sys
from typing import TYPE_CHECKING

from . import answers, progress

if TYPE_CHECKING:  # torch loads on first use: a notebook kernel checks answers without it
    from ..measure.collectives import Event


class NotSolved(AssertionError):
    """The answer is missing or wrong; the message says which part, and a hint."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for it (``InteractiveShell.showtraceback`` asks an exception for these lines): the
        message and its hint, none of the judge's code. The cell still fails, and nbmake sees it fail."""
        return [f"NotSolved: {self}"]


# "report": a failed check says so and Run All goes on (the learners' copy: `make lab-handout` sets it); else it
# raises, and the cell fails. Under pytest (nbmake, the suite) it always raises.
CHECKS = "SHARDLAB_CHECKS"


def _goes_on() -> bool:
    return os.environ.get(CHECKS) == "report" and "PYTEST_CURRENT_TEST" not in os.environ


def _reported(check):
    """A check that, in the learners' copy, shows a failed answer's message and lets the notebook go on."""

    @functools.wraps(check)
    def run(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except NotSolved as error:
            if not _goes_on():
                raise
            print(f"NotSolved: {error}\n(Run All goes on: change the answer, then run it and this check again.)",
                  file=sys.stderr)

    return run


def _blank(value) -> bool:
    """Not answered yet: ``...``, None, a function whose body does nothing (the handout's blank keeps the
    signature and docstring, with ``...`` for a body), or the reference answer that stood in for the learner's
    (``yours_or_reference``: its code's file name says so, on the ranks too)."""
    where = getattr(getattr(value, "__code__", None), "co_filename", None)
    stood_in = isinstance(where, str) and where.startswith(STOOD_IN)
    return value is Ellipsis or value is None or stood_in or _does_nothing(value)


def _does_nothing(value) -> bool:
    """A Python function whose code only returns None: ``def f(x): ...``, with or without a docstring."""
    import dis

    code = getattr(value, "__code__", None)
    if code is None:
        return False
    steps = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return steps in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def _same(got, expected) -> bool:
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9)
        except (TypeError, ValueError):
            return False
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    return got == expected


@_reported
def answer(got, expected, what: str, hint: str = "") -> None:
    """One answer for the whole notebook (no ranks involved)."""
    if _blank(got):
        raise _not_answered(what, what, f"{what}: not answered yet (answer is still {got!r}).")
    if not _same(got, expected):
        raise _wrong(what, what, f"got {got!r}, which is not right", hint)
    _right(what, what)
    print(f"✓ {what}: {got!r}")


@_reported
def per_rank(got: list, expected: list, what: str, hint: str = "") -> None:
    """One answer per rank (``cluster.view.pull("answer")``), each against that rank's expected value.

    A wrong rank is named with what it answered, never with the expected value."""
    if len(got) != len(expected):
        raise NotSolved(f"{what}: {len(got)} answers for {len(expected)} ranks; set `answer` in a %%px cell.")
    _report([None if not _blank(g) and _same(g, e) else ("blank" if _blank(g) else f"{g!r} is not right")
             for g, e in zip(got, expected)], what, hint, what)


def _report(verdicts: list, what: str, hint: str, exercise: str, judge=None) -> None:
    """Print one line per rank; raise NotSolved naming the wrong ranks (or saying nothing was answered)."""
    for rank, verdict in enumerate(verdicts):
        said = "" if verdict is None else ": not answered yet" if verdict == "blank" else f": {verdict}"
        print(f"{'✓' if verdict is None else '✗'} rank {rank}: {what}{said}")
    if all(v == "blank" for v in verdicts):
        raise _not_answered(exercise, what, f"{what}: not answered yet on any rank.")
    wrong = [rank for rank, v in enumerate(verdicts) if v is not None]
    if wrong:
        first = next((v for v in verdicts if v not in (None, "blank")), "not answered yet")
        raise _wrong(exercise, what, f"wrong on rank(s) {wrong}: {first}", hint, judge)
    _right(exercise, what)


OUT_OF_STEP = "out of step"  # a verdict's tag: the judge met a broken process group, and judged nothing


def _judge_here(judge, *values):
    """Runs on a rank: the judge's verdict on that rank's values ("blank" if any is still ``...``; (OUT_OF_STEP, the
    error) if a collective of the judge found the ranks' process group broken)."""
    if any(_blank(v) for v in values):
        return "blank"
    try:
        return judge(*values)
    except Exception as error:
        said = f"{type(error).__name__}: {error}"
        from ..ranks.px import broken_group  # on the ranks, where ipyparallel is

        if broken_group(said):  # not the answer's fault: the ranks cannot run a collective together any more
            return (OUT_OF_STEP, said)
        return f"checking it raised {said}"  # the learner's object broke the judge: a wrong answer, said plainly


@_reported
def on_ranks(cluster, judge, *names: str, what: str, hint: str = "") -> None:
    """Judge, on every rank, the learner's objects called ``names`` (``judge(*objects)`` runs where they live).

    ``judge`` returns None when the answer is right on that rank, or a sentence saying what is wrong;
    it computes what is right from the rank's own state, so nothing in the check cell gives it away.
    """
    from ipyparallel import Reference

    verdicts = cluster.view.apply_sync(_judge_here, judge, *(Reference(name) for name in names))
    broken = {rank: v[1] for rank, v in enumerate(verdicts) if isinstance(v, (tuple, list)) and v[0] == OUT_OF_STEP}
    if broken:  # no verdict is printed: the answer was not judged
        from ..ranks.px import OutOfStep, out_of_step

        cause = getattr(getattr(cluster, "_px", None), "partial_failure", None)  # what %%px saw fail, if anything
        first, *rest = out_of_step(broken, cause)
        raise OutOfStep("\n".join([f"{what}: not checked. {first}", *rest]))
    _report(verdicts, what, hint, names[0], judge)


@_reported
def judged(judge, *values, what: str, hint: str = "") -> None:
    """One answer in this kernel, judged by ``judge(*values)`` like ``on_ranks`` does on the ranks."""
    exercise = getattr(values[0], "__name__", what) if values else what  # the answer's name, as reveal() takes it
    verdict = _judge_here(judge, *values)
    if verdict == "blank":
        raise _not_answered(exercise, what, f"{what}: not answered yet.")
    if verdict is not None:
        raise _wrong(exercise, what, verdict, hint, judge)
    _right(exercise, what)
    print(f"✓ {what}")


# --------------------------------------------------------------------------------------------------------------
# A learner who is stuck: hints in two steps, the reference answer on request, and the cells after an exercise

STOOD_IN = "<the reference answer, standing in"  # the file name of its code
_tries: dict[str, int] = {}  # failed tries of each exercise in this kernel, by the name of its answer
_passed: dict[str, bool] = {}  # whether each exercise's last check passed
_whats: dict[str, str] = {}  # each exercise's title, as its check and the class view name it


def second_hint(text: str):
    """A judge's second hint, which a learner gets from the second failed try on: more specific than the first (the
    check cell's), aimed at the most common wrong answer. A decorator: ``@second_hint("...")`` above the judge."""

    def mark(judge):
        judge.second_hint = text
        return judge

    return mark


def _right(exercise: str, what: str) -> None:
    _whats[exercise], _passed[exercise] = what, True
    progress.record(what, True)


def _not_answered(exercise: str, what: str, message: str) -> NotSolved:
    """A blank answer: not a try, not passed either."""
    _whats[exercise], _passed[exercise] = what, False
    return NotSolved(message)


def _wrong(exercise: str, what: str, said: str, hint: str, judge=None) -> NotSolved:
    """A failed try, counted and recorded; its message has the check's hint, from the second try on the judge's
    second hint too, and from the third the call that reveals the reference answer."""
    _whats[exercise], _passed[exercise] = what, False
    progress.record(what, False)
    tries = _tries[exercise] = _tries.get(exercise, 0) + 1
    lines = [f"{what}: {said.rstrip('.')}. {hint}".strip()]
    if tries >= 2 and getattr(judge, "second_hint", ""):
        lines.append(f"Second hint (try {tries}): {judge.second_hint}")
    if tries >= 3 and exercise != what and exercise.isidentifier():  # an answer with a name to reveal it by
        lines.append(f"Still stuck? sl.exercises.reveal({exercise!r}) shows the reference answer.")
    return NotSolved("\n".join(lines))


def reveal(name: str, folder=None) -> None:
    """Show the reference answer of the exercise whose answer is called ``name``, on purpose: it says so, and the
    class view (``progress``) records it as revealed."""
    notebook, source = answers.find(name, folder)
    progress.record(_whats.get(name, name), False, revealed=True)
    print(f"Revealed on purpose: the reference answer for {name}, from {notebook} (the class view, where your "
          "instructor set one up, shows it as revealed). Type it in or paste it, then run its check again.\n")
    print(source)


def yours_or_reference(name: str, yours):
    """What the cells after an exercise build on: ``yours``, unless failed checks go on (the learners' copy) and the
    exercise's last check did not pass; then the reference answer (a cell run in this kernel), said in one line."""
    if not _goes_on() or _passed.get(name):
        return yours
    notebook, source = answers.find(name)
    if source.startswith("%%"):
        raise ValueError(f"the reference answer for {name} runs on the ranks; only a kernel cell's can stand in")
    # A function of module __main__ reaches the ranks as the learner's own does: its code, run there in the rank's
    # namespace (ipyparallel 9.2.0, serialize/canning.py, CannedFunction, about lines 201-212).
    namespace = {"__name__": "__main__"}
    exec(compile(source, f"{STOOD_IN} ({notebook})>", "exec"), namespace)
    print(f"↪ {name} has not passed its check: the cells below carry on with the reference {name} "
          f"(sl.exercises.reveal({name!r}) shows it); run your answer and its check again to use yours.")
    return namespace[name]


def case_generator() -> random.Random:
    """The generator a judge draws its cases from: seeded afresh for every check by rank 0 and the same on every rank,
    so each run tries other cases (an answer cannot be fitted to them) and the ranks' collectives still match."""
    import torch.distributed as dist

    seed = [random.SystemRandom().randrange(2**32)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return random.Random(seed[0])


# --------------------------------------------------------------------------------------------------------------
# Watching the work: what a judged call communicated, and which library functions it ran


def _event(*args, **kwargs) -> Event:
    """An Event of ``measure.collectives``, the one record of what watched code did (imported here on first use:
    checking an answer in a notebook kernel needs no torch)."""
    from ..measure.collectives import Event

    return Event(*args, **kwargs)


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
        if collectives:
            from ..measure.collectives import collective_recorder

            self._mode = collective_recorder(self.events.append)
        else:
            self._mode = contextlib.nullcontext()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self._codes:
            self.events.append(_event("call", self._codes[frame.f_code], arguments=dict(frame.f_locals)))
        elif event == "c_call" and getattr(arg, "__name__", None) in self._builtins:
            self.events.append(_event("call", self._builtins[arg.__name__]))
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
            self.events.append(_event("call", label, arguments=arguments))
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
