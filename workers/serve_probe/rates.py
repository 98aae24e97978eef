"""Which offered rates to try: the highest rate that meets the SLO, searched to a relative tolerance.

Each rate costs ``duration_s`` of load, and the SLO verdict is (close to) monotone in the rate
(more load, more queueing, longer TTFT), so the highest rate that meets the SLO is found by
bisection. Reading it off the workload's ladder of rates would report a config that sustains
5.7 req/s at 4 (the ladder's rung below 6): 29 % low. The search (issue 44) runs in three parts:

1. **The ladder seeds the bracket.** The ascending ``traffic.rates`` are bisected as rungs (the
   middle rung, up when met, down when not: ceil(log2(n + 1)) rates for n rungs), which ends with
   the highest rung met and the lowest rung missed above it.
2. **The bracket is bisected** at the geometric mean of its ends (the tolerance is relative, so
   each rate halves the bracket's log-width) until (missed - met) / met <= ``tolerance``
   (``workload.rate_tolerance``, 5 % by default): log2(ln(missed / met) / ln(1 + tolerance)) more
   rates, 4 for a rung gap of 4 to 6 at 5 %. The search stays inside the ladder: when its top rung
   meets the SLO the maximum is reported as *at least* that rung (``at_least``), and when its
   lowest rung misses, the bracket is (0, lowest rung) and no rate is reported (the ladder is the
   range of rates the user asked about; extrapolating past either end would load the engine at
   rates nobody asked for, and a rate below the lowest rung is one the user called too low to
   matter).
3. **The operating rate is confirmed by a repeat**: the highest rate met is run once more (fresh
   arrivals, the same number of requests as the run that decided it). When the repeat does not meet
   the SLO the rate is counted as missed: the bracket's top comes down to it and the search goes on
   below it (bisecting again if the new bracket is wider than the tolerance, then confirming the new
   highest rate met). A rate counts as sustained only when two runs of it met the SLO.

**An undecided rate** (its p99's order-statistic interval holds the target:
:func:`autotune.objectives.serving.summarize_rate`'s ``slo_verdict``) is run again at once with
``longer`` (4) times the requests, the cap: 4 x ``duration_s``. A p99 needs at least 368 requests to
have an upper end at 95 % (:func:`autotune.objectives.serving.requests_to_bound`), so a rate planned
with 92 requests or more can be decided by the longer run; one planned with fewer is not run again
(no run within the cap could bound its p99s). Still undecided, the rate is counted by its measured
p99s (``slo_met``): its entry in ``tried`` and the result's ``slo_verdict`` say "undecided" and why, so
a maximum that rests on an undecided rate is reported as such, not silently as sure. (Counting it as
not met would make every rate with fewer than 368 requests fail: a short CPU study would report
goodput 0 for every config.)

Every run is kept in ``tried``, in order, so the verdict can be shown as the latency-vs-rate curve
it came from. Pure: no I/O, no clock; the probe says when its time is up (:meth:`RateSearch.stop`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

__all__ = ["Load", "Tried", "RateSearch", "check_ladder", "check_tolerance", "LONGER", "MAX_RUNS", "TOLERANCE"]

TOLERANCE = 0.05  # workload.rate_tolerance's default
LONGER = 4  # an undecided rate's second run: this many times the planned requests (the cap)
MAX_RUNS = 32  # a safety net: a verdict that flips from run to run cannot keep the probe searching
VERDICTS = ("met", "missed", "undecided")


@dataclass(frozen=True)
class Load:
    """One run to make: ``rate`` req/s for ``scale`` x ``duration_s``; ``purpose`` is ``ladder``,
    ``bisect``, ``confirm`` (the repeat of the operating rate) or ``longer`` (an undecided rate
    again, with more requests)."""

    rate: float
    scale: int
    purpose: str


@dataclass(frozen=True)
class Tried:
    """A run made and what the search read from it: ``verdict`` is the run's ``slo_verdict``;
    ``counted`` whether the search counted the rate as met (None: a longer run decides instead);
    ``why`` says why when the verdict was undecided or a repeat overturned the rate."""

    rate: float
    scale: int
    purpose: str
    verdict: str
    counted: bool | None
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_ladder(ladder: Sequence[float]) -> list[float]:
    """The ladder as floats: non-empty, positive, strictly ascending (ValueError naming the field)."""
    rates = [float(r) for r in ladder]
    if not rates:
        raise ValueError("traffic.rates is empty: no rate to try")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"traffic.rates must be strictly ascending, got {list(ladder)}")
    if rates[0] <= 0 or not all(math.isfinite(r) for r in rates):
        raise ValueError(f"traffic.rates must be positive and finite, got {list(ladder)}")
    return rates


def check_tolerance(tolerance: Any) -> float:
    """``workload.rate_tolerance`` as a float in (0, 1) (ValueError naming the field): 0 would never
    end, 1 or more would accept a bracket twice as wide as its low end."""
    if isinstance(tolerance, bool):
        raise ValueError(f"workload.rate_tolerance must be a number between 0 and 1, got {tolerance!r}")
    try:
        value = float(tolerance)
    except (TypeError, ValueError):
        raise ValueError(f"workload.rate_tolerance must be a number between 0 and 1, got {tolerance!r}") from None
    if not 0.0 < value < 1.0:
        raise ValueError(f"workload.rate_tolerance must be above 0 and below 1, got {tolerance!r}")
    return value


def between(low: float, high: float, tolerance: float) -> float:
    """The geometric mean of ``low`` and ``high``, rounded to the fewest significant digits (at
    least 2 more than the tolerance has) that keep it strictly inside: readable rates (4.899, not
    4.898979485566356) that still halve the bracket."""
    middle = math.sqrt(low * high)
    digits = max(3, 2 + math.ceil(-math.log10(tolerance)))
    while digits < 17:
        rounded = float(f"{middle:.{digits}g}")
        if low < rounded < high:
            return rounded
        digits += 1
    return middle


class RateSearch:
    """``next()`` gives the run to make (None when done), ``report(verdict, why)`` says how it went.

    ``ladder``: the ascending ``traffic.rates``; ``tolerance``: the bracket's relative width to
    reach; ``longer``: the multiple of the planned requests an undecided rate is run again with;
    ``max_runs``: the most runs the search makes, whatever the verdicts."""

    def __init__(
        self, ladder: Sequence[float], tolerance: float = TOLERANCE, longer: int = LONGER, max_runs: int = MAX_RUNS
    ) -> None:
        self.ladder = check_ladder(ladder)
        self.tolerance = check_tolerance(tolerance)
        if int(longer) < 1:
            raise ValueError(f"longer must be at least 1, got {longer}")
        self.longer = int(longer)
        self.max_runs = int(max_runs)
        self.tried: list[Tried] = []
        self._lo, self._hi = 0, len(self.ladder) - 1  # the ladder's rungs not tried yet
        self._met: dict[float, int] = {}  # rate counted as met -> the scale that decided it
        self._missed: set[float] = set()
        self._confirmed: float | None = None
        self._pending: Load | None = None
        self._again: Load | None = None  # an undecided rate's longer run, due next
        self._origin: str | None = None  # what the pending longer run stands for: ladder, bisect, confirm
        self.stopped: str | None = None

    # ------------------------------------------------------------------ protocol
    def next(self) -> Load | None:
        """The next run to make, or None when the search is over."""
        if self._pending is not None:
            raise RuntimeError("report() the last run before asking for the next")
        if self.stopped is not None:
            return None
        if len(self.tried) >= self.max_runs:
            self.stop(f"the search made its {self.max_runs} runs (the cap)")
            return None
        self._pending = self._choose()
        return self._pending

    def report(self, verdict: str, why: str = "", measured_met: bool | None = None, extendable: bool = True) -> None:
        """How the pending run went: its ``slo_verdict`` (``met``, ``missed`` or ``undecided``),
        for an undecided one why (which interval holds which target), whether its measured p99s
        met the SLO (``slo_met``: what an undecided run is counted by once no more requests can
        decide it) and whether a longer run could decide it (``extendable``: it would complete the
        requests a p99 needs to be bounded from above)."""
        if self._pending is None:
            raise RuntimeError("no run is being measured")
        if verdict not in VERDICTS:
            raise ValueError(f"a run's verdict is one of {', '.join(VERDICTS)}; got {verdict!r}")
        load, self._pending = self._pending, None
        origin = self._origin if load.purpose == "longer" else load.purpose
        self._origin = None
        if verdict == "undecided" and load.scale < self.longer and extendable:
            self._again = Load(load.rate, self.longer, "longer")
            self._origin = origin
            note = f"undecided{': ' + why if why else ''}; run again with {self.longer}x the requests"
            self.tried.append(Tried(load.rate, load.scale, load.purpose, verdict, None, note))
            return
        met = verdict == "met" or (verdict == "undecided" and bool(measured_met))
        notes = []
        if verdict == "undecided":
            cap = (
                f"with {load.scale}x the planned requests (the cap)"
                if load.scale >= self.longer
                else f"(even {self.longer}x the planned requests could not bound its p99s)"
            )
            notes.append(
                f"undecided {cap}{': ' + why if why else ''}; counted by its measured p99s: "
                f"{'met' if met else 'not met'}"
            )
        if origin == "confirm":
            if met:
                self._confirmed = load.rate
            else:
                notes.append("the repeat did not meet the SLO: the rate is counted as missed, the search steps down")
                self._overturn(load.rate)
        elif met:
            self._met[load.rate] = load.scale
        else:
            self._missed.add(load.rate)
        if origin == "ladder":
            mid = self.ladder.index(load.rate)
            if met:
                self._lo = mid + 1
            else:
                self._hi = mid - 1
        self.tried.append(Tried(load.rate, load.scale, load.purpose, verdict, met, "; ".join(notes)))

    def stop(self, why: str) -> None:
        """End the search now (the probe's time is up): what was found so far is the answer. A run
        asked for and not made is dropped; when it was an undecided rate's longer run, that rate
        is counted as not met (as if the longer run had stayed undecided), saying why."""
        load = self._pending if self._pending is not None else self._again
        self._pending, self._again = None, None
        origin, self._origin = self._origin, None
        if load is not None and load.purpose == "longer" and self.tried and self.tried[-1].counted is None:
            last = self.tried[-1]
            self.tried[-1] = replace(last, counted=False, why=f"{last.why}; {why}: counted as not met")
            if origin == "confirm":
                self._overturn(load.rate)
            else:
                self._missed.add(load.rate)
        self.stopped = why

    # ------------------------------------------------------------------ answers
    @property
    def bracket(self) -> tuple[float | None, float | None]:
        """(the highest rate counted as met below every missed one, the lowest rate counted as
        missed); None for an end not found: no rate met / the top of the ladder met."""
        high = min(self._missed) if self._missed else None
        below = [r for r in self._met if high is None or r < high]
        return (max(below) if below else None), high

    @property
    def max_rate(self) -> float | None:
        """The highest rate counted as met (None: none was): the search's answer."""
        return self.bracket[0]

    @property
    def width(self) -> float | None:
        """(missed - met) / met: the tolerance reached; None without both ends."""
        low, high = self.bracket
        return None if low is None or high is None else (high - low) / low

    @property
    def at_least(self) -> bool:
        """The top rung met: the maximum is at least the top of the ladder (not searched beyond)."""
        low, high = self.bracket
        return low is not None and high is None

    @property
    def confirmed(self) -> bool:
        """The reported maximum was met by its repeat too."""
        return self._confirmed is not None and self._confirmed == self.max_rate

    @property
    def converged(self) -> bool:
        """The bracket is within the tolerance (or the top rung met)."""
        width = self.width
        return self.at_least or (width is not None and width <= self.tolerance)

    def summary(self) -> dict[str, Any]:
        """What the search found, for the probe's ``info["serving"]["search"]``."""
        low, high = self.bracket
        width = self.width
        return {
            "tolerance": self.tolerance,
            "max_rate": low,
            "bracket": [low, high],
            "tolerance_reached": None if width is None else round(width, 6),
            "converged": self.converged,
            "confirmed": self.confirmed,
            "at_least": self.at_least,
            "below_ladder": low is None and high is not None and high <= self.ladder[0],
            "stopped": self.stopped,
            "runs": len(self.tried),
            "tried": [t.as_dict() for t in self.tried],
        }

    # ------------------------------------------------------------------ the rule
    def _choose(self) -> Load | None:
        if self._again is not None:
            again, self._again = self._again, None
            return again
        if self._lo <= self._hi:  # the ladder's rungs first
            return Load(self.ladder[(self._lo + self._hi) // 2], 1, "ladder")
        low, high = self.bracket
        if low is None:
            return None  # nothing met: below the ladder
        if high is not None and (high - low) / low > self.tolerance:
            return Load(between(low, high, self.tolerance), 1, "bisect")
        if self._confirmed == low:
            return None
        return Load(low, self._met[low], "confirm")

    def _overturn(self, rate: float) -> None:
        """A repeat missed: the rate is missed from now on. With nothing met left below it, the
        ladder's rungs below it (never tried: a tried one would be the missed end already) are
        bisected again."""
        self._met.pop(rate, None)
        self._missed.add(rate)
        if self.bracket[0] is None:
            below = [i for i, r in enumerate(self.ladder) if r < rate]
            self._lo, self._hi = 0, (below[-1] if below else -1)
