"""A study's trials as reports, exports, MLflow and the search see them: :class:`TrialRecord`, read
from the trial attributes autotune writes (:mod:`autotune.trial_attrs`), and the rules every reader shares:
which trials are the best (:func:`best_records`) and which become MLflow child runs
(:func:`is_tracked`). Pure functions over an Optuna study; nothing here writes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import optuna
from optuna.trial import TrialState

from autotune.objectives.interference import interference_flags, slowed_by_interference
from autotune.objectives.intervals import (
    NoisePrior,
    noise_belief,
    noise_floor,
    repeat_noise,
    separated,
    step_reading_noise,
)
from autotune.objectives.race import Certificate, certificate, control_drift, readings_to_tell

from ..guide.guided import GuideSettings
from ..sanity import is_finite_number as _finite
from ..spec.space import config_key
from ..trial_attrs import A

__all__ = [
    "TrialRecord",
    "trial_records",
    "trial_record",
    "frozen_trial",
    "guide_estimates",
    "best_records",
    "rankable",
    "CONFIRMED_AT_TARGET",
    "measured_at_target_first",
    "beyond_noise",
    "measurement_noise",
    "ASSUMED_NOISE",
    "NOISE_PRIOR_ATTR",
    "noise_prior_dof",
    "noise_prior_of",
    "interference_readings",
    "INTERFERENCE_KEY",
    "best_certificate",
    "certificate_sentence",
    "StudyReadings",
    "study_readings",
    "race_readings",
    "drift_sentence",
    "is_tracked",
]


# ``info`` key of a slice study's config measured again at the target's full size (cluster.confirm_top)
CONFIRMED_AT_TARGET = "confirmed_at_target"
# ``info`` key of a best's readings set aside as interference (their trial numbers: interference_readings)
INTERFERENCE_KEY = "set_aside_as_interference"


@dataclass
class TrialRecord:
    """A trial as reports and exports see it."""

    number: int
    state: str
    config: dict[str, Any]
    status: str
    source: str
    metrics: dict[str, float]
    predicted: dict[str, float]
    reason: str
    probed: bool
    baseline: bool
    chosen_because: str
    values: list[float] | None
    feasible: bool
    info: dict[str, Any] = field(default_factory=dict)  # what the probe said about itself (software, device)
    wall_s: float = 0.0  # how long the probe ran (OOM probes cost a launch: the summary adds them up)
    memory_profile: dict[str, Any] = field(
        default_factory=dict
    )  # its memory profile (autotune.study.profiling), if any
    short_steps: int | None = None  # a re-measurement's timed steps, where fewer than the workload's

    def budget_attrs(self) -> dict[str, Any]:
        """The user attributes its cost against the budget is read from (status, wall, memory
        profile: :func:`autotune.guide.memory_profile.cost_of_trials`), for callers that hold records."""
        attrs = {A.STATUS: self.status, A.WALL: self.wall_s, A.MEMORY_PROFILE: self.memory_profile}
        return {**attrs, A.SHORT_STEPS: self.short_steps} if self.short_steps else attrs

    def measured_where(self) -> dict[str, Any]:
        """Where a slice study's figure stands: measured on the probe slice and projected
        (``projected_from``: where, what it read, the projection), or measured again at the
        target's full size (``confirmed_at_target``); empty for any other trial."""
        return {k: self.info[k] for k in ("projected_from", CONFIRMED_AT_TARGET) if self.info.get(k)}

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "state": self.state,
            "status": self.status,
            "params": self.config,
            "metrics": self.metrics,
            "predicted": self.predicted,
            "source": self.source,
            "failure": self.reason if self.status not in ("ok",) else None,
            "probed": self.probed,
            "baseline": self.baseline,
            "chosen_because": self.chosen_because,
            **({"memory_profile": self.memory_profile} if self.memory_profile else {}),
            **({"short_steps": self.short_steps} if self.short_steps else {}),
            **self.measured_where(),
            # measured, but missing the spec's constraints on metrics: why it is not the best
            **({"misses": self.reason} if self.status == "ok" and not self.feasible else {}),
            # scaling_efficiency / comm_fraction read by the model from the measurement
            **({"scaling_figures": self.info["scaling_figures"]} if self.info.get("scaling_figures") else {}),
        }


