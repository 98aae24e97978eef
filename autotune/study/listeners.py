"""What observes a study's finished trials: MLflow, the result cache, the model's refit, the guide.

The study loop (:mod:`autotune.study.search`) tells each listener, in order, that the study started and
that a trial finished (its record as stored, and the probe's result); none of them decides anything
about the trial. Like Optuna's callbacks, but with the start of the study too (a resumed study's
MLflow parent run, the refit of what it measured before).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import optuna

from autotune.workers.protocol import ProbeResult

from .records import TrialRecord, trial_records
from ..guide.refit import RIDGE_DATA_SHEET, RIDGE_MEASURED, Refit, fit_refit
from ..trial_attrs import A, RAN

__all__ = [
    "observer_phase",
    "SearchObserver",
    "StudyEnded",
    "TrialListener",
    "ResultCacheListener",
    "RefitListener",
    "GuideEstimatesListener",
]

log = logging.getLogger(__name__)


class SearchObserver(Protocol):
    """What the loop tells the user interface (a rich progress bar in the CLI, nothing in tests)."""

    def on_start(self, budget: int, done: int) -> None: ...
    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None: ...
    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None: ...
    def on_message(self, text: str) -> None: ...
    def phase(self, text: str) -> ContextManager[Any]:
        """A step the user waits on (ranking the space): announced, and kept moving while it runs."""
        ...


def observer_phase(observer: Any, text: str) -> ContextManager[Any]:
    """``observer.phase(text)``, or a plain message for an observer written before phases."""
    if hasattr(observer, "phase"):
        return observer.phase(text)
    observer.on_message(text)
    return contextlib.nullcontext()


class _Quiet:
    def on_start(self, budget: int, done: int) -> None: ...
    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None: ...
    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None: ...
    def on_message(self, text: str) -> None:
        log.info(text)

    def phase(self, text: str) -> ContextManager[Any]:
        log.info(text)
        return contextlib.nullcontext()


@dataclass(frozen=True)
class StudyEnded:
    """What the end of a study hands its listeners, once its files are written
    (:func:`autotune.finish.study_end.finish_study`)."""

    result: Any  # the study's result, read once (:class:`autotune.study.result.StudyResult`)
    probes_run: float  # full-probe equivalents spent, this run and before
    stopped_because: str  # why the loop stopped (:mod:`autotune.study.stop_conditions`)
    improvement: str | None  # the one line of best against baseline, None without a baseline
    summary_metrics: dict[str, float] = field(default_factory=dict)  # the summary's figures
    files: list[Path] = field(default_factory=list)  # results.csv, summary.json, summary.md
    exports: dict[str, Path] = field(default_factory=dict)  # format -> the file written
    plots: list[Path] = field(default_factory=list)  # the study's plots


class TrialListener:
    """The listener contract: every hook optional, each called the same way for every listener, in
    the order the loop was given them (MLflow, the refit, then the cache and the guide's estimates).
    The loop imports no listener's module: the assembly builds them (``autotune.cli.assembly``)."""

    def study_started(self, study: optuna.Study, ranking: Any = None) -> None:
        """The study is open and its plan queued; nothing has been probed in this run yet. ``ranking``:
        the model's ranking of the space (:class:`autotune.guide.ranking.Ranking`), None without one."""

    def probe_returned(self, number: int, config: dict[str, Any], result: ProbeResult) -> None:
        """A real probe's raw result, before the study interprets it (what another study would see)."""

    def trial_finished(self, study: optuna.Study, record: TrialRecord, result: ProbeResult | None) -> None:
        """``record`` is the trial as stored (told to Optuna); ``result`` what the probe returned."""

    def refit_changed(self, refit: Refit) -> None:
        """The model's refit (:mod:`autotune.guide.refit`) changed after a measured trial."""

    def search_ended(self, study: optuna.Study) -> None:
        """The loop probes no more (its budget, a stop condition or the user's interrupt): the last
        word on the trials before the study's result is read from them."""

    def study_finished(self, ended: StudyEnded) -> None:
        """The study ended and its files are written (called by the finish stage, once, after the
        loop: MLflow's parent run takes the result, the summary, the files, exports and plots)."""


class ResultCacheListener(TrialListener):
    """Keeps every real probe's result across studies (:mod:`autotune.study.cache`), keyed by the config
    and everything else that decides a measurement (model, workload, cluster, backend, software)."""

    def __init__(self, cache: Any, key_of: Callable[[dict[str, Any]], str], study_name: str):
        self.cache = cache
        self.key_of = key_of
        self.study_name = study_name

    def probe_returned(self, number: int, config: dict[str, Any], result: ProbeResult) -> None:
        """The raw result, before the study interprets it (what another study would have seen)."""
        if "cached_from" in result.info:
            return
        try:
            self.cache.put(self.key_of(config), result, self.study_name, number)
        except Exception as exc:  # the cache saves time; losing a write costs a probe later, not data
            log.warning("could not write the result cache %s: %s", self.cache.path, exc)


class RefitListener(TrialListener):
    """Refits the model's per-group factors (:mod:`autotune.guide.refit`) from every measured trial, so
    the predictions kept beside later probes carry ``refit_*`` values; says so when the fit moves."""

    def __init__(
        self, calibrated: bool, on_moved: Callable[[Refit, int], None], on_refit: Callable[[Refit], None] | None = None
    ):
        self.ridge = RIDGE_MEASURED if calibrated else RIDGE_DATA_SHEET  # a measured profile is trusted more
        self.on_moved = on_moved
        self.on_refit = on_refit
        self.refit = Refit()  # identity until a probe is measured
        self._shown: Refit | None = None

    def study_started(self, study: optuna.Study, ranking: Any = None) -> None:
        self._fit(study, after=None)  # a resumed study starts from the fit of what it measured before

    def trial_finished(self, study: optuna.Study, record: TrialRecord, result: ProbeResult | None) -> None:
        if record.status == "ok" and record.source == "measured" and record.predicted:
            self._fit(study, after=record.number)

    def _fit(self, study: optuna.Study, after: int | None) -> None:
        pairs = [
            (r.predicted, r.metrics.get("step_time_s"), r.metrics.get("comm_time_s"))
            for r in trial_records(study)
            if r.status == "ok" and r.source == "measured" and r.probed
        ]
        refit = fit_refit(pairs, ridge=self.ridge)
        if refit.n == self.refit.n:
            return
        shown = self._shown
        moved = shown is None or any(abs(refit.factors[g] / shown.factors[g] - 1) > 0.10 for g in refit.factors)
        self.refit = refit
        if after is not None and self.on_refit is not None:
            self.on_refit(refit)
        if after is not None and moved:  # a line when the fit moves, not one per trial
            self._shown = refit
            self.on_moved(refit, after)


class GuideEstimatesListener(TrialListener):
    """Keeps the guide's pooled estimate of every measured config on the study, from which the
    best is reported (:func:`autotune.study.records.best_records`), and, once the search ends, its
    claim over the configs it did not measure (the certificate's other part): the claim takes joint
    draws of the model over the space, which after every trial cost the orchestration a third of
    its time per trial (``benchmarks/orchestration_overhead.py``), and only the end reads it."""

    def __init__(self, guide: Any):
        self.guide = guide

    def trial_finished(self, study: optuna.Study, record: TrialRecord, result: ProbeResult | None) -> None:
        if record.status in RAN:
            estimates = self.guide.estimates(study.get_trials(deepcopy=False))
            study.set_user_attr(
                A.GUIDE_ESTIMATES, {k: [round(m, 6), round(s, 6), n] for k, (m, s, n) in estimates.items()}
            )

    def search_ended(self, study: optuna.Study) -> None:
        claims, priors = self.guide.claims(study.get_trials(deepcopy=False))
        if claims:  # the part of the certificate the readings cannot speak for (issue 44)
            study.set_user_attr(A.GUIDE_UNMEASURED, {k: round(p, 6) for k, p in claims.items()})
        if priors:  # what the model predicts of each measured config from the others (issue 44)
            study.set_user_attr(A.GUIDE_PRIORS, {k: [round(m, 6), round(sd, 6)] for k, (m, sd) in priors.items()})
