"""The end of a study: its results table, summary, plots and exports, and the MLflow parent run's
closing content. Behind the CLI (which prints what this returns), so that a script that runs a
study gets the same files as ``autotune run``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from .records import TrialRecord
from .spec import Spec
from .study_result import StudyResult

__all__ = ["FinishedStudy", "finish_study", "export_context", "json_default"]

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


def export_context(spec: Spec, record: TrialRecord) -> Any:
    """What an exporter may use of a chosen trial: its config and metrics, the spec's model,
    workload and cluster, the study's target stack, the trial's reason and the searched names."""
    from .context import probe_context
    from .export import ExportContext

    ctx = probe_context(spec)
    cluster = {k: v for k, v in ctx.cluster.items() if k != "hardware"}
    # best.env's comments read the trial's reason (the knobs the model could not tell apart) and
    # the searched names
    return ExportContext.from_record(
        spec.name, record, ctx.model, ctx.workload, cluster, target=spec.target_stack, searched=spec.space.searched()
    )


def finish_study(
    spec: Spec,
    directory: Path,
    study: optuna.Study,
    result: StudyResult,
    *,
    probes_run: float,
    stopped_because: str,
    tracking: Any = None,
) -> FinishedStudy:
    """Write ``results.csv``, ``summary.json``/``summary.md``, the plots and every export that can
    launch the recommended config exactly; give MLflow's parent run its closing content."""
    from .exports import EXPORTERS, default_formats, refusals, write_exports
    from .report import (
        improvement_line,
        results_rows,
        study_summary,
        summary_lines,
        summary_metrics,
        write_plots,
        write_results_csv,
    )

    objectives = spec.objective_list()
    results_csv = write_results_csv(
        results_rows(result.records, objectives, spec.workload.kind), directory / "results.csv"
    )
    best = result.best[0] if result.best else None
    line = improvement_line(best, result.baseline, *objectives[0])
    finished = FinishedStudy(result, line, {})
    chosen = result.chosen
    if chosen is not None:
        context = export_context(spec, chosen)
        target_formats = default_formats(spec.target_stack, spec.workload.kind)
        # every format that can launch the config exactly; the target's own are expected to
        refused = refusals(context, list(EXPORTERS))
        for name, reasons in refused.items():
            if name in target_formats:
                finished.target_refusals[name] = reasons
            else:
                log.info("not exported as %s: %s", name, ", ".join(reasons))
        finished.exports = write_exports(context, directory / "export", [f for f in EXPORTERS if f not in refused])
    summary = study_summary(study, result.records, objectives, result.best, result.baseline, result.recommendation)
    finished.summary = summary
    finished.plots = write_plots(study, directory / "plots", objectives, summary.get("importances"))
    summary_json = directory / "summary.json"
    summary_json.write_text(json.dumps(summary, indent=1, default=json_default))
    summary_md = directory / "summary.md"
    summary_md.write_text(
        f"# {spec.name}\n\n" + (f"{line}\n\n" if line else "") + "```\n" + "\n".join(summary_lines(summary)) + "\n```\n"
    )
    finished.files = [results_csv, summary_json, summary_md]
    if tracking is not None:
        tracking.finish(
            result,
            probes_run=probes_run,
            stopped_because=stopped_because,
            improvement=line,
            summary_metrics=summary_metrics(summary),
            files=finished.files,
            exports=finished.exports,
            plots=finished.plots,
        )
    return finished
