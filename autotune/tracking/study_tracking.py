"""What a study writes to MLflow, authored in this one module.

The parent run (what was tuned, on what, how; at the end the best and recommended configs, the
summary, exports and plots), one child run per tracked trial (:func:`~autotune.study.records.is_tracked`),
the refit's factors as they move, and the reconciliation that makes MLflow hold exactly the tracked
trials of Optuna storage after any crash. :class:`~autotune.tracking.tracker.Tracker` is the writer (batched,
retried, names made valid); this module decides what is written. The study loop notifies it of
each finished trial as one of its listeners (:mod:`autotune.study.listeners`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import optuna
from optuna.trial import TrialState

from autotune.objectives.intervals import ci_keys
from autotune.workers.protocol import ProbeResult

from ..dispatch.backends import BackendChoice
from ..study.listeners import StudyEnded, TrialListener
from ..guide.ranking import Ranking
from ..study.records import TrialRecord, is_tracked, trial_record
from ..sanity import is_finite_number as _finite
from ..study.records import REQUESTS_FILE
from ..spec.secret_env import SPEC_COPY, write_spec_copy
from .serving_plots import PLOT_NAME, latency_vs_rate_plot
from ..settings import Objectives
from ..spec.schema import Spec
from ..spec.resolve import objectives_of
from ..trial_attrs import A, RAN
from .tracker import NOTE_TAG, TERMINAL_STATUSES, error_line, mlflow_key

__all__ = ["StudyTracking"]

log = logging.getLogger(__name__)


class StudyTracking(TrialListener):
    """The study's MLflow content, written through ``tracker`` (``objectives``: the spec's,
    resolved, when the assembly has them)."""

    def __init__(
        self,
        tracker: Any,
        spec: Spec,
        backend: BackendChoice,
        run_dir: Path,
        *,
        parallel: int,
        space_size: int,
        objectives: Objectives | None = None,
    ):
        self.tracker = tracker
        self.spec = spec
        self.backend = backend
        self.run_dir = run_dir
        self.parallel = parallel
        self.space_size = space_size
        self.objectives = objectives if objectives is not None else objectives_of(spec)

    @property
    def parent_run_id(self) -> str | None:
        return self.tracker.parent_run_id

    def study_started(self, study: optuna.Study, ranking: Ranking | None = None) -> None:
        """Open (or resume) the parent run, then make MLflow hold exactly the tracked trials."""
        self.start(study, ranking)
        self.reconcile(study)

    def refit_changed(self, refit: Any) -> None:
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
        self._describe(run_id)
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

    # ---- what a user reads in MLflow's UI ---------------------------------------------------------
    def searched(self) -> dict[str, list[Any]]:
        """The searched params (several values) with their values, in the spec's order."""
        return self.spec.space.searched() or self.spec.space.choices()

    def _what(self) -> list[str]:
        spec, backend = self.spec, self.backend
        c = spec.cluster
        source = (
            "simulated: the figures are the model's predictions, not measurements"
            if backend.simulated
            else "measured on the cluster"
        )
        goals = ", ".join(f"{d} {m}" for m, d in self.objectives)
        space = "; ".join(f"{k} {'|'.join(str(v) for v in vals)}" for k, vals in self.searched().items())
        return [
            f"**autotune study `{spec.name}`**: {_KIND.get(spec.workload.kind, spec.workload.kind)} of "
            f"{spec.model.name} on {c.world_size} x "
            f"{c.accelerator} ({c.profile_name}), backend {backend.kind} ({source}).",
            "",
            f"- Objective{'s' if len(self.objectives) > 1 else ''}: {goals}.",
            f"- Searched ({self.space_size:,} combinations, sampler {spec.search.sampler}, "
            f"{spec.search.n_trials} trials): {space}.",
            "- One child run per trial (`trial-NNNN`): its config as params, its metrics, why it was chosen "
            "and how it ended as tags. `autotune ui RUN_DIR` opens them sorted by the objective.",
        ]

    def _describe(self, run_id: str) -> None:
        """The parent run's and the experiment's descriptions, and the study's view of the runs
        table (:func:`autotune.tracking.mlflow_ui.study_view_state`): what a user sees first in the UI."""
        from .mlflow_ui import VIEW_KEY, VIEW_TAG, WORKFLOW, run_ui_path, study_view_state

        what = self._what()
        self.tracker.log_parent(tags={NOTE_TAG: "\n".join(what)})
        second = None
        if (
            len(self.objectives) == 1
            and self.objectives[0][0] != "peak_memory_gib"
            and self.spec.workload.kind == "train"
        ):
            second = "peak_memory_gib"  # speed against memory: what the front of the report weighs
        view = study_view_state(
            self.objectives,
            [mlflow_key(k) for k in self.searched()],
            second_axis=second,
            workload=self.spec.workload.kind,
            priced=self.spec.cluster.cost_per_device_hour is not None,
        )
        # the links carry the layout: MLflow's UI takes it from the page's URL (or the browser's
        # last switch), never from the experiment
        experiment = self.tracker.experiment_id
        table = f"#/experiments/{experiment}/runs?{urlencode({**WORKFLOW, 'viewStateShareKey': VIEW_KEY})}"
        parent = f"#{run_ui_path(experiment, run_id)}"
        experiment_note = "\n".join(
            [
                *what[:3],
                "",
                f"- **The trials, sorted by the objective** (this study's parent run last): run `autotune ui RUN_DIR`, "
                f"or open [this link]({table}) (MLflow shows it as a shared view).",
                f"- **The study's parent run** (description, plots, exports): [{run_id}]({parent}).",
            ]
        )
        self.tracker.set_experiment_tags({NOTE_TAG: experiment_note, VIEW_TAG: json.dumps(view)})

    def _outcome(self, result: Any, improvement: str | None, stopped_because: str) -> list[str]:
        """The parent's description at the end: the best and recommended configs in words."""
        lines = ["", f"**Outcome** ({stopped_because}):"]
        searched = self.searched()
        fronts = result.best or []
        for i, best in enumerate(fronts[:5]):
            label = "Best" if len(fronts) == 1 else f"On the front ({i + 1} of {len(fronts)})"
            lines.append(
                f"- {label}: trial {best.number}, {_figures(best, self.objectives)}: {_config(best.config, searched)}."
            )
        if improvement:
            lines.append(f"- Against the baseline: {improvement}.")
        recommendation = result.recommendation
        if recommendation is not None:
            chosen = recommendation.chosen
            if recommendation.changed:
                lines.append(
                    f"- Recommended: trial {chosen.number}, {_figures(chosen, self.objectives)}: "
                    f"{_config(chosen.config, searched)}."
                )
            else:
                lines.append(f"- Recommended: the best, trial {chosen.number}.")
            if recommendation.sentence:
                lines.append(f"  {recommendation.sentence}")
        if not fronts:
            lines.append("- No trial succeeded: `autotune report` lists the failure reasons.")
        return lines

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
        # a simulated trial's figures are the model's own: beside them its prediction is the same
        # number, and an error of 0 % would read as the model checked against a probe
        if record.source != "simulated":
            metrics.update(self._prediction_beside(record))
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
            failed=record.status not in RAN,
        )

    def _prediction_beside(self, record: TrialRecord) -> dict[str, float]:
        """A measured trial's prediction (``predicted_*``) and how far the first objective's missed
        its measurement (``prediction_error_pct``, and ``refit_`` for the refitted model's)."""
        out = {f"predicted_{k}": v for k, v in record.predicted.items() if _finite(v)}
        first = self.objectives[0][0]
        measured = record.metrics.get(first)
        for prefix in ("", "refit_"):
            predicted = record.predicted.get(prefix + first)
            if _finite(predicted) and _finite(measured) and measured:
                out[f"{prefix}prediction_error_pct"] = 100.0 * (predicted - measured) / abs(measured)
        return out

    def study_finished(self, ended: StudyEnded) -> None:
        """The parent run's closing content: the best, baseline and recommended configs, the
        summary figures, the result files, exports and plots."""
        result, probes_run, stopped_because = ended.result, ended.probes_run, ended.stopped_because
        improvement, summary_metrics = ended.improvement, ended.summary_metrics
        files, exports, plots = ended.files, ended.exports, ended.plots
        best = result.best[0] if result.best else None
        recommendation = result.recommendation
        # display figures (the parent's Metrics table) rounded; importances stay exact (read back)
        metrics: dict[str, float] = {"probes": probes_run}
        for k, v in summary_metrics.items():
            metrics[k] = v if k.startswith("importance_") else _rounded(v, 4 if k.startswith("gain_pct_") else 5)
        if best is not None:
            for m, _ in self.objectives:
                if _finite(best.metrics.get(m)):
                    metrics[f"best_{m}"] = _rounded(best.metrics[m])
                for key in ci_keys(m):  # how sure (issue 44): its interval within a run, where it has one
                    if _finite(best.metrics.get(key)):
                        metrics[f"best_{key}"] = _rounded(best.metrics[key])
            if best.source != "simulated":  # the readings a measured best rests on
                metrics["best_n_measurements"] = float(best.metrics.get("measurements", 1))
        if result.baseline is not None:
            for m, _ in self.objectives:
                if _finite(result.baseline.metrics.get(m)):
                    metrics[f"baseline_{m}"] = _rounded(result.baseline.metrics[m])
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
        tags[NOTE_TAG] = "\n".join([*self._what(), *self._outcome(result, improvement, stopped_because)])
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
    # what the rate search counted each run as (counted_as_met; the measured p99s where a probe predates it)
    tried = " ".join(
        f"{r.get('rate'):g}:{'met' if r.get('counted_as_met', r.get('slo_met')) else 'missed'}"
        for r in serving["rates"]
    )
    tags = {"autotune.serving.rates_tried": tried}
    if serving.get("operating_rate") is not None:
        tags["autotune.serving.operating_rate"] = f"{serving['operating_rate']:g}"
    if serving.get("slo"):
        tags["autotune.serving.slo"] = ", ".join(f"{k} {v:g}" for k, v in serving["slo"].items() if v is not None)
    return tags


_KIND = {"train": "training", "infer": "inference", "serve": "serving"}


def _rounded(value: float, digits: int = 5) -> float:
    """``value`` to ``digits`` significant digits: what the parent run's Metrics table shows
    (79.75455160563708 reads as 79.755); the trials' own runs keep every digit."""
    if not _finite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _figures(record: TrialRecord, objectives: list[tuple[str, str]]) -> str:
    return ", ".join(f"{m} {_number(record.metrics[m])}" for m, _ in objectives if _finite(record.metrics.get(m)))


def _config(config: dict[str, Any], searched: dict[str, list[Any]]) -> str:
    """The searched params of a config as ``name=value``, in the spec's order."""
    keys = [k for k in searched if k in config] or list(config)
    return " ".join(f"`{k}={config[k]}`" for k in keys)
