"""What a study writes to MLflow, authored in this one module.

The parent run (what was tuned, on what, how; at the end the best and recommended configs, the
summary, exports and plots), one child run per tracked trial (:func:`~autotune.records.is_tracked`),
the refit's factors as they move, and the reconciliation that makes MLflow hold exactly the tracked
trials of Optuna storage after any crash. :class:`~autotune.tracking.Tracker` is the writer (batched,
retried, names made valid); this module decides what is written. The study loop notifies it of
each finished trial as one of its listeners (:mod:`autotune.listeners`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.workers.protocol import ProbeResult

from .backends import BackendChoice
from .listeners import TrialListener
from .ranking import Ranking
from .records import TrialRecord, is_tracked, trial_record
from .sanity import is_finite_number as _finite
from .records import REQUESTS_FILE
from .secret_env import SPEC_COPY, write_spec_copy
from .serving_plots import PLOT_NAME, latency_vs_rate_plot
from .spec import Spec
from .trial_attrs import A
from .tracking import TERMINAL_STATUSES, error_line

__all__ = ["StudyTracking"]

log = logging.getLogger(__name__)


class StudyTracking(TrialListener):
    """The study's MLflow content, written through ``tracker``."""

    def __init__(
        self, tracker: Any, spec: Spec, backend: BackendChoice, run_dir: Path, *, parallel: int, space_size: int
    ):
        self.tracker = tracker
        self.spec = spec
        self.backend = backend
        self.run_dir = run_dir
        self.parallel = parallel
        self.space_size = space_size
        self.objectives = spec.objective_list()

    @property
    def parent_run_id(self) -> str | None:
        return self.tracker.parent_run_id

    def log_refit(self, refit: Any) -> None:
        """The model's refit factors, as a step of the parent run's metrics."""
        self.tracker.log_parent(metrics=refit.as_metrics(), step=refit.n)

    def start(self, study: optuna.Study, ranking: Ranking | None) -> None:
        """Open (or resume) the study's parent run: what was tuned, on what, how."""
        previous = study.user_attrs.get("autotune.parent_run_id")
        params = {
            "model": self.spec.model.name,
            "workload": self.spec.workload.kind,
            "world_size": self.spec.cluster.world_size,
            "accelerator": self.spec.cluster.accelerator,
            "hardware_profile": self.spec.cluster.profile_name,
            "backend": self.backend.kind,
            "sampler": self.spec.search.sampler,
            "n_trials": self.spec.search.n_trials,
            "parallel_trials": self.parallel,
            "objectives": ",".join(f"{m}:{d}" for m, d in self.objectives),
            "space_size": self.space_size,
        }
        params.update(serving_params(self.spec))
        tags = {
            "autotune.study": self.spec.name,
            "autotune.backend": self.backend.kind,
            "autotune.source": "simulated" if self.backend.simulated else "measured",
            "autotune.backend_reason": self.backend.reason,
        }
        if self.parallel != self.spec.search.parallel_trials:  # the effective setting, and why
            tags["autotune.parallel_trials_note"] = (
                f"parallel_trials {self.parallel}, the spec says {self.spec.search.parallel_trials}: "
                "simulated trials are predictions, computed one after another in the driver"
            )
        run_id = self.tracker.start_parent(self.spec.name, params, tags, resume_run_id=previous)
        study.set_user_attr("autotune.parent_run_id", run_id)
        if self.spec.source_path:  # the copy the run directory keeps, secrets masked
            copy = self.run_dir / SPEC_COPY
            if not copy.exists():
                write_spec_copy(self.spec.source_path, self.run_dir)
            self.tracker.log_parent(artifacts=[copy], artifact_path="spec")
        if ranking is not None:
            self.tracker.log_parent(
                metrics={"space_valid": ranking.enumeration.valid, "space_fit_predicted": ranking.fit},
                artifacts=[self.run_dir / "ranking.csv"],
            )

    def reconcile(self, study: optuna.Study) -> None:
        """Make MLflow hold exactly the tracked trials of Optuna storage (:func:`is_tracked`).

        A trial finished in Optuna but missing in MLflow (the run was killed between the two
        writes, or the server was down) is logged now; a child left ``RUNNING`` (a write broken
        half-way) is not complete, so it is deleted and the trial logged again; a second child of
        one trial is deleted. Nothing measured is lost, and a re-run of a finished study changes
        nothing in MLflow."""
        # MLflow itself says which trials it holds: a finished Optuna trial cannot take a user
        # attribute any more, so the child run's ``autotune.trial`` tag is the record of it.
        try:
            children = self.tracker.child_runs()
        except Exception as exc:  # the server went away since the start: the next run reconciles
            log.warning(
                "could not read MLflow's child runs (%s); the trials MLflow lacks are logged by the next run",
                error_line(exc),
            )
            return
        logged: set[int] = set()
        for run in sorted(children, key=lambda r: r.info.status not in TERMINAL_STATUSES):
            number = run.data.tags.get("autotune.trial", "")
            if not number.isdigit():
                continue
            if run.info.status in TERMINAL_STATUSES and int(number) not in logged:
                logged.add(int(number))
            else:  # half-written, or a second child of the same trial
                self.tracker.delete_run(run.info.run_id)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            if t.number in logged or A.STATUS not in t.user_attrs:
                continue
            record = trial_record(study, t.number)
            if not is_tracked(record):
                continue
            path = self.run_dir / "trials" / f"{t.number:04d}" / "result.json"
            result = ProbeResult.from_json(json.loads(path.read_text())) if path.exists() else None
            self.trial_finished(study, record, result)

    def trial_finished(self, study: optuna.Study, record: TrialRecord, result: ProbeResult | None) -> None:
        """The trial's child run: its config as params, its metrics and the model's prediction, why
        it was chosen and how it ended as tags, its result files as artifacts."""
        if not is_tracked(record):
            return
        metrics = {k: v for k, v in record.metrics.items() if _finite(v)}
        for k, v in record.predicted.items():
            if _finite(v):
                metrics[f"predicted_{k}"] = v
        first = self.objectives[0][0]
        measured = record.metrics.get(first)
        for prefix in ("", "refit_"):
            predicted = record.predicted.get(prefix + first)
            if _finite(predicted) and _finite(measured) and measured:
                metrics[f"{prefix}prediction_error_pct"] = 100.0 * (predicted - measured) / abs(measured)
        tags = {
            "autotune.status": record.status,
            "autotune.source": record.source or "rules",
            "autotune.backend": self.backend.kind,
            "autotune.chosen_because": record.chosen_because,
            "autotune.optuna_state": record.state,
        }
        if record.reason:
            tags["autotune.failure_reason"] = record.reason
        if record.baseline:
            tags["autotune.baseline"] = "true"
        folder = self.run_dir / "trials" / f"{record.number:04d}"
        artifacts = [folder / n for n in ("result.json", "log_tail.txt", REQUESTS_FILE)]
        serving = (result.info.get("serving") if result is not None else None) or {}
        if serving.get("rates"):
            tags.update(serving_tags(serving))
            plot = latency_vs_rate_plot(serving["rates"], serving.get("slo") or {}, folder / PLOT_NAME)
            if plot is not None:
                artifacts.append(plot)
        self.tracker.log_trial(
            record.number,
            record.config,
            metrics,
            tags,
            steps=result.steps if result else None,
            artifacts=artifacts,
            failed=record.status not in ("ok", "pruned"),
        )

    def finish(
        self,
        result: Any,
        *,
        probes_run: int,
        stopped_because: str,
        improvement: str | None,
        summary_metrics: dict[str, float],
        files: list[Path],
        exports: dict[str, Path],
        plots: list[Path],
    ) -> None:
        """The parent run's closing content: the best, baseline and recommended configs, the
        summary figures, the result files, exports and plots."""
        best = result.best[0] if result.best else None
        recommendation = result.recommendation
        metrics: dict[str, float] = {"probes": probes_run, **summary_metrics}
        if best is not None:
            for m, _ in self.objectives:
                if isinstance(best.metrics.get(m), (int, float)):
                    metrics[f"best_{m}"] = best.metrics[m]
        if result.baseline is not None:
            for m, _ in self.objectives:
                if isinstance(result.baseline.metrics.get(m), (int, float)):
                    metrics[f"baseline_{m}"] = result.baseline.metrics[m]
        tags = {"autotune.stopped_because": stopped_because}
        if improvement:
            tags["autotune.improvement"] = improvement
        if best is not None:
            tags["autotune.best_trial"] = str(best.number)
        params = {f"best.{k}": v for k, v in best.config.items()} if best is not None else {}
        if recommendation is not None:
            tags["autotune.recommended_trial"] = str(recommendation.chosen.number)
            if recommendation.sentence:
                tags["autotune.recommendation"] = recommendation.sentence
            if recommendation.changed:
                params.update({f"recommended.{k}": v for k, v in recommendation.chosen.config.items()})
        self.tracker.log_parent(metrics=metrics, tags=tags, params=params, artifacts=files)
        self.tracker.log_parent(artifacts=list(exports.values()), artifact_path="export")
        self.tracker.log_parent(artifacts=plots, artifact_path="plots")

    def close(self, status: str) -> list[str]:
        """Close the parent run (``FINISHED``, ``KILLED``, ``FAILED``); the warnings the user must see: a
        tracking server that is down costs at most the tracker's drain timeout here, and the user
        learns how the missing runs get written."""
        warnings = []
        left = self.tracker.finish_parent(status)
        if left:
            warnings.append(
                f"MLflow at {self.tracker.tracking_uri} stopped taking writes: {left} not done; every "
                "trial is in the Optuna storage: run the same command again once it answers, and the "
                "missing runs are logged (nothing is probed again)"
            )
        warnings += [f"MLflow refused {failure}" for failure in self.tracker.failed_writes[:5]]
        return warnings


