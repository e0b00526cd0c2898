"""What ``python -m shardlab.port`` is asked to port, resolved before any rank starts: the model (a name of
docs/models.md, a ``package.module:factory``, or a ``package.module:case`` that is an ``sl.parity.Case``), its case
(inputs, which are split along which dim), and how the written run rebuilds it without shardlab (``model_source``).
Every problem is a ``PortError``: one line that says what to change."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import textwrap

import torch

from .. import model_cases
from ..parity import Case, problems, spatial_parameters


class PortError(ValueError):
    """Bad input, or a step that failed: the message is one line saying what to change."""


N = "N"  # the size symbol of a shape: ``1xNx3`` is (1, size, 3); ``2N`` is twice the size (an upsampling output)


def factor(dim) -> int | None:
    """How many times the size a dim of a shape is: 1 for ``N``, k for ``kN``, None for a number."""
    return int(dim[:-1] or 1) if isinstance(dim, str) else None


def parse_shape(text: str) -> list:
    """``"1xNx3"`` → ``[1, "N", 3]``; ``"1x2N"`` → ``[1, "2N"]``."""
    parts = [p.strip() for p in re.split(r"[x×,]", text) if p.strip()]
    if not parts or any(not (re.fullmatch(r"[1-9]\d*N|N", p) or p.isdigit()) for p in parts):
        raise PortError(f"shape {text!r}: write its dims separated by 'x', each a number or N (the size), e.g. 1xNx3.")
    return [p if p.endswith(N) else int(p) for p in parts]


def at(shape: list, size: int) -> tuple[int, ...]:
    return tuple(d if factor(d) is None else factor(d) * size for d in shape)


def shape_of(small: tuple, big: tuple, sizes: tuple[int, int], what: str) -> list:
    """A shape seen at two sizes written with N: each dim is the size at both (``N``), the same multiple of it at both
    (``2N``: a model that upsamples), or the same number at both."""
    dims = []
    for d, (a, b) in enumerate(zip(small, big, strict=True)):
        k = a // sizes[0]
        if (a, b) == sizes:
            dims.append(N)
        elif k > 1 and (a, b) == (k * sizes[0], k * sizes[1]):
            dims.append(f"{k}{N}")
        elif a == b:
            dims.append(int(a))
        else:
            raise PortError(f"{what}: dim {d} is {a} at size {sizes[0]} and {b} at {sizes[1]}, neither the size (or a "
                            "multiple of it) nor fixed: the written run takes shapes of N and numbers; declare the "
                            "inputs with --input.")
    return dims


def named_case(name: str) -> Case | None:
    """The case of docs/models.md called ``name`` (its row's name, the name before the bracket, or model_cases's
    attribute), any case."""
    key = name.strip().lower()
    for attribute, case in vars(model_cases).items():
        if isinstance(case, Case) and key in (attribute.lower(), case.name.lower(),
                                              case.name.split(" (")[0].lower()):
            return case
    return None


def _load(ref: str):
    module, _, attribute = ref.partition(":")
    if not module or not attribute:
        raise PortError(f"model {ref!r}: give a name of docs/models.md ({', '.join(c.name for c in model_cases.CASES)})"
                        " or package.module:factory.")
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        raise PortError(f"model {ref!r}: cannot import {module} ({error}): check the spelling, and that its package "
                        "is on PYTHONPATH (run from the folder that holds it).") from None
    if not hasattr(found, attribute):
        raise PortError(f"model {ref!r}: {module} has no {attribute!r}: name a factory or case it defines.")
    return getattr(found, attribute)


def resolve(model: str, inputs: dict[str, str], shard: dict[str, int], sizes: tuple[int, ...] | None) -> tuple:
    """(the case, where the model came from: ``{"named": attribute}`` or ``{"ref": "package.module:factory"}``).
    ``inputs``: {name: shape text}, the case's inputs, each a ``torch.randn`` of that shape; ``shard``: {name: dim}."""
    case = named_case(model)
    source = {"named": next(a for a, c in vars(model_cases).items() if c is case)} if case else {"ref": model}
    if case is None:
        found = _load(model)
        if isinstance(found, Case):
            case = found
        elif callable(found):
            if not inputs or not shard:
                raise PortError(f"{model} is a factory: say what it takes, --input NAME=SHAPE (e.g. x=1x1xNxN) for "
                                "each input, and --shard NAME:DIM for each one split along a dim.")
            case = Case(model, found, RandnInputs({k: parse_shape(v) for k, v in inputs.items()}), dict(shard))
        else:
            raise PortError(f"model {model!r} is a {type(found).__name__}: name a factory (a function or class that "
                            "builds the model) or an sl.parity.Case.")
    elif inputs or shard:
        case = dataclasses.replace(case, inputs=RandnInputs({k: parse_shape(v) for k, v in inputs.items()})
                                   if inputs else case.inputs, shard=dict(shard) or case.shard)
    if sizes:
        case = dataclasses.replace(case, sizes=FixedSizes(tuple(sizes)))
    return case, source


