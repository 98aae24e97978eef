"""What a finished study says: best vs baseline, the results table, Optuna plots.

Pure functions over :class:`~autotune.search.TrialRecord` lists, plus writers for the files the
CLI shows and the tracker attaches to the parent run. Nothing here talks to MLflow.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

from .sanity import is_finite_number as _finite
from .search import TrialRecord, is_tracked

__all__ = ["improvement_line", "results_rows", "write_results_csv", "write_plots", "best_payload", "study_summary",
           "summary_lines", "summary_metrics"]

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
    """One row per probed trial (the trials MLflow holds too), best first (failed ones last)."""
    rows = []
    for r in records:
        if not is_tracked(r):
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


# metrics of the before/after view, with the direction in which they improve
_VIEW = {"tokens_per_s_per_device": "maximize", "tokens_per_s": "maximize", "step_time_s": "minimize",
         "mfu": "maximize", "peak_memory_gib": "minimize", "ttft_ms": "minimize", "decode_tokens_per_s": "maximize"}


def _gain(best: float, base: float, direction: str) -> float | None:
    if not base:
        return None
    g = (best - base) / abs(base) * 100.0
    return -g if direction == "minimize" else g


def study_summary(study: Any, records: list[TrialRecord], objectives: list[tuple[str, str]],
                  best: list[TrialRecord], baseline: TrialRecord | None) -> dict[str, Any]:
    """The before/after view of a finished study (what ``report`` prints and the parent run keeps):
    baseline vs best per metric with the gain, the Pareto front (several objectives), parameter
    importances, and the best config's predicted memory breakdown beside its measured peak."""
    out: dict[str, Any] = {"objectives": [{"metric": m, "direction": d} for m, d in objectives]}
    top = best[0] if best else None
    view = dict(_VIEW)
    view.update({m: d for m, d in objectives})
    rows = []
    if top is not None:
        for metric, direction in view.items():
            b = top.metrics.get(metric)
            if not isinstance(b, (int, float)):
                continue
            a = baseline.metrics.get(metric) if baseline else None
            a = a if isinstance(a, (int, float)) else None
            rows.append({"metric": metric, "direction": direction, "baseline": a, "best": b,
                         "gain_pct": _gain(b, a, direction) if a is not None else None})
    out["before_after"] = rows
    out["best_trial"] = top.number if top else None
    out["baseline_trial"] = baseline.number if baseline else None
    out["pareto_front"] = ([{"trial": r.number, "params": r.config, **{m: r.metrics.get(m) for m, _ in objectives}}
                            for r in best] if len(objectives) > 1 else [])
    out["importances"] = _importances(study, objectives)
    out["probes"] = probe_costs(records)
    out["memory_calibration"] = memory_calibration(records)
    if top is not None:
        source = top.predicted if any(k.startswith("mem_") for k in top.predicted) else top.metrics
        breakdown = {k[4:]: float(v) for k, v in source.items() if k.startswith("mem_") and isinstance(v, (int, float))}
        out["memory"] = {"predicted_gib": breakdown,
                         "predicted_peak_gib": source.get("peak_memory_gib") if breakdown else None,
                         "measured_peak_gib": top.metrics.get("peak_memory_gib") if top.source != "simulated" else None,
                         "source": top.source}
    return out


def probe_costs(records: list[TrialRecord]) -> dict[str, float]:
    """What the probes cost: counts and wall seconds, OOM probes apart (each is a launch that
    taught only "too big", often minutes on a real cluster)."""
    probed = [r for r in records if is_tracked(r) and r.status != "running" and "cached_from" not in r.info]
    oom = [r for r in probed if r.status == "oom"]
    return {"probes": len(probed), "probe_seconds": round(sum(r.wall_s for r in probed), 3),
            "oom_probes": len(oom), "oom_probe_seconds": round(sum(r.wall_s for r in oom), 3)}


CALIBRATION_BINS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.0001))


def memory_calibration(records: list[TrialRecord]) -> list[dict[str, Any]]:
    """Was the guide's P(fits) honest? Per bin of the P(fits) it gave a probe when it chose it,
    how many probes ran and the share that fitted (did not run out of memory)."""
    return calibration_rows(calibration_pairs(records))