def serving_params(spec: Spec) -> dict[str, Any]:
    """A serving study's SLO and traffic, as parent-run params (empty for other workloads)."""
    w = spec.workload
    if w.kind != "serve":
        return {}
    out: dict[str, Any] = {f"slo.{k}": v for k, v in w.slo.model_dump().items() if v is not None}
    t = w.traffic
    prompt, output = t.mean()
    out.update(
        {
            "traffic.rates": ",".join(f"{r:g}" for r in t.rates),
            "traffic.arrival": t.arrival if t.arrival == "poisson" else f"gamma(shape {t.burstiness:g})",
            "traffic.prompt_len_mean": round(prompt, 1),
            "traffic.output_len_mean": round(output, 1),
            "traffic.shared_prefix": t.shared_prefix,
            "traffic.duration_s": t.duration_s,
        }
    )
    return out


def serving_tags(serving: dict[str, Any]) -> dict[str, str]:
    """A serving trial's rates tried (in the order tried, with the verdict) and its operating rate."""
    tried = " ".join(f"{r.get('rate'):g}:{'met' if r.get('slo_met') else 'missed'}" for r in serving["rates"])
    tags = {"autotune.serving.rates_tried": tried}
    if serving.get("operating_rate") is not None:
        tags["autotune.serving.operating_rate"] = f"{serving['operating_rate']:g}"
    if serving.get("slo"):
        tags["autotune.serving.slo"] = ", ".join(f"{k} {v:g}" for k, v in serving["slo"].items() if v is not None)
    return tags
