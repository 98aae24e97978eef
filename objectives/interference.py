"""Readings a slowdown of the machine spoiled (issue 44, the heavy tail): set aside, not averaged.

Installed as ``autotune.objectives.interference``. Pure definitions over readings, like the rest of
:mod:`autotune.objectives`.

A neighbour's job, a busy link, a throttled clock or a page-cache miss slows a probe; nothing makes
one faster than the config is. So where two readings of one config disagree far beyond the study's
noise, the mean of the two is not the config's figure: the slower one is interference. On the
search benchmark's heavy-tailed family (10 % of probes 20 % slow) 5 of the 11 misses had probed the
optimum, read it slow once and reported a slower config (benchmarks/README.md); a mean of that slow
reading and a good one still lost.

The rule (:func:`interference`): a reading worse than its config's best reading by more than
its gap (:func:`interference_gaps`) is set aside. The gap is :data:`INTERFERENCE_Z` standard
deviations of the difference of two readings at the noise the *other* configs' repeats show, never
below :data:`MIN_INTERFERENCE_GAP`: a spoiled pair does not raise the bar it is judged by, and a
machine whose noise is wide (a shared CPU host, ±10 % and more) shows it in the other pairs it
repeats. That noise is the median spread once three other configs were measured twice (robust to
a spoiled one among them), their pooled spread before, and never below the floor the study assumes
(3 %: a gap of 12.7 %). At 2 % noise a pair of honest readings passes that gap about once in 10^5;
at 5 % about once in 14 while no other config was measured twice, then about once in 400. The
first pair a study repeats is judged on the floor alone: on a machine far noisier than the floor
its lower reading may be set aside (the report names it).

What is set aside stays in the study's records and counts as spent; it is left out of the config's
figure, of the study's noise and of the guide's model. A figure that rests on fewer readings than
were taken says so (``autotune.study.records``).

Only figures a slowdown makes worse are read this way (:func:`slowed_by_interference`): a peak of
memory is not.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

from .intervals import relative_groups, repeat_noise

__all__ = [
    "INTERFERENCE_Z",
    "MIN_INTERFERENCE_GAP",
    "ROBUST_GROUPS",
    "interference",
    "interference_gap",
    "interference_gaps",
    "interference_flags",
    "robust_noise",
    "slowed_by_interference",
]

INTERFERENCE_Z = 3.0  # standard deviations of a two-reading difference beyond which the slower is interference
MIN_INTERFERENCE_GAP = 0.10  # ... and never a smaller share than this of the better reading
ROBUST_GROUPS = 3  # configs measured more than once before their median spread is believed over the floor
_MEDIAN_OF_HALF_NORMAL = 0.6744897501960817  # the median of |N(0, 1)|: a pair's spread over the noise


def _finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def slowed_by_interference(metric: str) -> bool:
    """Whether a slowdown of the machine makes ``metric`` worse (a step time, a throughput, a
    latency, a goodput), so that :func:`interference` may read it; a peak of memory does not move
    with a slower machine."""
    return "memory" not in metric and not metric.startswith("peak_")


def robust_noise(groups: Iterable[Sequence[float | None]], floor: float) -> float:
    """The relative noise of one reading, read so that a spoiled pair does not set it: with
    :data:`ROBUST_GROUPS` or more configs measured more than once, the median of their relative
    spreads (sample standard deviation over the mean) over the median of a half-normal (exact for
    pairs, cautious for groups of three or more); never below ``floor``. Fewer groups: ``floor``."""
    spreads = [statistics.stdev(ratios) for ratios in relative_groups(groups)]
    if len(spreads) < ROBUST_GROUPS:
        return floor
    return max(floor, statistics.median(spreads) / _MEDIAN_OF_HALF_NORMAL)


def interference_gap(others: Sequence[Sequence[float | None]], floor: float) -> float:
    """The share of a config's best reading by which another of its readings must be worse to be
    read as interference, judged against ``others`` (the other configs' readings):
    :data:`INTERFERENCE_Z` x sqrt(2) x their noise (:func:`robust_noise` with :data:`ROBUST_GROUPS`
    or more repeated, else their pooled spread, never below ``floor``), at least
    :data:`MIN_INTERFERENCE_GAP`."""
    repeated = [g for g in others if len(_finite(g)) > 1]
    noise = robust_noise(repeated, floor) if len(repeated) >= ROBUST_GROUPS else repeat_noise(repeated, floor)
    return max(MIN_INTERFERENCE_GAP, INTERFERENCE_Z * math.sqrt(2.0) * noise)


def interference_gaps(groups: Sequence[Sequence[float | None]], floor: float) -> list[float]:
    """Per group (a config's readings): its :func:`interference_gap` against every other group."""
    return [interference_gap([g for j, g in enumerate(groups) if j != k], floor) for k in range(len(groups))]


def interference_flags(groups: Sequence[Sequence[float | None]], floor: float, maximize: bool) -> list[list[bool]]:
    """Per group (a config's readings), per reading: whether it is interference (:func:`interference`
    at the group's gap against every other group, :func:`interference_gaps`). What the guide and the
    report both read; a group read once is never judged, nor counted in another's gap."""
    flags = [[False] * len(g) for g in groups]
    repeated = [k for k, g in enumerate(groups) if len(_finite(g)) > 1]
    gaps = interference_gaps([groups[k] for k in repeated], floor)
    for k, gap in zip(repeated, gaps):
        flags[k] = interference(groups[k], gap, maximize)
    return flags


def interference(readings: Sequence[float | None], gap: float, maximize: bool) -> list[bool]:
    """Per reading of one config: whether it is interference, worse than the config's best reading
    by more than ``gap`` (a share of the best). Non-finite readings are never flagged (they are no
    reading); a config read once has nothing to disagree with."""
    values = _finite(readings)
    if len(values) < 2:
        return [False] * len(readings)
    best = max(values) if maximize else min(values)
    if not best:
        return [False] * len(readings)
    flags = []
    for v in readings:
        if v is None or not math.isfinite(float(v)):
            flags.append(False)
            continue
        worse = (best - float(v)) / abs(best) if maximize else (float(v) - best) / abs(best)
        flags.append(worse > gap)
    return flags
