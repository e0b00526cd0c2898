"""Each collective a block of code ran, as one ``Event``: its primitive, its group, the bytes this rank handed to it.

One recorder for the series: ``sl.exercises.Watch`` judges what a learner's call communicated with it, and
``sl.measure.audit`` attributes a model's collectives to its modules with it. A dispatch mode sees every c10d op,
whoever calls it (the learner, a library, ShardTensor's handlers), with the bytes this rank hands over and the group's
ranks; ``CommDebugMode`` counts collectives by op and module, without either (lesson 08).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from .memory import CollectiveBytes

# c10d ops (and their functional twins) by the primitive a lesson teaches.
PRIMITIVES = {
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


def collective_event(name: str, args, kwargs) -> Event:
    """The Event of one c10d op: its primitive, its group's global ranks, the bytes this rank hands to it."""
    flat = tree_flatten((args, kwargs))[0]
    group = _group_of(flat)
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    sent = tree_flatten((args[1:], kwargs) if name in _OUTPUT_FIRST else (args, kwargs))[0]
    size = sum(t.numel() * t.element_size() for t in sent if isinstance(t, torch.Tensor))
    peer = None
    if PRIMITIVES[name] in ("send", "recv") and group is not None:  # the peer is a rank of the group
        local = next((a for a in flat if isinstance(a, int) and not isinstance(a, bool)), None)
        peer = ranks[local] if local is not None and 0 <= local < len(ranks) else None
    return Event("collective", PRIMITIVES[name], ranks, size, peer)


def collective_recorder(on_event: Callable[[Event], None], see_inside_subclasses: bool = False):
    """A dispatch mode that calls ``on_event`` with the Event of every collective run inside it.

    A mode runs before a tensor subclass's own dispatch, so the collectives a subclass issues there (DTensor
    redistributing an operand its sharding rule cannot take as it is) run after the mode has handed the op on, out
    of its sight. ``see_inside_subclasses``: hand every op with a subclass operand (DTensor, ShardTensor) to the
    subclass first, as ``CommDebugMode`` does for DTensor, so those collectives come back through the mode too."""

    handed_on = ()
    if see_inside_subclasses:  # only these: a FakeTensor (DTensor's sharding rules run on them) needs its own mode
        from physicsnemo.domain_parallel import ShardTensor
        from torch.distributed.tensor import DTensor

        handed_on = (DTensor, ShardTensor)

    class Recorder(CollectiveBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, handed_on) for t in types):
                return NotImplemented
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = str(func.overloadpacket).split(".")[-1]
            if func.namespace in self.NAMESPACES and name in PRIMITIVES:
                hook = sys.getprofile()
                sys.setprofile(None)  # this bookkeeping is the recorder's own, not the watched code's
                try:
                    on_event(collective_event(name, args, kwargs))
                finally:
                    sys.setprofile(hook)
            return out

    return Recorder()
