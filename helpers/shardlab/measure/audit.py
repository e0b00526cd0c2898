"""An audit you can run on any model: which of its modules communicate, with which collectives and how many bytes,
forward and backward; which operations ShardTensor had no handler for and gathered; which modules gathered silently.

    result = sl.measure.audit.audit_model(model, *inputs, loss=lambda out: out.square().mean())
    result.table(); result.findings(); result.clean

Call it on every rank together: it runs one forward and one backward, as training would (the model's gradients are
put back as they were). How each column is taken: docs/harness.md#how-each-column-is-taken.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from dataclasses import dataclass

from ..report import Table

PHASES = ("forward", "backward")
LOSS = "(loss)"  # the row of the loss function's own collectives: it is not a module of the model
MOVES_SHARDS = ("all_gather", "all_to_all")  # what DTensor runs to take a sharded tensor apart or together
_FALLBACKS = ("_torch_function_fallback_via_dtensor", "_dispatch_fallback_via_dtensor")
_PROMOTION = "ShardTensor auto-promoting"  # how PhysicsNeMo's WARN-mode warning starts
FIELD_OPS = {"add", "radd", "iadd", "sub", "rsub", "isub", "mul", "rmul", "imul", "div", "truediv", "rtruediv",
             "cat", "concat", "concatenate", "stack", "where"}  # ops whose plain operand is laid over the field
UNTRACED = "backward collectives of nodes no module created are counted here"


def mean_square(out):
    """The default loss: the mean of the output's squares (every output element gets a gradient), its gradient exact
    in float64 (``workarounds.exact_mean``)."""
    from ..workarounds import exact_mean

    return exact_mean(out.square())


def format_ops(ops: dict) -> str:
    """``{"all_reduce": (2, 12288)}`` as ``all_reduce 2× 12,288 B``; several ops joined by ``; ``."""
    return "; ".join(f"{op} {calls}× {nbytes:,} B" for op, (calls, nbytes) in sorted(ops.items()))


def _add(ops: dict, op: str, calls: int, nbytes: int) -> None:
    before = ops.get(op, (0, 0))
    ops[op] = (before[0] + calls, before[1] + nbytes)


@dataclass
class Audit:
    """What one forward and backward communicated, module by module, and what ShardTensor could not shard.

    ``rows``: one dict per module that did something, in the order the modules first ran (the whole model under its
    class name, the loss function as "(loss)"): "forward" and "backward" ({collective: (calls, bytes)}), "unpatched"
    (ops DTensor moved sharded data for, with "unpatched moves": {op: collectives}), "replicated outputs",
    "promoted", "note". ``output``: the model's output; ``error``: what the backward raised, if it did."""

    rows: list[dict]
    output: object = None
    error: str | None = None

    def __getstate__(self):  # pulled into a notebook's kernel: the output (a ShardTensor) stays on its rank
        return {"rows": self.rows, "output": None, "error": self.error}

    def totals(self) -> dict:
        """{"forward": {collective: (calls, bytes)}, "backward": {...}}: every row's, summed."""
        totals = {phase: {} for phase in PHASES}
        for row in self.rows:
            for phase in PHASES:
                for op, (calls, nbytes) in row[phase].items():
                    _add(totals[phase], op, calls, nbytes)
        return totals

    def findings(self) -> list[str]:
        """One line for each op DTensor gathered for, each silent gather, and a backward that raised."""
        lines = []
        for row in self.rows:
            moves = row.get("unpatched moves", {})
            for op in row["unpatched"]:
                how = moves.get(op) or ["a collective"]
                verb = "gathered" if "all_gather" in how else "redistributed"
                lines.append(f"{row['module']}: {op} has no ShardTensor handler, and DTensor's fallback {verb} its "
                             f"sharded input ({' and '.join(how)}).")
            if row["replicated outputs"]:
                lines.append(f"{row['module']}: sharded input, Replicate output, an all_gather inside: a silent gather "
                             "(every rank held and computed the whole tensor).")
            lines += [whole_line(row["module"], each) for each in row.get("whole", {}).values()]
        if self.error:
            lines.append(f"the backward raised {self.error}.")
        return lines

    @property
    def clean(self) -> bool:
        return not self.findings()

    def table(self, title: str = "") -> Table:
        """The rows as a table: collectives per phase with calls and bytes, and what the audit found, per module."""
        rows = [{"module": row["module"], "forward": format_ops(row["forward"]),
                 "backward": format_ops(row["backward"]) + (f" ({row['note']})" if row["note"] else ""),
                 "promoted": row["promoted"] or "",
                 "found": "; ".join([*(f"unpatched {op}" for op in row["unpatched"]),
                                     *(["silent gather"] if row["replicated outputs"] else []),
                                     *(f"whole on every rank: {name}" for name in row.get("whole", {}))])}
                for row in self.rows]
        total = self.totals()
        rows.append({"module": "total", "forward": format_ops(total["forward"]),
                     "backward": format_ops(total["backward"]), "promoted": "", "found": ""})
        return Table(rows, ["module", "forward", "backward", "promoted", "found"], title=[title] if title else ())


