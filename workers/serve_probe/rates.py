"""Which offered rates to try: a bisection over the workload's ascending ladder of rates.

Each rate costs ``duration_s`` of load, so trying every rung of the ladder is what the probe
cannot afford; the SLO verdict is (close to) monotone in the rate (more load, more queueing, longer
TTFT), so the largest rate that meets it is found by bisection: try the middle rung, go up when
its SLO is met, down when not, until the interval is empty. A ladder of n rungs costs
ceil(log2(n + 1)) rates. Every rate tried is kept, in the order tried, so the verdict can be shown
as the latency-vs-rate curve it came from. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["Bisection"]


class Bisection:
    """``next()`` gives the rate to measure (None when done), ``report(met)`` says how it went."""

    def __init__(self, ladder: Sequence[float]) -> None:
        rates = [float(r) for r in ladder]
        if not rates:
            raise ValueError("traffic.rates is empty: no rate to try")
        if any(b <= a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"traffic.rates must be strictly ascending, got {list(ladder)}")
        if rates[0] <= 0:
            raise ValueError(f"traffic.rates must be positive, got {list(ladder)}")
        self.ladder = rates
        self.lo, self.hi = 0, len(rates) - 1
        self.best: int | None = None  # index of the highest rate that met the SLO
        self.tried: list[tuple[float, bool]] = []
        self._pending: int | None = None

    def next(self) -> float | None:
        if self._pending is not None:
            raise RuntimeError("report() the last rate before asking for the next")
        if self.lo > self.hi:
            return None
        self._pending = (self.lo + self.hi) // 2
        return self.ladder[self._pending]

    def report(self, met: bool) -> None:
        if self._pending is None:
            raise RuntimeError("no rate is being measured")
        mid, self._pending = self._pending, None
        self.tried.append((self.ladder[mid], bool(met)))
        if met:
            self.best = mid
            self.lo = mid + 1
        else:
            self.hi = mid - 1

    @property
    def best_rate(self) -> float | None:
        """The highest rate tried whose SLO was met (None: none was)."""
        return None if self.best is None else self.ladder[self.best]
