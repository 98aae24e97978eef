"""What a study has found, read once: its trials, the best, the baseline and the recommendation.

``report``, ``export``, the end of ``run`` and the MLflow parent run all need the same four
things and must agree on them: a study's best is one rule (:func:`~autotune.study.records.best_records`,
with the guide's pooled estimates where it steered), its recommendation another
(:mod:`autotune.study.recommend`). They are derived here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import optuna

from ..guide.ranking import Ranking
from ..objectives.intervals import between_runs_interval
from .recommend import Recommendation, study_recommendation
from .records import (
    TrialRecord,
    best_certificate,
    best_records,
    certificate_sentence,
    control_rereadings,
    drift_sentence,
    guide_estimates,
    noise_prior_dof,
    noise_prior_of,
    race_readings,
    study_readings,
    trial_records,
)
from ..sanity import is_finite_number as _finite
from ..settings import Objectives
from ..trial_attrs import A
from ..spec.schema import Spec
from ..spec.space import config_key

__all__ = ["StudyResult", "StudyOutcome"]

MAX_RATE = "max_rate_rps"  # a serving probe's highest rate meeting the SLO (workers/serve_probe)


@dataclass
class StudyResult:
    """A study's records and what follows from them (``best``: one record, or a Pareto front)."""

    records: list[TrialRecord]
    best: list[TrialRecord]
    baseline: TrialRecord | None
    recommendation: Recommendation | None
    # how sure the study is of its measured best (issue 44): the certificate's figures, the trials it
    # names, its sentence; None for a predicted best or several objectives
    certificate: dict[str, Any] | None = None
    # the control config's readings over the study (records.study_drift), where it was measured again
    drift: dict[str, Any] | None = None

    @classmethod
    def load(cls, spec: Spec, study: optuna.Study, objectives: Objectives | None = None) -> "StudyResult":
        """``objectives``: the spec's, resolved, when the caller has them (else resolved here)."""
        from ..spec.resolve import objectives_of

        objectives = objectives if objectives is not None else objectives_of(spec)
        records = trial_records(study)
        prior = noise_prior_of(study)  # the noise the guide took before any repeat: assumed, or the host's
        best = best_records(records, objectives, guide_estimates(study), prior)
        baseline = next((r for r in records if r.baseline and r.status == "ok"), None)
        priors = {k: (float(v[0]), float(v[1])) for k, v in (study.user_attrs.get(A.GUIDE_PRIORS) or {}).items()}
        certified = best_certificate(
            records, best, objectives, spec.search.tie_tolerance, spec.search.confidence, priors or None, prior
        )
        ties: list[TrialRecord] = []
        summary = None
        if certified is not None:
            cert, readings = certified
            claim = (study.user_attrs.get(A.GUIDE_UNMEASURED) or {}).get(cert.leader)
            if _finite(claim):
                cert.with_unmeasured(float(claim))  # the guide's word on the configs not measured
            numbers = readings.numbers
            ties = [r for r in records if any(r.number == numbers[k] for k in cert.ties)]
            drift_checks = spec.search.drift_checks_every() > 0  # else the control's re-readings were the race's
            remeasured = race_readings(readings, drift_checks)
            control_again = control_rereadings(readings) if drift_checks else None
            summary = {
                **cert.to_json(),
                "best_trial": numbers[cert.leader],
                "ties": [numbers[k] for k in cert.ties],
                "threats": [{"trial": numbers[k], "p_within": round(p, 4)} for k, p in cert.threats[:3]],
                "remeasured": remeasured,
                "set_aside_as_interference": readings.set_aside,
                "confirm_readings": spec.search.confirm_readings(),
                "normalised_to_control": readings.normalised,
                # the floor under the noise: the readings' own steps, the host's measured noise, else the
                # guide's assumption
                "noise_floor": round(readings.floor, 4),
                "noise_floor_from": _floor_from(readings.floor, prior),
                "control_remeasured": (control_again or (0, 0))[1],
                "sentence": certificate_sentence(
                    cert, numbers, remeasured, spec.search.confirm_readings(), readings.floor, prior, control_again
                ),
                "between_runs": _between_runs(
                    objectives[0][0],
                    readings.groups[cert.leader],
                    cert,
                    prior if noise_prior_dof(readings.floor, prior) else None,
                ),
            }
            # a serving best's max rate between runs too, at the same relative noise: at the operating
            # point the goodput is the max rate times its good share, and a run that serves slower
            # moves both (issue 44: "goodput and max rate are reported with intervals")
            rates = [
                float(r.metrics[MAX_RATE])
                for r in records
                if r.status == "ok"
                and r.probed
                and config_key(r.config) == cert.leader
                and _finite(r.metrics.get(MAX_RATE))
            ]
            if objectives[0][0] != MAX_RATE and rates and summary["between_runs"] is not None:
                summary["between_runs_max_rate"] = _between_runs(
                    MAX_RATE, rates, cert, prior if noise_prior_dof(readings.floor, prior) else None
                )
        recommendation = study_recommendation(spec, records, best, objectives, ties=ties)
        measured = bool(best) and best[0].source != "simulated"
        drift = None
        if measured:
            found = study_readings(records, *objectives[0], prior).drift
            if found is not None:
                drift = {**found, "sentence": drift_sentence(found, objectives[0][0])}
        return cls(records, best, baseline, recommendation, summary, drift)

    @property
    def chosen(self) -> TrialRecord | None:
        """The config the study recommends (and exports): the recommendation, else the best."""
        if self.recommendation is not None:
            return self.recommendation.chosen
        return self.best[0] if self.best else None

    def record(self, number: int) -> TrialRecord | None:
        return next((r for r in self.records if r.number == number), None)


