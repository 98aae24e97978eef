"""The end of a study: its results table, summary, plots and exports, the MLflow parent run's
closing content (:func:`finish_study`), and what the user is told at the end (:func:`advise`: the
``--json`` object, the status line, the next steps, how the study ended). Behind the CLI, which
prints what this returns, so that a script that runs a study gets the same files and the same
advice as ``autotune run``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import optuna

from ..study.listeners import StudyEnded, TrialListener
from ..study.records import TrialRecord
from ..spec.schema import Spec
from ..stacks import target_of
from ..workers.parameters import value
from ..study.result import StudyResult
from ..spec.resolve import objectives_of

__all__ = [
    "Advice",
    "FinishedStudy",
    "advise",
    "finish_run",
    "finish_study",
    "export_context",
    "json_default",
    "probes_words",
]

log = logging.getLogger(__name__)


def json_default(o: Any) -> Any:
    """numpy scalars as Python numbers, anything else as its text (JSON payloads and summary.json)."""
    return o.item() if hasattr(o, "item") else str(o)


@dataclass
class FinishedStudy:
    result: StudyResult
    improvement: str | None
    summary: dict[str, Any]
    exports: dict[str, Path] = field(default_factory=dict)
    # the target stack's own formats that refused the chosen config (a study resumed from before its target)
    target_refusals: dict[str, list[str]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # results.csv, summary.json, summary.md
    plots: list[Path] = field(default_factory=list)


def export_context(spec: Spec, record: TrialRecord, certificate: dict[str, Any] | None = None) -> Any:
    """What an exporter may use of a chosen trial: its config and metrics, the spec's model,
    workload and cluster, the study's target stack, the trial's reason and the searched names, and
    its figure between runs where ``certificate`` (``StudyResult.certificate``) gives one for it."""
    from ..spec.resolve import probe_context
    from ..export import ExportContext

    ctx = probe_context(spec)
    cluster = {k: v for k, v in ctx.cluster.items() if k != "hardware"}
    # best.env's comments read the trial's reason (the knobs the model could not tell apart) and
    # the searched names
    between = (certificate or {}).get("between_runs")
    if (certificate or {}).get("best_trial") != record.number:
        between = None  # the recommendation may be a tie's roomier config: the interval is the best's
    return ExportContext.from_record(
        spec.name,
        record,
        ctx.model,
        ctx.workload,
        cluster,
        target=target_of(spec),
        searched=spec.space.searched(),
        between_runs=between,
    )


def finish_study(
    spec: Spec,
    directory: Path,
    study: optuna.Study,
    result: StudyResult,
    *,
    probes_run: float,
    stopped_because: str,
    listeners: Sequence[TrialListener] = (),
) -> FinishedStudy:
    """Write ``results.csv``, ``summary.json``/``summary.md``, the plots and every export that can
    launch the recommended config exactly; give MLflow's parent run its closing content."""
    from .exports import EXPORTERS, default_formats, refusals, write_exports
    from .report import improvement_line, results_rows, study_summary, summary_lines, summary_metrics, write_results_csv
    from .plots import write_plots

    objectives = objectives_of(spec)
    results_csv = write_results_csv(
        results_rows(result.records, objectives, spec.workload.kind), directory / "results.csv"
    )
    best = result.best[0] if result.best else None
    line = improvement_line(best, result.baseline, *objectives[0])
    finished = FinishedStudy(result, line, {})
    chosen = result.chosen
    if chosen is not None:
        context = export_context(spec, chosen, result.certificate)
        target_formats = default_formats(target_of(spec), spec.workload.kind)
        # every format that can launch the config exactly; the target's own are expected to
        refused = refusals(context, list(EXPORTERS))
        for name, reasons in refused.items():
            if name in target_formats:
                finished.target_refusals[name] = reasons
            else:
                log.info("not exported as %s: %s", name, ", ".join(reasons))
        finished.exports = write_exports(context, directory / "export", [f for f in EXPORTERS if f not in refused])
    summary = study_summary(
        study,
        result.records,
        objectives,
        result.best,
        result.baseline,
        result.recommendation,
        result.certificate,
        result.drift,
    )
    finished.summary = summary
    finished.plots = write_plots(study, directory / "plots", objectives, summary.get("importances"))
    summary_json = directory / "summary.json"
    summary_json.write_text(json.dumps(summary, indent=1, default=json_default))
    summary_md = directory / "summary.md"
    summary_md.write_text(
        f"# {spec.name}\n\n" + (f"{line}\n\n" if line else "") + "```\n" + "\n".join(summary_lines(summary)) + "\n```\n"
    )
    finished.files = [results_csv, summary_json, summary_md]
    ended = StudyEnded(
        result,
        probes_run=probes_run,
        stopped_because=stopped_because,
        improvement=line,
        summary_metrics=summary_metrics(summary),
        files=finished.files,
        exports=finished.exports,
        plots=finished.plots,
    )
    for listener in listeners:  # the listener contract (autotune.study.listeners), as the loop calls it
        listener.study_finished(ended)
    return finished