def calibration_pairs(records: list[TrialRecord]) -> list[tuple[float, bool]]:
    """(P(fits) the guide gave a probe, whether it fitted) of every probe with a memory verdict."""
    return [(float(r.predicted["guided_p_fit"]), r.status != "oom") for r in records
            if r.probed and r.status in ("ok", "oom", "pruned", "nan") and _finite(r.predicted.get("guided_p_fit"))]


def calibration_rows(pairs: list[tuple[float, bool]]) -> list[dict[str, Any]]:
    """The pairs binned by P(fits) (``CALIBRATION_BINS``), empty bins left out."""
    rows = []
    for low, high in CALIBRATION_BINS:
        inside = [fit for p, fit in pairs if low <= p < high]
        if inside:
            rows.append({"p_fit_from": low, "p_fit_to": min(high, 1.0), "probes": len(inside),
                         "fitted": sum(inside), "fit_rate": sum(inside) / len(inside)})
    return rows


def _importances(study: Any, objectives: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Optuna's parameter importances per objective (empty when the study is too small)."""
    import warnings

    import optuna

    out: dict[str, dict[str, float]] = {}
    for i, (metric, _) in enumerate(objectives):
        try:
            with warnings.catch_warnings():  # importances do not depend on the direction
                warnings.simplefilter("ignore")
                values = optuna.importance.get_param_importances(study, target=lambda t, i=i: t.values[i])
        except Exception as exc:  # too few completed trials, or a parameter that never varied
            log.info("importances for %s skipped: %s", metric, exc)
            continue
        out[metric] = {k: float(v) for k, v in values.items()}
    return out


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as text lines for the terminal and summary.md."""
    lines: list[str] = []
    rows = summary.get("before_after") or []
    if rows:
        lines.append(f"before/after (baseline trial {summary.get('baseline_trial')}, best trial {summary.get('best_trial')}):")
        for r in rows:
            base = _fmt(r["baseline"]) if r["baseline"] is not None else "-"
            gain = f"{r['gain_pct']:+.1f} %" if r["gain_pct"] is not None else ""
            lines.append(f"  {r['metric']:<26} {base:>12} -> {_fmt(r['best']):>12}  {gain}")
    front = summary.get("pareto_front") or []
    if front:
        names = [o["metric"] for o in summary["objectives"]]
        lines.append(f"Pareto front ({len(front)} trials):")
        for p in front:
            lines.append("  trial " + str(p["trial"]) + ": " + ", ".join(
                f"{n} {_fmt(p[n])}" for n in names if isinstance(p.get(n), (int, float))))
    for metric, values in (summary.get("importances") or {}).items():
        top = sorted(values.items(), key=lambda kv: -kv[1])[:6]
        lines.append(f"parameter importances for {metric}: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    cost = summary.get("probes") or {}
    if cost.get("probes"):
        lines.append(f"probes: {cost['probes']} in {cost['probe_seconds']:.0f} s; out of memory: {cost['oom_probes']} "
                     f"({cost['oom_probe_seconds']:.0f} s)")
    for row in summary.get("memory_calibration") or []:
        lines.append(f"guide said P(fits) {row['p_fit_from']:.2f}-{row['p_fit_to']:.2f}: {row['fitted']} of "
                     f"{row['probes']} fitted")
    mem = summary.get("memory") or {}
    if mem.get("predicted_gib"):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mem["predicted_gib"].items() if v)
        measured = mem.get("measured_peak_gib")
        lines.append(f"memory of the best config (GiB): predicted {parts} = {mem['predicted_peak_gib']:.2f}; "
                     + (f"measured peak {measured:.2f}" if isinstance(measured, (int, float)) else "not measured (simulated)"))
    return lines


def summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """Numbers of the summary for the parent run: gain per metric, importances."""
    out: dict[str, float] = {}
    for r in summary.get("before_after") or []:
        if r["gain_pct"] is not None:
            out[f"gain_pct_{r['metric']}"] = float(r["gain_pct"])
    for metric, values in (summary.get("importances") or {}).items():
        for k, v in values.items():
            out[f"importance_{metric}_{k}".replace(".", "_")] = float(v)
    for k, v in (summary.get("probes") or {}).items():
        out[k] = float(v)
    return out
