"""Allocations: the CPU allocator's allocations and frees seen by a profiler, each free paired with its allocation."""

from __future__ import annotations


def cpu_allocator_changes(profile) -> list[tuple[int, int]]:
    """(time in ns, bytes) of every allocation (+) and free (-) the CPU allocator made while ``profile`` (a
    ``torch.profiler.profile`` with ``profile_memory=True``) ran, in time order, counting a free only where the same
    run saw that block allocated: a block allocated before the run is never counted, in or out.

    Upstream: torch 2.14's ``ProfiledCPUMemoryReporter`` (c10/core/CPUAllocator.cpp) records a block's size when a
    profiler sees it allocated and forgets it only when a profiler sees it freed. A block freed while no profiler runs
    keeps its entry; a later block at the same address, allocated with no profiler running, is then reported freed
    with the old size by the next profiler that sees it go, a free of bytes that run never counted (found when a test
    read 1 MiB too little after earlier tests in the same process had profiled). Events carry the block's address;
    this pairs each free with an allocation of the same run. No upstream issue yet.
    """
    def nodes(roots):
        for node in roots:
            yield node
            yield from nodes(node.children)

    allocations = [node for node in nodes(profile.profiler.kineto_results.experimental_event_tree())
                   if type(node.extra_fields).__name__ == "_ExtraFields_Allocation"
                   and node.extra_fields.device.type == "cpu"]
    changes, live = [], set()
    for node in sorted(allocations, key=lambda node: node.start_time_ns):
        ptr, nbytes = node.extra_fields.ptr, node.extra_fields.alloc_size
        if nbytes > 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue
        changes.append((node.start_time_ns, nbytes))
    return changes