def finish_run(
    spec: Spec, directory: Path, outcome: Any, listeners: Sequence[TrialListener], tracking: Any, voice: Any
) -> FinishedStudy:
    """The end of ``autotune run``: :func:`finish_study` within a phase the user sees, its
    ``listeners`` told (the loop's: MLflow's among them), the MLflow parent run closed (``tracking``:
    what MLflow refused said), and the target's formats that refused the chosen config said (a study
    resumed from before its target). ``voice``: :class:`autotune.cli.assembly.Voice`."""
    what = "writing the results, plots, exports" + (" and the MLflow parent run" if tracking else "")
    with voice.phase(what):
        finished = finish_study(
            spec,
            directory,
            outcome.study,
            outcome.result,
            probes_run=outcome.probes_run,
            stopped_because=outcome.stopped_because,
            listeners=listeners,
        )
        if tracking:
            for warning in tracking.close("FINISHED"):
                voice.warn(warning)
    for name, reasons in finished.target_refusals.items():
        voice.warn(f"not exported as {name}: {', '.join(reasons)}")
    return finished


@dataclass
class Advice:
    """What ``autotune run`` says at the end of a study, decided here and printed by the CLI."""

    payload: dict[str, Any]  # the --json object
    status: str  # trials by status, the budget spent, the source, why the study stopped
    next_steps: list[str]  # one line each: where to browse, report and launch what was found
    succeeded: bool  # a trial succeeded (else exit 1)
    infra_failure: str | None  # the infrastructure failed the study (exit 3)


def probes_words(spent: float) -> str:
    """The budget spent: a count of probes, or full-probe equivalents where memory profiles
    (which cost a share of a full probe) ran."""
    spent = float(spent)
    if abs(spent - round(spent)) < 1e-9:
        return f"{int(round(spent))} probed"
    return f"{spent:.1f} full-probe equivalents probed, memory profiles included"


def _quoted(path: Any) -> str:
    import shlex

    return shlex.quote(str(path))


def advise(spec: Spec, directory: Path, backend: Any, outcome: Any, finished: FinishedStudy, tracking: Any) -> Advice:
    """The end of ``autotune run``: the ``--json`` object, the status line, the next steps (browse
    the trials, Optuna's view, the results table, the exported config and how to launch it, and for
    a simulated study how to measure it), and whether it succeeded or the infrastructure failed."""
    from autotune.workers.protocol import FAILURE_STATUSES

    from .exports import default_formats
    from ..study.records import is_tracked
    from .report import best_payload, status_counts, status_line
    from ..study.storage import journal_path

    objectives = objectives_of(spec)
    result, exports = outcome.result, finished.exports
    recommendation, chosen = result.recommendation, result.chosen
    source = "simulated" if backend.simulated else "measured"
    payload = {
        "study": spec.name,
        "backend": backend.kind,
        "source": source,
        "probes": round(float(outcome.probes_run), 3),  # full-probe equivalents (a memory profile: its share)
        "failed": sum(1 for r in result.records if is_tracked(r) and r.status in FAILURE_STATUSES),
        "statuses": status_counts(result.records),
        "stopped_because": outcome.stopped_because,
        "best": [best_payload(b) for b in result.best],
        "improvement": finished.improvement,
        "run_dir": str(directory),
        "recommended": best_payload(chosen) if chosen is not None else None,
        "recommendation": recommendation.sentence if recommendation else "",
        "certificate": result.certificate,
        "drift": result.drift,
        "exports": {k: str(v) for k, v in exports.items()},
        "mlflow_parent_run_id": outcome.parent_run_id,
    }
    status = (
        f"{status_line(result.records)} ({probes_words(outcome.probes_run)}, {source}); stopped: "
        f"{outcome.stopped_because}"
    )
    steps = []
    spec_arg = str(spec.source_path) if spec.source_path else spec.name
    if tracking:
        uri = tracking.tracker.tracking_uri
        if uri.startswith(("http://", "https://", "databricks")):  # a server of its own: open it there
            steps.append(f"  browse trials:   open {uri} (experiment {spec.tracking.experiment or spec.name})")
        else:
            steps.append(f"  browse trials:   autotune ui {_quoted(directory)}")
    journal = journal_path(spec, directory)
    if journal is not None:
        steps.append(f"  Optuna's view:   optuna-dashboard {_quoted(journal)}")
    steps.append(f"  results table:   autotune report {spec_arg} --run-dir {directory}")
    if exports:
        launch = next(
            (
                exports[f]
                for f in default_formats(target_of(spec), spec.workload.kind)
                if f not in ("yaml", "env") and f in exports
            ),
            None,
        ) or next((p for f, p in exports.items() if f not in ("yaml", "env")), None)
        label = (
            "recommended:    "
            if recommendation is not None and recommendation.changed
            else "front's first:  "
            if len(objectives) > 1
            else "best config:    "
        )
        how = f"launch with {target_of(spec)}: {launch}, " if launch else ""
        steps.append(f"  {label} {exports['yaml']}   ({how}env: {exports['env']})")
    if backend.simulated:
        how = (
            f"backend {target_of(spec)}, the engine itself"
            if spec.workload.kind == "serve" and target_of(spec) != "none"
            else "backend torch or command"
        )
        exported = result.chosen  # the config the exports launch
        pd = exported is not None and target_of(spec) == "mindie" and value(exported.config, "prefill_replicas") > 0
        if pd:  # the mindie probe starts daemons, not MindIE-Motor's controller and coordinator
            how = "MindIE-Motor deploying the export, measured by your load generator or backend command"
        steps.append(f"  these are predictions: run on the target cluster ({how}) to measure them")
    return Advice(payload, status, steps, bool(result.best), outcome.infra_failure)
