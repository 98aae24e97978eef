"""Which config a study recommends: the best, unless it leaves too little memory free and a
config as good within the error of what ranked them leaves enough.

The fastest config is often the one that fills the device (62.1 of 64 GiB), and the model or
the measurement that put it first is not exact: a config within that error of it and with room
to spare is the better production choice (a longer sequence in one batch, a fragmenting
allocator, a new driver's reserve do not OOM it). The rule, stated in the report:

- the error: ``recommend.tolerance`` if set, else the simulator's error on published runs
  (``SIMULATOR_MAPE``) when the trials are predictions, or the measurement noise
  (``MEASUREMENT_NOISE``) when they are measured;
- when the best leaves less than ``recommend.min_headroom_gib`` free, the recommendation is
  the best of the configs within the error of it that leave at least that much; with none,
  the best, and the report says it is tight.

A serving engine takes its ``memory_utilization`` share of the device on purpose and fills it with
KV cache, so its peak says nothing about room: its headroom is what its setting leaves outside the
engine, ``device memory x (1 - memory_utilization)``.

Configs tied with the best (its certificate, :mod:`autotune.objectives.race`: the readings cannot
order them and each is within the tie tolerance of the best measured at the study's confidence)
are equal on the evidence: the one that leaves the most memory free is recommended when it leaves
at least ``TIE_ROOM_GIB`` more than the best.

Several objectives are a Pareto front, which already is the trade-off: the rule applies to
single-objective studies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..sanity import is_finite_number
from ..workers.protocol import PEAK_COUNTS_KEY, PEAK_LEAVES_OUT

__all__ = ["Recommendation", "recommend", "study_recommendation", "SIMULATOR_MAPE", "MEASUREMENT_NOISE"]

# benchmarks/simulator_fidelity.py: predicted vs published step times of 9 measured training
# runs (the rows of benchmarks/data/training_measured.csv), mean absolute error 5.3 %. On 27 rows
# the model never saw (training_heldout.csv) it is 9.1 % in absolute terms, but the tolerance is
# between configs of one study, one stack on one hardware: the held-out A800 layout ablation
# (seven layouts of one node) spreads its errors over -2 % to +14 % and ranks them as measured.
SIMULATOR_MAPE = 0.053
MEASUREMENT_NOISE = 0.03  # the guide's noise: repeated probes of one config (median of measured steps)


@dataclass
class Recommendation:
    chosen: Any  # the TrialRecord recommended (and exported)
    best: Any  # the best by the first objective
    headroom_gib: float | None  # what the chosen leaves free
    best_headroom_gib: float | None
    tolerance: float
    sentence: str  # the rule's verdict, for the report and the run's output

    @property
    def changed(self) -> bool:
        return self.chosen is not self.best


def _headroom(record: Any, capacity_gib: float | None) -> float | None:
    """What the config leaves free of the device. A probe whose peak counts only the caching
    allocator (``peak_memory_counts``: torch's allocated or reserved counter) did not see the
    fragmentation, runtime context and communication buffers the device also holds: the
    simulator's figures for them are added, not assumed zero."""
    share = (getattr(record, "config", None) or {}).get("memory_utilization")
    if capacity_gib is not None and is_finite_number(share):  # a serving engine: by its own setting
        return float(capacity_gib) * (1.0 - float(share))
    peak = record.metrics.get("peak_memory_gib")
    if capacity_gib is None or not is_finite_number(peak):
        return None
    counts = (getattr(record, "info", None) or {}).get(PEAK_COUNTS_KEY, "device")
    predicted = getattr(record, "predicted", None) or {}
    unseen = sum(float(predicted.get(f"mem_{k}", 0.0)) for k in PEAK_LEAVES_OUT.get(counts, ()))
    return float(capacity_gib) - float(peak) - unseen


def recommend(
    records: list[Any],
    best: list[Any],
    objectives: list[tuple[str, str]],
    capacity_gib: float | None,
    min_headroom_gib: float | None,
    tolerance: float | None,
    simulated: bool,
    ties: Sequence[Any] = (),
) -> Recommendation | None:
    """The recommendation among ``records`` (``best``: the study's best, as ``best_records``;
    ``ties``: the configs its certificate declares tied with it, :mod:`autotune.objectives.race`)."""
    if not best:
        return None
    top = best[0]
    tol = float(tolerance) if tolerance is not None else (SIMULATOR_MAPE if simulated else MEASUREMENT_NOISE)
    top_room = _headroom(top, capacity_gib)
    plain = Recommendation(top, top, top_room, top_room, tol, "")
    tied = _roomiest_tie(top, top_room, ties, capacity_gib)
    if tied is not None:
        chosen, room = tied
        return Recommendation(
            chosen,
            top,
            room,
            top_room,
            tol,
            f"recommended trial {chosen.number}: tied with the best, trial {top.number} (the readings cannot order "
            f"them and each is certified within the tie tolerance of the best measured), and it leaves "
            f"{room:.1f} GiB free against {top_room:.1f}: the roomier of the tied configs",
        )
    if len(objectives) != 1 or min_headroom_gib is None or top_room is None or top_room >= min_headroom_gib:
        return plain
    metric, direction = objectives[0]
    value = top.metrics.get(metric)
    if not is_finite_number(value) or value == 0:
        return plain
    error = (
        "the model's error on published runs"
        if simulated and tolerance is None
        else ("the measurement noise" if tolerance is None else "recommend.tolerance")
    )

    def close(r: Any) -> bool:
        v = r.metrics.get(metric)
        if not is_finite_number(v):
            return False
        return v >= value * (1 - tol) if direction == "maximize" else v <= value * (1 + tol)

    candidates = []
    for r in records:
        room = _headroom(r, capacity_gib)
        if (
            r.status == "ok"
            and r.probed
            and r is not top
            and room is not None
            and room >= min_headroom_gib
            and close(r)
        ):
            candidates.append((r, room))
    share = top.config.get("memory_utilization") if isinstance(getattr(top, "config", None), dict) else None
    tight = (
        f"the best, trial {top.number}, runs its engine at memory_utilization {share:g}, which leaves "
        f"{top_room:.1f} GiB of {capacity_gib:g} outside the engine's share (the engine fills its share with KV "
        f"cache by design), below recommend.min_headroom_gib {min_headroom_gib:g}"
        if is_finite_number(share)
        else f"the best, trial {top.number}, leaves {top_room:.1f} GiB of {capacity_gib:g} free, below "
        f"recommend.min_headroom_gib {min_headroom_gib:g}"
    )
    if not candidates:
        plain.sentence = (
            f"{tight}, and no config within {tol:.1%} ({error}) of it leaves more: it is recommended, tight"
        )
        return plain
    sign = 1.0 if direction == "maximize" else -1.0
    chosen, room = max(candidates, key=lambda c: (sign * c[0].metrics[metric], c[1]))
    share = chosen.metrics[metric] / value
    sentence = (
        f"recommended trial {chosen.number}: {share:.1%} of the best's {metric}, {room - top_room:.1f} GiB "
        f"more headroom ({room:.1f} GiB free); {tight}, and trial {chosen.number} is within {tol:.1%} "
        f"({error}) of it"
    )
    return Recommendation(chosen, top, room, top_room, tol, sentence)


TIE_ROOM_GIB = 0.5  # a tied config is recommended for its headroom when it leaves at least this much more


def _roomiest_tie(
    top: Any, top_room: float | None, ties: Sequence[Any], capacity_gib: float | None
) -> tuple[Any, float] | None:
    """Among configs tied with the best, the one that leaves the most memory free, when it leaves
    :data:`TIE_ROOM_GIB` more than the best (memory is what the readings cannot see)."""
    if top_room is None or not ties:
        return None
    rooms = [(r, _headroom(r, capacity_gib)) for r in ties]
    rooms = [(r, room) for r, room in rooms if room is not None]
    if not rooms:
        return None
    chosen, room = max(rooms, key=lambda c: c[1])
    return (chosen, room) if room >= top_room + TIE_ROOM_GIB else None


def study_recommendation(
    spec: Any,
    records: list[Any],
    best: list[Any],
    objectives: Sequence[tuple[str, str]] | None = None,
    ties: Sequence[Any] = (),
) -> Recommendation | None:
    """The recommendation of a study under its spec's ``recommend:`` settings (capacity: the
    device memory of the spec's hardware profile; predictions or measurements from the best's
    source; ``objectives``: the spec's, resolved, when the caller has them)."""
    if not best:
        return None
    from ..spec.resolve import objectives_of, probe_context

    capacity = probe_context(spec).hardware.get("device_memory_gib")
    return recommend(
        records,
        best,
        list(objectives) if objectives is not None else list(objectives_of(spec)),
        float(capacity) if is_finite_number(capacity) else None,
        spec.recommend.min_headroom_gib,
        spec.recommend.tolerance,
        best[0].source == "simulated",
        ties,
    )