class RandnInputs:
    """Each input a ``torch.randn`` of its shape at the size."""
    def __init__(self, shapes: dict[str, list]):
        self.shapes = shapes

    def __call__(self, size: int) -> dict:
        return {name: torch.randn(at(shape, size)) for name, shape in self.shapes.items()}


class FixedSizes:
    """The sizes the audit and parity run at, whatever the domain size."""
    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes

    def __call__(self, domain: int) -> tuple[int, ...]:
        return self.sizes


def built(case: Case, size: int):
    """The model at ``size``, or a PortError when its factory raises."""
    try:
        return case.model(size)
    except Exception as error:  # the user's factory: whatever it raises is the message
        first = (str(error).splitlines() or [""])[0]
        raise PortError(f"{case.name}: the factory raised {type(error).__name__}: {first[:200]}: fix the factory, "
                        "or give the arguments it needs a default.") from None


def describe(case: Case, domain: int) -> dict:
    """The case as the written run and the job of ranks need it: inputs and the output as shapes of N, the split
    dims, the strategy with the spatial parameters it splits, the sizes the audit runs at. PortError on a case the
    model does not take."""
    lines = problems(case, domain)
    if lines:
        raise PortError(lines[0])
    sizes = case.sizes(domain)
    small = sizes[0]
    big = small * case.memory_scale
    seen = [case.whole_inputs(s) for s in (small, big)]
    shapes = {k: shape_of(tuple(seen[0][k].shape), tuple(seen[1][k].shape), (small, big), f"input {k!r}")
              for k in seen[0]}
    outs = []
    for s, inputs in zip((small, big), seen, strict=True):
        model = built(case, s)
        with torch.no_grad():
            out = model(inputs) if case.one_dict else model(**inputs)
        if not isinstance(out, torch.Tensor):
            raise PortError(f"{case.name} returns a {type(out).__name__}: the written run trains a model of one output "
                            "tensor; wrap it in a module that returns the tensor to train on.")
        outs.append(tuple(out.shape))
    target = shape_of(*outs, (small, big), "the output")
    spatial = dict(case.spatial) or spatial_parameters(case, domain)
    split = [d for d, v in enumerate(target) if factor(v)]
    wanted = next(iter(case.shard.values()))
    return {"name": case.name, "settings": case.settings, "one_dict": case.one_dict,
            "declared inputs": isinstance(case.inputs, RandnInputs),
            "inputs": {k: {"shape": shapes[k], "shard": case.shard.get(k)} for k in shapes},
            "target": {"shape": target, "shard": wanted if wanted in split else (split or [None])[0]},
            "strategy": "fsdp_spatial" if spatial else case.strategy, "spatial": spatial,
            "sizes": list(sizes), "domain": domain, "all_handlers": True}