@dataclass
class StudyOutcome:
    """What one run of the search loop ended with (:meth:`autotune.study.search.StudyRunner.run`)."""

    study: optuna.Study
    result: StudyResult
    ranking: Ranking | None
    probes_run: float
    stopped_because: str
    parent_run_id: str | None = None
    infra_failure: str | None = None  # the study stopped because the infrastructure failed (exit 3)

    @property
    def records(self) -> list[TrialRecord]:
        return self.result.records

    @property
    def best(self) -> list[TrialRecord]:
        return self.result.best

    @property
    def baseline(self) -> TrialRecord | None:
        return self.result.baseline


def _floor_from(floor: float, prior: Any) -> str:
    """Where the floor under the study's noise came from: ``host`` (``autotune calibrate --serving``'s
    repeated probes, :data:`~autotune.study.records.NOISE_PRIOR_ATTR`), ``steps`` (the readings' own
    within-run spread) or ``assumed`` (the guide's default)."""
    if noise_prior_dof(floor, prior):
        return "host"
    return "steps" if floor != prior.noise else "assumed"


def _between_runs(metric: str, values: list[float], cert: Any, prior: Any = None) -> dict[str, Any] | None:
    """The best's figure between runs (issue 44): the interval of its true mean at the study's
    measured noise (:func:`autotune.objectives.intervals.between_runs_interval`); None where neither a
    repeat nor the host's probes (``prior``, where the noise rests on it) measured the noise (the
    certificate says so)."""
    interval = between_runs_interval(values, cert.noise, cert.noise_dof, cert.confidence)
    if interval is None:
        return None
    return {
        "metric": metric,
        "low": interval[0],
        "high": interval[1],
        "readings": len(values),
        "noise": round(cert.noise, 4),
        "noise_dof": cert.noise_dof,
        "confidence": cert.confidence,
        # what measured the noise: the study's repeats, with the host's probes where calibrate measured them
        "noise_from": "its repeats"
        if prior is None or not prior.measured
        else f"{prior.source} ({prior.dof} degrees of freedom)"
        + (f" and its repeats ({cert.noise_dof - prior.dof})" if (cert.noise_dof or 0) > prior.dof else ""),
    }