def whole_line(module: str, each: dict) -> str:
    """The finding for a tensor every rank holds whole (``Audit.rows[i]["whole"]``), with what to change."""
    held = f"{tuple(each['shape'])}, {each['bytes']:,} B on every rank"
    if each["parameter"]:
        leaf = each["parameter"].rsplit(".", 1)[-1]
        return (f"{module}: {each['parameter']} {held}, follows the field along dim {each['dim']} and is whole on "
                f"every rank: shard it on domain as a DTensor, Shard({each['dim']}) (sl.parity: strategy "
                f"'fsdp_spatial', spatial={{{leaf!r}: {each['dim']}}}).")
    return (f"{module}: a plain tensor {held} met the field split along dim {each['dim']} and holds that dim whole "
            f"({each['shape'][each['dim']]} long): every rank built all of it; build only this rank's rows (a "
            "ShardTensor.from_local of its slab).")


def _op_leaf(name: str) -> str:
    """``torch.cat`` -> cat, ``torch.Tensor.__add__`` -> add, ``aten.add.Tensor`` -> add."""
    parts = name.split(".")
    return (parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[-1]).strip("_")


def _placements(t):
    return getattr(t, "placements", None) if t is not None else None


def _tensors(*trees) -> list:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor)]


def _op_name(func) -> str:
    import torch

    if isinstance(func, torch._ops.OpOverload):
        return str(func)  # aten.cat.default
    name = torch.overrides.resolve_name(func)
    return name or getattr(func, "__qualname__", repr(func))


