"""Any model declared as a parity case (``sl.parity.Case``: how to build it, its inputs at a size, which inputs are
split along which dim, the strategy) planned at a target size that is never allocated: ``Planner(case, size)``.

Pass the case and a target size; the case is measured on ``ranks`` ranks at two small sizes and extrapolated per
element of its split inputs (``METHOD``). Why measured rather than replayed, and what is fitted:
docs/planner.md#why-a-case-is-measured-not-replayed.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch

from ..levers import NO_LEVERS, Levers
from ..train import WRAPPERS, fsdp_units
from .inputs import DTYPES, calibration_sizes, check_loading
from .planner import Planner
from .records import Plan, RankBytes

METHOD = "measured ×2, extrapolated"  # a case's rows; the conv planner's are "meta replay"
_BUILT: set[str] = set()  # cases built once in this process, at their smallest size
_CALIBRATIONS: dict[tuple, dict] = {}  # per process: what the ranks measured, by case, ranks, sizes and settings


def _meta(case, size: int) -> tuple[torch.nn.Module, dict]:
    """The model and whole inputs at ``size`` as shapes only: built on the meta device, nothing allocated (after one
    build at the case's smallest size, which imports what the model's code imports outside the meta device)."""
    if case.name not in _BUILT:
        case.model(case.sizes(1)[0])
        _BUILT.add(case.name)
    with torch.device("meta"):
        inputs = case.inputs(size)
        model = case.build(size) if _takes_size(case) else case.build()
    return model, inputs


def _takes_size(case) -> bool:
    import inspect

    return bool(inspect.signature(case.build).parameters)


def _rows(extent: int, n: int, position: int) -> int:
    """``local_slices(extent, n)[position]`` without the list of n (a million domain ranks are planned)."""
    size = -(-extent // n)
    return max(0, min(size, extent - position * size))


@dataclass(frozen=True)
class Line:
    """bytes = fixed + per_element × elements (the rank's share of the split inputs)."""

    fixed: float
    per_element: float

    @classmethod
    def through(cls, x: tuple[float, float], y: tuple[float, float]) -> Line:
        slope = (y[1] - y[0]) / (x[1] - x[0])
        return cls(y[0] - slope * x[0], slope)

    def at(self, x: float) -> int:
        return max(0, round(self.fixed + self.per_element * x))


class _Slices:
    """Each domain rank's rows, indexed as ``local_slices``' list is, computed when asked."""

    def __init__(self, extent: int, n: int):
        self.extent, self.n = extent, n

    def __getitem__(self, position: int) -> int:
        return _rows(self.extent, self.n, position % self.n)


class CasePlanner(Planner):
    """``Planner(case, size, ...)``: a parity case at ``size`` (its ``inputs(size)``: points, or rows of a field),
    planned from ``calibration`` (what ``ranks`` ranks measured at two smaller sizes; measured on first use). Layouts
    as the conv planner's: ``plan(ddp, domain, wrapper, levers)``, ``largest``, ``smallest_domain``, ``verdict``.
    ``wrapper="fsdp2"`` on a case with spatial parameters splits those on ``domain`` (spatial + FSDP2)."""

    def __init__(self, case, size: int, dtype=torch.float32, optimizer: str = "adam", shard_dim=None, name=None,
                 device: str = "cuda", threads=None, loading: str = "scatter", ranks: int = 2,
                 calibration: dict | None = None, timeout_s: float = 600.0):
        if isinstance(dtype, str):
            dtype = DTYPES[dtype]
        self.case, self.size, self.dtype, self.optimizer = case, int(size), dtype, optimizer
        self.loading, self.ranks, self.timeout_s = check_loading(loading), ranks, timeout_s
        self.name = name or case.name
        self.workspace, self.halo, self.dim = None, 0, 2
        model, inputs = _meta(case, self.size)
        unknown = [k for k in case.shard if k not in inputs]
        if unknown:
            raise ValueError(f"{case.name}: shard names {unknown}, which the case's inputs ({', '.join(inputs)}) do "
                             "not give: name one of those.")
        self.inputs = self._shapes(inputs)
        self.extent = self.inputs[next(iter(case.shard))][0][case.shard[next(iter(case.shard))]]
        self.field_shape = (1, 1, self.extent)  # what DomainSearch splits: the first split input's dim
        self._use(model)
        self._calibration = calibration
        if calibration and calibration.get("ranks"):  # a stored measurement says how many ranks made it
            self.ranks = len(calibration["ranks"][0])
        self._lines: dict[tuple, dict] = {}

    def _shapes(self, inputs: dict) -> dict:
        """Each input's shape and element size, floating inputs in the planned dtype (as the ranks cast them)."""
        floating = torch.empty((), dtype=self.dtype).element_size()
        return {k: (tuple(v.shape), floating if v.is_floating_point() else v.element_size()) for k, v in inputs.items()}

    def _use(self, model) -> None:
        self.model = model.to(self.dtype)
        self.named = list(self.model.named_parameters())
        self.params = [p for _, p in self.named]
        self.trainable = [p for p in self.params if p.requires_grad]
        self.units = [[unit.get_parameter(n) for n in names] for unit, names in fsdp_units(self.model)]
        self._states, self._shards, self._domain, self._wrapper = {}, {}, 1, "ddp"

    # -- the state: the conv planner's, with spatial parameters split on domain under spatial + FSDP2 ----------------

    def _spatial_shape(self, name: str, shape: torch.Size) -> torch.Size:
        dim = self.case.spatial.get(name.rsplit(".", 1)[-1]) if self._split_spatial else None
        if dim is None or self._domain == 1:
            return shape
        return torch.Size([*shape[:dim], _rows(shape[dim], self._domain, 0), *shape[dim + 1:]])

    def _local_shapes(self, wrapper: str, ddp: int, index: int) -> tuple:
        from .trace import fsdp_shards

        shapes = [self._spatial_shape(name, p.shape) for name, p in self.named]
        if wrapper != "fsdp2":
            return tuple(shapes)
        self._shards[ddp] = [fsdp_shards(shape, ddp) for shape in shapes]
        return tuple(chunks[index] for chunks, _ in self._shards[ddp])

    @property
    def _split_spatial(self) -> bool:
        return bool(self.case.spatial) and self._wrapper == "fsdp2"

    def _state_for(self, wrapper: str, ddp: int, index: int, domain: int, levers: Levers):
        self._wrapper, self._domain = wrapper, domain
        return self._state(wrapper, ddp, index, levers)

    # -- what the ranks measured, and the lines through it ----------------------------------------------------------

    def _elements(self, size_inputs: dict, domain: int, position: int) -> int:
        """The rank's share of the split inputs' elements (``torch.chunk`` of each split dim)."""
        total = 0
        for name, dim in self.case.shard.items():
            shape = size_inputs[name][0]
            total += math.prod(shape) // shape[dim] * _rows(shape[dim], domain, position)
        return total

    def calibration(self, levers: Levers = NO_LEVERS) -> dict:
        """What the ranks measured at the two sizes (``calibrate``), for these levers; measured once per process."""
        if self._calibration is not None:
            return self._calibration
        key = _key(self.case, self.ranks, self.dtype, self.optimizer, levers)
        if key not in _CALIBRATIONS:
            prepare([self.case], self.ranks, self.dtype, self.optimizer, levers, self.timeout_s)
        return _CALIBRATIONS[key]

    def _lines_for(self, levers: Levers) -> dict:
        """Per calibrated rank: lines of the step's excess over the state, the saved bytes and the kept whole input."""
        if levers.label in self._lines:
            return self._lines[levers.label]
        measured = self.calibration(levers)
        if measured.get("error"):
            raise ValueError(f"{self.case.name} cannot be planned from measurements: on {self.ranks} ranks its step "
                             f"raised: {measured['error']}")
        wrapper = "fsdp2" if self.case.strategy == "fsdp_spatial" else "ddp"
        xs, excess = [], []
        for size, ranks in zip(measured["sizes"], measured["ranks"]):
            model, inputs = _meta(self.case, size)
            at = copy.copy(self)
            at._use(model)
            at.inputs = at._shapes(inputs)
            state = at._state_for(wrapper, 1, 0, self.ranks, levers)
            xs.append([at._elements(at.inputs, self.ranks, r) for r in range(self.ranks)])
            excess.append([m["peak"] - state.device_bytes - state.gathered_backward for m in ranks])
        per_rank = []
        for r in range(self.ranks):
            x = (xs[0][r], xs[1][r])
            per_rank.append({key: Line.through(x, values) for key, values in (
                ("excess", (excess[0][r], excess[1][r])),
                ("saved", tuple(measured["ranks"][i][r]["saved"] for i in (0, 1))),
                ("kept", tuple(measured["ranks"][i][r]["kept"] for i in (0, 1))))})
        self._lines[levers.label] = per_rank
        return per_rank

    # -- the layouts -------------------------------------------------------------------------------------------------

    def _check(self, ddp: int, domain: int, wrapper: str, levers: Levers = NO_LEVERS) -> list[int]:
        if wrapper not in WRAPPERS:
            raise ValueError(f"wrapper={wrapper!r}: choose one of {WRAPPERS} (fsdp2 on a case with spatial parameters "
                             "splits them on domain: spatial + FSDP2).")
        levers.check(wrapper)
        if levers.checkpoint:
            raise ValueError(f"levers.checkpoint on {self.case.name}: sl.train.use_checkpointing checkpoints "
                             "sequential stacks only; build the case's model with its own checkpointing "
                             "(torch.utils.checkpoint in its blocks, or the model's option for it) and plan that case.")
        if ddp < 1 or domain < 1:
            raise ValueError(f"ddp={ddp}, domain={domain}: both axis sizes must be at least 1.")
        if domain > self.extent:
            raise ValueError(f"domain={domain}: {self.case.name}'s split dim has {self.extent} entries at size "
                             f"{self.size}; at most {self.extent} domain ranks.")
        return _Slices(self.extent, domain)

    def _row(self, ddp, domain, wrapper, rank, slices, transient, levers) -> RankBytes:
        index, position = divmod(rank, domain)
        state = self._state_for(wrapper, ddp, index, domain, levers)
        lines = self._lines_for(levers)
        measured = lines[0 if position == 0 else self.ranks - 1 if position == domain - 1 else min(1, self.ranks - 1)]
        x = self._elements(self.inputs, domain, position)
        saved = measured["saved"].at(x)
        gathered = state.gathered_backward if wrapper == "fsdp2" else 0
        excess = measured["excess"].at(x) - (0 if self.loading == "scatter" else measured["kept"].at(x))
        row = RankBytes(rank, state.params, state.grads, state.optimizer, saved, 0,
                        transient if domain > 1 else 0, state.buffers, rows=slices[position], method=METHOD)
        row.peak = state.device_bytes + gathered + max(0, excess)
        row.temporaries = max(0, row.peak - row.accounted)
        return row

    def largest(self, ddp: int = 1, domain: int = 1, wrapper: str = "ddp", levers: Levers = NO_LEVERS) -> RankBytes:
        self._wrapper, self._domain = wrapper, domain  # the spatial split ``_local_shapes`` reads
        return super().largest(ddp, domain, wrapper, levers)

    def full_fields(self) -> tuple[int, int]:
        """Bytes of the whole split inputs and of the replicated ones: what ``scatter_tensor`` sends every rank."""
        split = sum(math.prod(s) * e for k, (s, e) in self.inputs.items() if k in self.case.shard)
        return split, sum(math.prod(s) * e for k, (s, e) in self.inputs.items() if k not in self.case.shard)

    def _transient(self) -> int:
        return 0 if self.loading == "slab" else sum(self.full_fields())

    def plan(self, ddp: int = 1, domain: int = 1, wrapper: str = "ddp", levers: Levers = NO_LEVERS) -> Plan:
        t0 = time.perf_counter()
        slices = self._check(ddp, domain, wrapper, levers)
        transient = self._transient()
        rows = [self._row(ddp, domain, wrapper, rank, slices, transient, levers) for rank in range(ddp * domain)]
        measured = self.calibration(levers)
        notes = [f"{METHOD}: the step measured on {self.ranks} ranks at sizes {measured['sizes']} "
                 f"({measured['device']}), its excess over the state extrapolated per element of the split inputs "
                 f"({', '.join(f'{k} dim {d}' for k, d in self.case.shard.items())}) to size {self.size}"]
        if wrapper == "fsdp2" and self.case.spatial:
            notes.append(f"spatial + FSDP2: {', '.join(self.case.spatial)} split on domain, the rest fully_shard on "
                         "ddp")
        if domain > 1:
            notes.append(self._loading_note())
        return Plan(rows, (1, 1, self.size), str(self.dtype).removeprefix("torch."), ddp, domain, wrapper,
                    self.optimizer, self.name, time.perf_counter() - t0, notes, levers, self.loading, METHOD)


def _key(case, ranks: int, dtype, optimizer: str, levers: Levers) -> tuple:
    return case.name, ranks, calibration_sizes(case, ranks), str(dtype), optimizer, levers.label


def prepare(cases, ranks: int, dtype=torch.float32, optimizer: str = "adam", levers: Levers = NO_LEVERS,
            timeout_s: float = 600.0) -> list[dict]:
    """Measure several cases on ``ranks`` ranks in one job (``calibrate.calibrate``), for every later
    ``Planner(case, size, ranks=ranks)`` of this process with these settings."""
    from .calibrate import calibrate

    todo = [c for c in cases if _key(c, ranks, dtype, optimizer, levers) not in _CALIBRATIONS]
    if todo:
        for case, measured in zip(todo, calibrate(todo, ranks, dtype, optimizer, levers, timeout_s), strict=True):
            _CALIBRATIONS[_key(case, ranks, dtype, optimizer, levers)] = measured
    return [_CALIBRATIONS[_key(c, ranks, dtype, optimizer, levers)] for c in cases]


Planner.case_planner = CasePlanner  # Planner(case, size) builds one (plan/__init__ imports this module)