def job_case(spec: dict) -> Case:
    """The case the job of ranks runs: rebuilt from ``resolve``'s source, with what ``describe`` settled."""
    source = spec["source"]
    if "named" in source:
        case = getattr(model_cases, source["named"])
    else:
        found = _load(source["ref"])
        case = found if isinstance(found, Case) else Case(source["ref"], found, case_inputs(spec), {})
    leaf = {name.rsplit(".", 1)[-1]: dim for name, dim in spec["spatial"].items()}
    return dataclasses.replace(case, inputs=case_inputs(spec) if spec["declared inputs"] else case.inputs,
                               shard={k: v["shard"] for k, v in spec["inputs"].items() if v["shard"] is not None},
                               strategy=spec["strategy"], spatial=leaf, sizes=FixedSizes(tuple(spec["sizes"])),
                               all_handlers=True)


def case_inputs(spec: dict):
    return RandnInputs({k: v["shape"] for k, v in spec["inputs"].items()})


# -- how the written run builds the model, without shardlab ----------------------------------------------------------

def model_source(case: Case, size: int) -> str:
    """model.py of the written run: ``build_model(size)``. A top-level factory of an importable module that is not
    shardlab's is imported; otherwise the model's class is imported (or, for the series' own models, its source
    copied) and called with the arguments the factory passed it, recorded while it ran."""
    build = case.build
    module = getattr(build, "__module__", "") or ""
    takes_size = bool(inspect.signature(build).parameters)
    if "<" not in getattr(build, "__qualname__", "<") and not module.startswith("shardlab"):
        call = f"{build.__qualname__}(size)" if takes_size else f"{build.__qualname__}()"
        return _MODEL_PY.format(imports=f"from {module} import {build.__qualname__}", definitions="", call=call)
    cls, kwargs = _constructor_call(case, size)
    if takes_size:
        raise PortError(f"{case.name}: its factory takes the size and is not importable on its own: define it at the "
                        "top level of your module and pass package.module:factory.")
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if not cls.__module__.startswith("shardlab"):
        return _MODEL_PY.format(imports=f"from {cls.__module__} import {cls.__qualname__}", definitions="",
                                call=f"{cls.__qualname__}({arguments})")
    source = textwrap.dedent(inspect.getsource(cls))
    return _MODEL_PY.format(imports="import torch", definitions=f"\n\n# {cls.__name__}, as shardlab.models defines it "
                            f"(the series' own model, copied so that this run needs no shardlab)\n{source}",
                            call=f"{cls.__qualname__}({arguments})")


def _constructor_call(case: Case, size: int) -> tuple[type, dict]:
    """The class the factory built and the keyword arguments it passed, as literals."""
    model = built(case, size)
    cls = type(model)
    recorded = getattr(model, "_args", {}).get("__args__")  # PhysicsNeMo's Module keeps its arguments
    if recorded is None:
        seen = []
        original = cls.__init__

        def record(self, *args, **kwargs):
            seen.append(inspect.signature(original).bind(self, *args, **kwargs).arguments)
            original(self, *args, **kwargs)

        cls.__init__ = record
        try:
            built(case, size)
        finally:
            cls.__init__ = original
        recorded = {k: v for k, v in seen[0].items() if k != "self"} if seen else {}
    try:
        json.dumps(recorded)
    except TypeError:
        raise PortError(f"{case.name}: {cls.__name__} is built with arguments that are not plain values: write a "
                        "top-level factory in your module and pass package.module:factory.") from None
    return cls, recorded


_MODEL_PY = '''"""The model this run trains, written by shardlab.port: build_model(size) is called under the same seed
on every rank (train.py), so every replica starts from the same weights before they are synced anyway."""

{imports}
{definitions}

def build_model(size):
    """The model for inputs of size ``size`` (a model whose tables follow the field is built for its size)."""
    return {call}
'''