# per study object: a finished trial's record, by the trial object it was read from (kept, so that
# its id is not reused while the entry lives)
_FINISHED_RECORDS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, TrialRecord]]]" = weakref.WeakKeyDictionary()


def trial_records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial of the study as a record. A finished trial is read into its record once per
    study object: its attributes never change again (Optuna refuses to write them), while the loop
    reads every record after each trial (the best so far, the refit), which made a study's
    bookkeeping grow with the square of its trials. Treat the records as read-only (every reader
    copies with ``dataclasses.replace``)."""
    try:
        seen = _FINISHED_RECORDS.setdefault(study, {})
    except TypeError:  # an object that cannot be weakly referenced: nothing kept
        seen = {}
    out = []
    for t in study.get_trials(deepcopy=False):
        hit = seen.get(id(t))
        if hit is not None and hit[0] is t:
            out.append(hit[1])
            continue
        record = _record(t)
        if t.state.is_finished():
            seen[id(t)] = (t, record)
        out.append(record)
    return out


def _record(t: optuna.trial.FrozenTrial) -> TrialRecord:
    ua = t.user_attrs
    feasible = all(v <= 0 for v in t.constraints.values()) if t.constraints else True
    return TrialRecord(
        number=t.number,
        state=t.state.name,
        config=ua.get(A.CONFIG, dict(t.params)),
        status=ua.get(A.STATUS, "running" if t.state == TrialState.RUNNING else t.state.name.lower()),
        source=ua.get(A.SOURCE, ""),
        metrics=ua.get(A.METRICS, {}),
        predicted=ua.get(A.PREDICTED, {}),
        reason=ua.get(A.REASON, ""),
        probed=bool(ua.get(A.PROBED, False)),
        baseline=bool(ua.get(A.BASELINE, False)),
        chosen_because=ua.get(A.CHOSEN, ""),
        values=list(t.values) if t.values else None,
        feasible=feasible,
        info=ua.get(A.INFO) or {},
        wall_s=float(ua.get(A.WALL) or 0.0),
        memory_profile=dict(ua.get(A.MEMORY_PROFILE) or {}),
        short_steps=int(ua[A.SHORT_STEPS]) if ua.get(A.SHORT_STEPS) else None,
    )


def guide_estimates(study: optuna.Study) -> dict[str, tuple[float, float, int]] | None:
    """The guide's estimates of the measured configs (``GuidedSampler.estimates``, kept on the
    study after every probe), or None in a study the guide did not steer."""
    raw = study.user_attrs.get(A.GUIDE_ESTIMATES)
    if not isinstance(raw, dict):
        return None
    return {
        k: (float(v[0]), float(v[1]), int(v[2]))
        for k, v in raw.items()
        if isinstance(v, (list, tuple)) and len(v) == 3 and all(_finite(x) for x in v)
    }


def noise_prior_of(study: optuna.Study) -> NoisePrior:
    """The noise the study's guide took before any repeat (:data:`NOISE_PRIOR_ATTR`, written when the
    study opened), else the assumption (:data:`ASSUMED_NOISE`)."""
    return NoisePrior.from_json(study.user_attrs.get(NOISE_PRIOR_ATTR), ASSUMED_NOISE)


def measured_at_target_first(records: list[TrialRecord]) -> list[TrialRecord]:
    """A slice study's records as the recommendation weighs them: once some configs were measured
    again at full size (``cluster.confirm_top``), only those full-size measurements; a projection
    from the slice competes with no measurement at the target (in worlds whose scaling the model
    does not price, every true figure there can be below its projection)."""
    confirmed = [r for r in records if r.info.get(CONFIRMED_AT_TARGET)]
    return confirmed or records


def rankable(records: list[TrialRecord], objectives: list[tuple[str, str]]) -> list[TrialRecord]:
    """The trials that may be the best: probed and completed, ok, feasible (a result that misses
    the spec's constraints on metrics never is) and a finite reading of every objective."""
    return [
        r
        for r in records
        if r.status == "ok"
        and r.state == "COMPLETE"
        and r.probed
        and r.feasible
        and all(_finite(r.metrics.get(m)) for m, _ in objectives)
    ]


def best_records(
    records: list[TrialRecord],
    objectives: list[tuple[str, str]],
    estimates: dict[str, tuple[float, float, int]] | None = None,
    prior: NoisePrior | None = None,
) -> list[TrialRecord]:
    """The best probed trials: the single best for one objective, the Pareto front for several
    (best first by the first objective). Rule rejections and repeats are never "best". A config
    measured more than once (a close call, measured again) is judged on the mean of its
    measurements; the record returned is its latest, with those means as its metrics.

    With ``estimates`` (a guided study, one objective) the best is the measured config with the
    best estimate, not the best single reading: with 2-3 % noise between runs, the highest
    reading among twenty is often a slower config measured high (the winner's curse), while
    the guide's estimate pools every measurement. But between measured configs the measurements
    decide (issue 44): the estimate chooses only among the configs whose readings the noise cannot
    tell from the best reading (:func:`beyond_noise`); a model that ranks a config far above what
    it measured does not make it the best. The record returned then carries
    ``estimated_<metric>`` (and ``_sd``) in its ``predicted``; its metrics stay what was measured.
    ``prior``: the study's noise before its repeats (:data:`NOISE_PRIOR_ATTR`), else assumed."""
    ok = measured_at_target_first(rankable(records, objectives))
    if not ok:
        return []
    aside = interference_readings(ok, *objectives[0], prior=prior)
    groups: dict[str, list[TrialRecord]] = {}
    spoiled: dict[str, list[int]] = {}
    for r in ok:
        if r.number in aside:
            spoiled.setdefault(config_key(r.config), []).append(r.number)
        else:
            groups.setdefault(config_key(r.config), []).append(r)
    merged = []
    for key, rs in groups.items():
        latest = max(rs, key=lambda r: r.number)
        if key in spoiled:
            latest = dataclasses.replace(latest, info={**latest.info, INTERFERENCE_KEY: spoiled[key]})
        if len(rs) > 1:
            metrics = dict(latest.metrics)
            for name in {k for r in rs for k in r.metrics}:
                values = [r.metrics[name] for r in rs if _finite(r.metrics.get(name))]
                if values:
                    metrics[name] = statistics.fmean(values)
            metrics["measurements"] = len(rs)
            latest = dataclasses.replace(latest, metrics=metrics)
        merged.append(latest)
    ok = merged
    m, d = objectives[0]
    ok.sort(key=lambda r: r.metrics[m], reverse=(d == "maximize"))
    if len(objectives) == 1:
        if estimates:

            def estimate(r: TrialRecord) -> float:
                e = estimates.get(config_key(r.config))
                return e[0] if e is not None else float(r.metrics[m])

            noise = measurement_noise(groups.values(), m, prior)
            contenders = [r for r in ok if not beyond_noise(ok[0], r, m, noise)]
            if not all(_agrees(estimates.get(config_key(r.config)), r, m, noise) for r in contenders):
                return ok[:1]  # the guide's model does not describe what was measured: the readings decide
            top = max(contenders, key=estimate) if d == "maximize" else min(contenders, key=estimate)
            e = estimates.get(config_key(top.config))
            if e is not None:
                top = dataclasses.replace(
                    top, predicted={**top.predicted, f"estimated_{m}": e[0], f"estimated_{m}_sd": e[1]}
                )
            return [top]
        return ok[:1]
    import numpy as np

    from ..guide.ranking import pareto_order

    values = np.array([[r.metrics[m] * (1 if d == "maximize" else -1) for m, d in objectives] for r in ok])
    fronts = pareto_order(values)
    return [r for r, f in zip(ok, fronts) if f == 0]


# a measurement's relative noise between runs where the study has no repeat to measure it by and its
# readings gave no steps: the guide's own assumption, a floor under what repeats show
DEFAULT_NOISE = GuideSettings.noise
ASSUMED_NOISE = NoisePrior(DEFAULT_NOISE)
# the study's attribute that keeps the noise its guide took before any repeat (NoisePrior.to_json), where a
# measurement of the host gave it (a serving profile's serving_steps.repeat_noise); absent: assumed
NOISE_PRIOR_ATTR = "autotune.noise_prior"


def study_noise_floor(records: Iterable[TrialRecord], metric: str, prior: NoisePrior | None = None) -> float:
    """The floor under the study's noise of ``metric`` between runs: its readings' own within-run
    standard error where their probes gave steps (:func:`autotune.objectives.intervals.noise_floor`,
    as the guide reads it: ``Guide.noise_floor``), else the ``prior``'s noise (assumed:
    :data:`DEFAULT_NOISE`)."""
    prior = prior or ASSUMED_NOISE
    return noise_floor((step_reading_noise(r.metrics, metric) for r in records if r.status == "ok"), prior.noise)


def noise_prior_dof(floor: float, prior: NoisePrior | None) -> int:
    """The degrees of freedom behind ``floor`` where it is the host's measured noise (``prior``
    measured, and no reading's steps gave a floor of their own); 0 otherwise. The guide reads the
    same (``Guide.prior_dof``)."""
    return prior.dof if prior is not None and prior.measured and floor == prior.noise else 0


ESTIMATE_Z = 3.0  # a guide's estimate further than this from a config's readings does not describe them


def _control_key(ok: list[TrialRecord]) -> str | None:
    """The control config's key: the baseline, else the first measured (what the guide's drift checks
    measure again)."""
    first = next((r for r in ok if r.baseline), min(ok, key=lambda r: r.number) if ok else None)
    return config_key(first.config) if first is not None else None


def interference_readings(
    ok: list[TrialRecord],
    metric: str,
    direction: str,
    values: dict[int, float] | None = None,
    floor: float | None = None,
    prior: NoisePrior | None = None,
) -> set[int]:
    """The trial numbers whose reading of ``metric`` is set aside as interference
    (:mod:`autotune.objectives.interference`): of a config measured more than once, a reading worse
    than its best by more than the study's interference gap, as the guide reads them
    (``Guide.with_interference``). ``values``: trial number -> the reading to judge (drift-normalised
    ones), else the record's own; ``floor``: the study's :func:`study_noise_floor` where the caller
    has it. The control config is never read so: its readings span the study on purpose, and a
    slowdown of it is the drift check's to read (:func:`study_readings`)."""
    if not slowed_by_interference(metric):
        return set()
    control = _control_key(ok)
    groups: dict[str, list[TrialRecord]] = {}
    for r in ok:
        if _finite(r.metrics.get(metric)) and config_key(r.config) != control:
            groups.setdefault(config_key(r.config), []).append(r)
    rows = list(groups.values())
    read = (lambda r: values[r.number]) if values is not None else (lambda r: float(r.metrics[metric]))  # noqa: E731
    floor = floor if floor is not None else study_noise_floor(ok, metric, prior)
    verdicts = interference_flags([[read(r) for r in rs] for rs in rows], floor, direction == "maximize")
    return {r.number for rs, flags in zip(rows, verdicts) for r, flag in zip(rs, flags) if flag}


def measurement_noise(groups: Iterable[list[TrialRecord]], metric: str, prior: NoisePrior | None = None) -> float:
    """The relative noise of one reading of ``metric`` between runs: the pooled spread of the
    configs measured more than once (each reading over its config's mean), never below
    :func:`study_noise_floor` (a pair of readings says little), nor below :data:`DEFAULT_NOISE`
    while no config was measured twice (``prior``'s noise where the host's was measured)."""
    prior = prior or ASSUMED_NOISE
    groups = [list(rs) for rs in groups]
    floor = study_noise_floor((r for rs in groups for r in rs), metric, prior)
    return repeat_noise(([r.metrics.get(metric) for r in rs] for rs in groups), floor, prior.noise)


def beyond_noise(lead: TrialRecord, other: TrialRecord, metric: str, noise: float) -> bool:
    """Whether ``other``'s mean reading is further from ``lead``'s than the noise explains:
    more than :data:`SEPARATED_Z` standard errors of the difference of two means of
    ``measurements`` readings each, at ``noise`` relative per reading."""
    a, b = float(lead.metrics[metric]), float(other.metrics[metric])
    na, nb = int(lead.metrics.get("measurements", 1)), int(other.metrics.get("measurements", 1))
    return bool(a) and separated(a, na, b, nb, noise)


@dataclass
class StudyReadings:
    """Every measured config's readings of the objective as the certificate and the drift check
    read them (:func:`study_readings`)."""

    groups: dict[str, list[float]]  # config key -> readings in trial order (normalised under drift)
    numbers: dict[str, int]  # config key -> its latest trial
    noise: float  # relative, per reading, between runs
    control: str | None  # the control config's key (the baseline, else the first measured)
    drift: dict[str, Any] | None  # control_drift of the control's readings; None without a repeat of it
    normalised: bool  # readings divided by the control's drift (a drift beyond the noise was found)
    set_aside: list[int] = field(default_factory=list)  # trials whose reading is interference (not in groups)
    floor: float = (
        DEFAULT_NOISE  # the floor under ``noise`` (study_noise_floor: the readings' own steps, else the prior)
    )
    prior: NoisePrior = ASSUMED_NOISE  # the study's noise before its repeats: assumed, or measured on the host


def study_readings(
    records: list[TrialRecord], metric: str, direction: str = "maximize", prior: NoisePrior | None = None
) -> StudyReadings:
    """The study's readings of ``metric``, its noise and its drift (issue 44).

    The control config (the baseline, else the first measured: what the guide's drift checks
    measure again) is left out of the noise: its readings span the study by design. The noise is
    pooled over the other configs' readings normalised to the control (each divided by the control's
    latest reading at or before it over the control's first), so that a machine that slowed down
    does not pass for noise and hide its own drift. When the control moved beyond that noise
    (:func:`autotune.objectives.race.control_drift`) the readings are compared normalised (the
    control keeps its first reading); otherwise as measured, with the noise of the raw readings.
    Readings set aside as interference (:func:`interference_readings`, judged on the readings as
    compared) are in neither the groups nor the noise. ``prior``: the study's noise before its
    repeats (:data:`NOISE_PRIOR_ATTR`), else assumed."""
    prior = prior or ASSUMED_NOISE
    ok = sorted(
        measured_at_target_first(
            [
                r
                for r in records
                if r.status == "ok" and r.state == "COMPLETE" and r.probed and _finite(r.metrics.get(metric))
            ]
        ),
        key=lambda r: r.number,
    )
    control = _control_key(ok)
    checks = [(r.number, float(r.metrics[metric])) for r in ok if config_key(r.config) == control]
    raw_values: dict[int, float] = {}
    scaled_values: dict[int, float] = {}
    numbers: dict[str, int] = {}
    for r in ok:
        value = float(r.metrics[metric])
        raw_values[r.number] = value
        numbers[config_key(r.config)] = r.number
        seen = [v for n, v in checks if n <= r.number]
        factor = seen[-1] / checks[0][1] if seen and checks[0][1] else 1.0
        scaled_values[r.number] = value / factor if factor else value

    floor = study_noise_floor(ok, metric, prior)

    def grouped(values: dict[int, float]) -> tuple[dict[str, list[float]], list[int]]:
        aside = interference_readings(ok, metric, direction, values, floor, prior)
        groups: dict[str, list[float]] = {}
        for r in ok:
            if r.number not in aside:
                groups.setdefault(config_key(r.config), []).append(values[r.number])
        return groups, sorted(aside)

    others = lambda groups: [v for k, v in groups.items() if k != control]  # noqa: E731
    (raw, raw_aside), (scaled, scaled_aside) = grouped(raw_values), grouped(scaled_values)
    noise = repeat_noise(others(scaled), floor, prior.noise)
    drift = control_drift(checks, noise)
    if drift is not None and drift["beyond_noise"]:
        scaled[control] = [checks[0][1]]  # the control: its first reading (the scale the rest is brought to)
        return StudyReadings(scaled, numbers, noise, control, drift, True, scaled_aside, floor, prior)
    noise = repeat_noise(others(raw), floor, prior.noise)
    return StudyReadings(raw, numbers, noise, control, drift, False, raw_aside, floor, prior)


def best_certificate(
    records: list[TrialRecord],
    best: list[TrialRecord],
    objectives: list[tuple[str, str]],
    tolerance: float,
    confidence: float,
    priors: dict[str, tuple[float, float]] | None = None,
    noise_prior: NoisePrior | None = None,
) -> tuple[Certificate, StudyReadings] | None:
    """How sure the study is of its measured best (issue 44): its certificate among every measured
    config (:func:`autotune.objectives.race.certificate` over :func:`study_readings`), with the
    readings it rests on. ``priors``: the guide's leave-one-out prediction of each measured config
    (config key -> (mean, sd); ``Guide.measured_priors``), left out where the readings were
    normalised for a drift. None for several objectives, a predicted best, or a best without a
    reading."""
    if len(objectives) != 1 or not best or best[0].source == "simulated":
        return None
    metric, direction = objectives[0]
    readings = study_readings(records, metric, direction, noise_prior)
    leader = config_key(best[0].config)
    if leader not in readings.groups:
        return None
    # the noise the claim rests on: the repeats of every config but the drift control (its readings
    # span any drift), with the floor as one pair, or as the host's measured repeats (intervals.noise_belief)
    noise, dof = noise_belief(
        (v for k, v in readings.groups.items() if k != readings.control),
        readings.floor,
        noise_prior_dof(readings.floor, readings.prior),
    )
    # the model's predictions are of the readings as measured: not of readings normalised for a drift
    priors = None if readings.normalised else priors
    cert = certificate(readings.groups, leader, noise, tolerance, confidence, direction == "maximize", dof, priors)
    return cert, readings


def race_readings(readings: StudyReadings, drift_checks: bool = True) -> int:
    """Re-measurements past each config's first reading (what ``search.confirm_budget`` counts, as
    the guide's ``race_spent`` does): a reading set aside as interference was spent all the same. With
    drift checks on (``search.drift_every``) the control's readings are theirs and not counted
    (:func:`control_rereadings`); without them every re-reading of the control was the race's."""
    kept = sum(len(v) - 1 for k, v in readings.groups.items() if k != readings.control)
    if not drift_checks:
        kept += (control_rereadings(readings) or (0, 0))[1]
    return kept + len(readings.set_aside)


def control_rereadings(readings: StudyReadings) -> tuple[int, int] | None:
    """(the control config's first trial, its readings past that one): drift checks, and race
    readings where it led or threatened. Not charged to ``search.confirm_budget``
    (:func:`race_readings`), since its readings span the study for the drift check; the certificate's
    words count them apart, so that a trial named "re-measure (race)" is not missing from "the race
    re-measured N". Read from the drift check (every reading of the control, normalised or not);
    None where the control was read once."""
    drift = readings.drift
    if not drift:
        return None
    return int(drift["control_trial"]), int(drift["readings"]) - 1


def certificate_sentence(
    cert: Certificate,
    numbers: dict[str, int],
    remeasured: int,
    allowed: int | None,
    floor: float = DEFAULT_NOISE,
    prior: NoisePrior | None = None,
    control_again: tuple[int, int] | None = None,
) -> str:
    """The certificate in words, for the summary and the run's output (where no config was measured
    twice, the noise is the floor, and the words say so; ``floor``: :func:`study_noise_floor`, named
    where the readings' own steps gave it; ``prior``: the study's noise before its repeats, named where
    the host's was measured; ``control_again``: the control's first trial and its readings past it,
    :func:`control_rereadings`, named apart from the race's count)."""
    lead = numbers.get(cert.leader)
    once = "no config but the drift control was measured twice"
    if prior is not None and noise_prior_dof(floor, prior):
        assumed = (
            f" (from a prior of {floor:.1%} per reading, measured by {prior.source}, {prior.dof} degrees of freedom)"
        )
    elif floor != DEFAULT_NOISE:
        assumed = f" (from a prior of {floor:.2%}: the within-run spread of the probes' steps" + (
            ")" if cert.noise_measured else f"; {once})"
        )
    else:
        assumed = "" if cert.noise_measured else f" (assumed: {once})"
    model = (
        f"; each also as the guide's model predicts it from the others ({cert.model_informed} configs)"
        if cert.model_informed
        else ""
    )
    rest = (
        f"{cert.configs} measured configs ({cert.readings} readings, noise {cert.noise:.1%} per reading{assumed}"
        f"{model})"
    )
    race = f"; the race re-measured {remeasured}"
    if allowed and remeasured > allowed:
        # past the held-back re-measurements: the search would have stopped with budget left (Guide.propose)
        race += (
            f": {allowed} held back for it (search.confirm_budget), "
            f"{remeasured - allowed} from the budget the search would have left when it stopped"
        )
    elif allowed:
        race += f" of {allowed} allowed (search.confirm_budget)"
    if control_again and control_again[1]:
        trial, again = control_again
        race += (
            f", and the control config (trial {trial}, the first measured) {again} more time(s), not charged: "
            "its readings span the study for the drift check"
        )
    unmeasured = (
        ""
        if cert.p_unmeasured is None
        else f", and by the guide's model no config it did not measure beats it by more than {cert.tolerance:.0%} "
        f"with P {cert.p_unmeasured:.2f}: P {cert.p_overall:.2f} in all"
    )
    if cert.configs < 2 and cert.p_unmeasured is None:
        return f"how sure: trial {lead} is the only config measured ({cert.readings} readings): nothing to compare"
    claim = f"trial {lead} is within {cert.tolerance:.0%} of the best of {rest} with P {cert.p:.2f}{unmeasured}"
    if cert.certified:
        tied = ", ".join(f"trial {numbers.get(k)}" for k in cert.ties)
        ties = f"; tied with {tied} (the readings cannot order them; each is certified)" if tied else ""
        return f"how sure: {claim} (certified at {cert.confidence:.0%}){ties}{race}"
    words = f"how sure: NOT certified at {cert.confidence:.0%}: {claim}"
    if not cert.noise_measured and cert.p_overall >= cert.confidence:
        words += (
            f"{race}; that P rests on an assumed noise (no config was measured twice): measure the best "
            "configs again to certify it (search.confirm_budget)"
        )
    elif cert.threats and cert.threats[0][1] < cert.confidence:
        worst, pj = cert.threats[0]
        need = readings_to_tell(cert.noise, cert.tolerance, cert.confidence)
        words += (
            f"; trial {numbers.get(worst)} may beat it by more than {cert.tolerance:.0%} (P {1 - pj:.2f}){race}; at "
            f"this noise two equally fast configs need about {need} readings each to be told within "
            f"{cert.tolerance:.0%} (search.tie_tolerance, search.confirm_budget)"
        )
    else:
        words += f"{race}; the configs not measured are what it is unsure of: a larger search.n_trials"
    return words


def drift_sentence(found: dict[str, Any], metric: str) -> str:
    """The drift check's finding in words (:func:`StudyReadings.drift <study_readings>`)."""
    change, at = found["change"], found["at_trial"]
    if found["beyond_noise"]:
        return (
            f"drift: the control config (trial {found['control_trial']}) read {found['first']:.4g} {metric} first and "
            f"{found['value']:.4g} at trial {at} ({change:+.1%}, beyond the {found['limit']:.1%} the noise explains "
            f"over {found['readings']} readings): the machine changed during the study; the certificate compares "
            f"readings normalised to the control, and figures measured before and after trial {at} are not "
            "comparable as they stand: re-measure the contenders together"
        )
    return (
        f"no drift: the control config (trial {found['control_trial']}) measured {found['readings']} times, "
        f"at most {change:+.1%} from its first reading (the noise allows {found['limit']:.1%})"
    )


def _agrees(estimate: tuple[float, float, int] | None, record: TrialRecord, metric: str, noise: float) -> bool:
    """Whether the guide's estimate of a measured config is one its readings allow: within
    ``ESTIMATE_Z`` standard errors of their mean (a pooled estimate moves a reading by about the
    noise; a model off by a scale the refit has not caught moves it by far more)."""
    if estimate is None:
        return True
    mean, n = float(record.metrics[metric]), int(record.metrics.get("measurements", 1))
    return not mean or abs(estimate[0] - mean) / abs(mean) <= ESTIMATE_Z * noise / n**0.5


def is_tracked(record: TrialRecord) -> bool:
    """The one rule for what becomes an MLflow child run, on a first run and on every resume: a
    config that was probed, simulated or answered from the cache. Rule rejections and repeats are
    answered without a probe (they are counted on the parent run and listed by ``autotune
    report``), and an interrupted probe measured nothing (its config is probed again)."""
    return bool(record.probed) and record.status not in ("duplicate", "interrupted")


def frozen_trial(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial | None:
    """One trial by number through Optuna's public API, without deep-copying the study's trials
    (a study's trials are numbered 0, 1, ... in the order ``get_trials`` returns them)."""
    trials = study.get_trials(deepcopy=False)
    if 0 <= number < len(trials) and trials[number].number == number:
        return trials[number]
    return next((t for t in trials if t.number == number), None)


def trial_record(study: optuna.Study, number: int) -> TrialRecord:
    """The record of one trial."""
    return _record(frozen_trial(study, number))


def measured_configs(study: optuna.Study) -> dict[str, int]:
    """Canonical config -> the first trial that measured it. A config whose probe was interrupted, or
    failed under it on the infrastructure, is not measured: its re-queued trial must run, not be
    called a duplicate."""
    seen: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get(A.KEY)
        if key and t.user_attrs.get(A.PROBED) and t.user_attrs.get(A.STATUS) not in ("interrupted", "infra"):
            seen.setdefault(key, t.number)
    return seen


def save_trial_files(run_dir: Path, number: int, result: Any) -> None:
    """``trials/NNNN/result.json`` and ``log_tail.txt``: what the probe returned, kept beside the study
    (the MLflow child run's artifacts, and the evidence a resumed study checks its journal against)."""
    folder = run_dir / "trials" / f"{number:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    copy_requests_file(result, folder)
    (folder / "result.json").write_text(json.dumps(jsonable(result.to_json()), indent=1))
    if result.log_tail:
        (folder / "log_tail.txt").write_text(result.log_tail)


REQUESTS_FILE = "requests.jsonl"


def copy_requests_file(result: Any, folder: Path) -> None:
    """A serving probe's per-request records (``info["serving"]["requests_file"]``, written in the
    probe's own folder) kept as ``trials/NNNN/requests.jsonl``: the evidence every SLO verdict and
    percentile is recomputed from. The worker carries the text back in the result
    (``requests_jsonl``, :func:`autotune.workers.protocol.attach_requests_file`); it is written
    here and dropped from the result, whose ``requests_file`` then names the copy."""
    serving = (getattr(result, "info", None) or {}).get("serving") or {}
    text = serving.pop("requests_jsonl", None)  # carried back by the worker (protocol.attach_requests_file)
    if isinstance(text, str):
        (folder / REQUESTS_FILE).write_text(text)
        serving["requests_file"] = REQUESTS_FILE
        return
    source = serving.get("requests_file")
    if source and Path(source).is_file():
        shutil.copyfile(source, folder / REQUESTS_FILE)
        serving["requests_file"] = REQUESTS_FILE


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (numpy scalars as numbers, anything else as its text)."""
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
