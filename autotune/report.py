"""What a finished study says: best vs baseline, the results table, Optuna plots.

Pure functions over :class:`~autotune.search.TrialRecord` lists, plus writers for the files the
CLI shows and the tracker attaches to the parent run. Nothing here talks to MLflow.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from .search import TrialRecord

__all__ = ["improvement_line", "results_rows", "write_results_csv", "write_plots", "best_payload"]

log = logging.getLogger(__name__)


def improvement_line(best: TrialRecord | None, baseline: TrialRecord | None, metric: str, direction: str) -> str | None:
    """E.g. "best 4,210 tokens_per_s_per_device vs baseline 2,730: +54 %"."""
    if best is None or baseline is None:
        return None
    b, a = best.metrics.get(metric), baseline.metrics.get(metric)
    if not isinstance(b, (int, float)) or not isinstance(a, (int, float)) or a == 0:
        return None
    gain = (b - a) / abs(a) * 100.0
    if direction == "minimize":
        gain = -gain
    return f"best {_fmt(b)} {metric} vs baseline {_fmt(a)}: {gain:+.0f} %"


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def results_rows(records: list[TrialRecord], objectives: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """One row per probed trial, best first (failed ones last)."""
    rows = []
    for r in records:
        if not r.probed or r.status in ("interrupted", "duplicate"):
            continue
        row: dict[str, Any] = {"trial": r.number, "status": r.status, "source": r.source}
        for m, _ in objectives:
            row[m] = r.metrics.get(m)
        row["peak_memory_gib"] = r.metrics.get("peak_memory_gib")
        row.update(r.config)
        row["reason"] = r.reason if r.status != "ok" else ""
        rows.append(row)
    m, d = objectives[0]
    sign = -1 if d == "maximize" else 1

    def key(row: dict[str, Any]) -> tuple:
        v = row.get(m)
        ok = row["status"] == "ok" and isinstance(v, (int, float))
        return (0 if ok else 1, sign * v if ok else 0, row["trial"])

    return sorted(rows, key=key)


def write_results_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    columns: list[str] = []
    for row in rows:
        for k in row:
            if k not in columns:
                columns.append(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return path


def write_plots(study: Any, out_dir: Path, objectives: list[tuple[str, str]]) -> list[Path]:
    """Optuna's plotly plots as HTML (history, importances, Pareto front when several objectives).
    A plot Optuna cannot draw for this study (too few trials) is skipped with a log line."""
    import optuna.visualization as vis

    out_dir.mkdir(parents=True, exist_ok=True)
    names = [m for m, _ in objectives]
    makers: dict[str, Any] = {}
    if len(objectives) == 1:
        makers["optimization_history"] = lambda: vis.plot_optimization_history(study, target_name=names[0])
        makers["param_importances"] = lambda: vis.plot_param_importances(study, target_name=names[0])
    else:
        makers["pareto_front"] = lambda: vis.plot_pareto_front(study, target_names=names)
        for i, name in enumerate(names):
            makers[f"optimization_history_{name}"] = (
                lambda i=i, name=name: vis.plot_optimization_history(study, target=lambda t: t.values[i], target_name=name))
            makers[f"param_importances_{name}"] = (
                lambda i=i, name=name: vis.plot_param_importances(study, target=lambda t: t.values[i], target_name=name))
    written = []
    for name, make in makers.items():
        try:
            fig = make()
            path = out_dir / f"{name}.html"
            fig.write_html(str(path), include_plotlyjs=True)  # self-contained: clusters are often offline
            written.append(path)
        except Exception as exc:  # optuna raises for studies it cannot plot (e.g. one trial)
            log.info("plot %s skipped: %s", name, exc)
    return written


def best_payload(record: TrialRecord) -> dict[str, Any]:
    return {"number": record.number, "params": record.config, "metrics": record.metrics, "source": record.source,
            "predicted": record.predicted}