class _Recording:
    """The audit's state while the model runs: which module is running, in which phase, and each row so far."""

    def __init__(self, model):
        import torch

        self.torch = torch
        self.names = {module: path for path, module in model.named_modules()}
        self.held = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
        self.root = type(model).__name__
        self.rows: dict[str, dict] = {}
        self.phase = "forward"
        self.stack: list[dict] = []  # forward: one frame per module call running, innermost last
        self.spans: list[tuple[int, int, str]] = []  # (first, past-last node sequence number, module) per call
        self.fallbacks: list[list] = []  # [op, collectives that moved sharded data] per fallback running
        self.traced = hasattr(torch._C, "_current_autograd_node") and hasattr(torch._C._autograd, "_get_sequence_nr")

    def row(self, module: str) -> dict:
        if module not in self.rows:
            self.rows[module] = {"module": module or self.root, "forward": {}, "backward": {}, "unpatched": [],
                                 "unpatched moves": {}, "replicated outputs": False, "promoted": 0, "note": "",
                                 "whole": {}}
        return self.rows[module]

    def _sequence_nr(self) -> int:
        return self.torch._C._autograd._get_sequence_nr() if self.traced else 0

    def where(self) -> str:
        """The row what happens now belongs to: the innermost module running forward, the module whose forward
        created the autograd node running backward, the loss, or the whole model."""
        if self.phase == "loss":
            return LOSS
        if self.phase == "forward":
            return self.stack[-1]["module"] if self.stack else ""
        if not self.traced:  # this torch cannot say which node runs: the whole model's row takes the backward
            self.row("")["note"] = UNTRACED
            return ""
        node = self.torch._C._current_autograd_node()
        if node is None:  # the loss's own redistribution before the engine starts
            return LOSS
        number = node._sequence_nr()
        inside = [(first, module) for first, last, module in self.spans if first <= number < last]
        if inside:
            return max(inside)[1]  # the innermost: the call that started last
        self.row("")["note"] = UNTRACED
        return ""

    # -- what the hooks and wrappers report
    def collective(self, event) -> None:
        _add(self.row(self.where())["backward" if self.phase == "backward" else "forward"], event.name, 1, event.bytes)
        if self.fallbacks and event.name in MOVES_SHARDS:
            self.fallbacks[-1][1].append(event.name)
        if event.name == "all_gather":
            for frame in self.stack:
                frame["gathered"] = True

    def before(self, module, args, kwargs) -> None:
        sharded = any(any(p.is_shard() for p in _placements(t) or ()) for t in _tensors(args, kwargs))
        self.stack.append({"module": self.names.get(module, "?"), "sharded": sharded, "gathered": False,
                           "marked below": False, "first": self._sequence_nr()})
        self.row(self.stack[-1]["module"])  # rows come in the order modules first ran

    def after(self, module, args, kwargs, output) -> None:
        frame = self.stack.pop()
        self.spans.append((frame["first"], self._sequence_nr(), frame["module"]))
        outputs = [_placements(t) for t in _tensors(output) if _placements(t) is not None]
        replicated = bool(outputs) and all(all(p.is_replicate() for p in ps) for ps in outputs)
        marked = frame["sharded"] and frame["gathered"] and replicated and not frame["marked below"]
        if marked:
            self.row(frame["module"])["replicated outputs"] = True
        if self.stack:
            self.stack[-1]["marked below"] |= marked or frame["marked below"]

    def plain_beside_split(self, args, kwargs) -> None:
        """Each plain tensor of an op's arguments as long along a split dim as the split tensor beside it (the same
        number of dims, broadcast or concatenated alike): whole on every rank where a slab would do."""
        with self.torch._C.DisableTorchFunctionSubclass():  # shapes as they are, not through ShardTensor's ops
            tensors = _tensors(args, kwargs or {})
            split = [(t, p.dim % t.ndim) for t in tensors for p in _placements(t) or () if p.is_shard()]
            for t in tensors:
                if type(t) not in (self.torch.Tensor, self.torch.nn.Parameter) or t.dim() < 1:
                    continue
                for s, dim in split:
                    if t.ndim == s.ndim and t.shape[dim] == s.shape[dim] > s._local_tensor.shape[dim]:
                        name = self.held.get(id(t))
                        self.row(self.where())["whole"][name or f"{tuple(t.shape)}"] = {
                            "shape": list(t.shape), "bytes": t.numel() * t.element_size(), "dim": dim,
                            "parameter": name}
                        break

    def fallback(self, original):
        def through_dtensor(func, args, kwargs=None):
            if func is self.torch.Tensor.backward:  # the whole backward, not an op
                return original(func, args, kwargs)
            name = _op_name(func)
            if self.phase == "forward" and _op_leaf(name) in FIELD_OPS:
                self.plain_beside_split(args, kwargs)
            self.fallbacks.append([name, []])
            try:
                return original(func, args, kwargs)
            finally:
                op, moved = self.fallbacks.pop()
                if moved:
                    row = self.row(self.where())
                    if op not in row["unpatched"]:
                        row["unpatched"].append(op)
                    row["unpatched moves"][op] = sorted(set(row["unpatched moves"].get(op, ())) | set(moved))

        return through_dtensor

    def promoted(self, message, category, filename, lineno, file=None, line=None, show=None) -> None:
        if str(message).startswith(_PROMOTION):
            self.row(self.where())["promoted"] += 1
        else:
            show(message, category, filename, lineno, file, line)


