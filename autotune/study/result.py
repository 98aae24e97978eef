"""What a study has found, read once: its trials, the best, the baseline and the recommendation.

``report``, ``export``, the end of ``run`` and the MLflow parent run all need the same four
things and must agree on them: a study's best is one rule (:func:`~autotune.study.records.best_records`,
with the guide's pooled estimates where it steered), its recommendation another
(:mod:`autotune.study.recommend`). They are derived here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
import optuna

from ..guide.ranking import Ranking
from .recommend import Recommendation, study_recommendation
from .records import TrialRecord, best_records, guide_estimates, trial_records
from ..settings import Objectives
from ..spec.schema import Spec

__all__ = ["StudyResult", "StudyOutcome"]


@dataclass
class StudyResult:
    """A study's records and what follows from them (``best``: one record, or a Pareto front)."""

    records: list[TrialRecord]
    best: list[TrialRecord]
    baseline: TrialRecord | None
    recommendation: Recommendation | None

    @classmethod
    def load(cls, spec: Spec, study: optuna.Study, objectives: Objectives | None = None) -> "StudyResult":
        """``objectives``: the spec's, resolved, when the caller has them (else resolved here)."""
        from ..spec.resolve import objectives_of

        objectives = objectives if objectives is not None else objectives_of(spec)
        records = trial_records(study)
        best = best_records(records, objectives, guide_estimates(study))
        baseline = next((r for r in records if r.baseline and r.status == "ok"), None)
        return cls(records, best, baseline, study_recommendation(spec, records, best, objectives))

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
