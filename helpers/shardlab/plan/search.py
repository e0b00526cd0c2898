"""The domain sizes a field can be split into, and the smallest that fits: searched, not scanned."""

from __future__ import annotations

from ..levers import NO_LEVERS, Levers
from .records import headroom


class DomainSearch:
    """The domain-size questions of a ``Planner`` (which gives ``field_shape``, ``dim``, ``halo`` and ``largest``)."""

    def valid_domain(self, n: int) -> bool:
        """Whether n domain ranks each get at least the halo rows (and one row) of ``torch.chunk``'s split."""
        extent, need = self.field_shape[self.dim], max(1, self.halo)
        if n == 1:
            return True
        size = -(-extent // n)  # torch.chunk: slices of ceil(extent / n) rows, the last one what is left
        return n <= extent and -(-extent // size) == n and extent - size * (n - 1) >= need

    def _valid_at_or_above(self, n: int) -> int | None:
        extent = self.field_shape[self.dim]
        return next((m for m in range(max(1, n), extent + 1) if self.valid_domain(m)), None)

    def _valid_at_or_below(self, n: int) -> int:
        return next(m for m in range(min(n, self.field_shape[self.dim]), 0, -1) if self.valid_domain(m))

    def valid_domains(self) -> list[int]:
        """Every domain size this field can be split into (see ``valid_domain``), smallest first."""
        return [n for n in range(1, self.field_shape[self.dim] + 1) if self.valid_domain(n)]

    def max_domain(self) -> int:
        """The most domain ranks the sharded dim allows."""
        return self._valid_at_or_below(self.field_shape[self.dim])

    def fits(self, capacity: int, ddp: int = 1, domain: int = 1, wrapper: str = "ddp", levers: Levers = NO_LEVERS
             ) -> bool:
        need = self.largest(ddp, domain, wrapper, levers).total
        return need + headroom(need, ddp * domain) <= capacity

    def smallest_domain(self, capacity: int, ddp: int = 1, wrapper: str = "ddp", levers: Levers = NO_LEVERS
                        ) -> int | None:
        """The fewest domain ranks with which every rank fits in ``capacity`` (headroom kept), or None.

        A bisection over the domain sizes, not a scan: the largest rank's rows, hence its bytes, never grow with the
        domain size, so a million-row field takes about 20 plans of one or three ranks each."""
        if self.fits(capacity, ddp, 1, wrapper, levers):  # apart: one rank alone keeps no headroom for NCCL
            return 1
        top = self.max_domain()
        if top == 1 or not self.fits(capacity, ddp, top, wrapper, levers):
            return None
        lo, hi = 2, top  # the smallest n whose next valid domain size fits
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fits(capacity, ddp, self._valid_at_or_above(mid), wrapper, levers):
                hi = mid
            else:
                lo = mid + 1
        return self._valid_at_or_above(lo)