def _raised_where(error: Exception) -> str:
    """``AssertionError at physicsnemo/domain_parallel/shard_tensor.py:186 (backward): message``: the innermost frame
    in PhysicsNeMo, where a model's backward usually fails, else the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(frames) if "/physicsnemo/" in f.filename), frames[-1])
    where = frame.filename.rsplit("site-packages/", 1)[-1]
    return f"{type(error).__name__} at {where}:{frame.lineno} ({frame.name}){': ' + str(error) if str(error) else ''}"


@contextlib.contextmanager
def _fallbacks_wrapped(recording: _Recording):
    """Both DTensor fallbacks wrapped in every PhysicsNeMo module that holds them (some import them by name), then
    put back."""
    from physicsnemo.domain_parallel import shard_tensor

    originals = {name: getattr(shard_tensor, name) for name in _FALLBACKS}
    wrapped = {name: recording.fallback(original) for name, original in originals.items()}
    replaced = []
    try:
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("physicsnemo") and m]:
            for name, original in originals.items():
                if getattr(module, "__dict__", {}).get(name) is original:
                    setattr(module, name, wrapped[name])
                    replaced.append((module, name, original))
        yield
    finally:
        for module, name, original in replaced:
            setattr(module, name, original)


@contextlib.contextmanager
def _promotions_counted(recording: _Recording):
    """PhysicsNeMo's WARN promotion mode for the block (unless promotion is DISABLED), its warnings counted."""
    from physicsnemo.domain_parallel import ShardTensor
    from physicsnemo.domain_parallel.shard_tensor import TensorPromotionMode

    disabled = ShardTensor.get_promotion_mode() is TensorPromotionMode.DISABLED
    with warnings.catch_warnings(), (contextlib.nullcontext() if disabled
                                     else ShardTensor.promotion_mode(TensorPromotionMode.WARN)):
        warnings.filterwarnings("always", message=_PROMOTION)
        show = warnings.showwarning
        warnings.showwarning = lambda *args, **kwargs: recording.promoted(*args, **kwargs, show=show)
        yield


@contextlib.contextmanager
def _modules_hooked(model, recording: _Recording):
    handles = []
    try:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(recording.before, with_kwargs=True))
            handles.append(module.register_forward_hook(recording.after, with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def audit_model(model, *inputs, loss=mean_square) -> Audit:
    """Run ``loss(model(*inputs)).backward()`` once, on every rank together, and say per module what it
    communicated and what ShardTensor could not shard (``Audit``). ``inputs``: ShardTensors and/or plain tensors.

    A backward that raises does not raise here: the audit reports it (``error``, and a finding), with what the
    forward did. The model's ``.grad`` are left as they were before the audit."""
    from .collectives import collective_recorder

    recording = _Recording(model)
    saved_grads = {p: p.grad for p in model.parameters()}
    for p in saved_grads:
        p.grad = None
    error = None
    try:
        with (_modules_hooked(model, recording), _fallbacks_wrapped(recording), _promotions_counted(recording),
              collective_recorder(recording.collective, see_inside_subclasses=True)):
            output = model(*inputs)
            recording.phase = "loss"
            first = recording._sequence_nr()
            value = loss(output)
            recording.spans.append((first, recording._sequence_nr(), LOSS))
            recording.phase = "backward"
            try:
                value.backward()
            except Exception as raised:  # the model's own failure: the audit's finding, with where it came from
                error = _raised_where(raised)
    finally:
        for p, grad in saved_grads.items():
            p.grad = grad
    rows = [row for row in recording.rows.values()
            if row["forward"] or row["backward"] or row["unpatched"] or row["replicated outputs"] or row["whole"]]
    return Audit(rows, output, error)
