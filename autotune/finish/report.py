"""What a finished study says: best vs baseline, the results table (its plots: :mod:`autotune.finish.plots`).

Pure functions over :class:`~autotune.study.records.TrialRecord` lists, plus writers for the files the
CLI shows and the tracker attaches to the parent run. Nothing here talks to MLflow.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from ..study.importance import importance_note, study_importances
from ..study.usable_memory import USABLE_ATTR
from autotune.objectives.intervals import ci_keys

from ..sanity import is_finite_number as _finite
from ..guide.memory_profile import cost_of_trials, ran_full_probe
from ..study.records import INTERFERENCE_KEY, TrialRecord, best_records, is_tracked
from ..spec.errors import escape_text

__all__ = [
    "status_counts",
    "status_line",
    "improvement_line",
    "results_rows",
    "write_results_csv",
    "best_payload",
    "study_summary",
    "summary_lines",
    "summary_metrics",
    "wrap_line",
    "WIDTH",
]


def status_counts(records: list[TrialRecord]) -> dict[str, int]:
    """How many trials ended in each status: the one count that the end of ``run``, ``report``
    and the JSON payloads all print (a pruned trial is pruned everywhere, never "failed")."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    return dict(sorted(counts.items()))


def status_line(records: list[TrialRecord]) -> str:
    """E.g. "5 trials: 3 ok, 1 oom, 1 pruned"."""
    counts = status_counts(records)
    return f"{len(records)} trials: " + ", ".join(f"{v} {k}" for k, v in counts.items())


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


def results_rows(
    records: list[TrialRecord], objectives: list[tuple[str, str]], workload_kind: str = ""
) -> list[dict[str, Any]]:
    """One row per probed trial (the trials MLflow holds too), best first (failed ones last), with
    the objectives and the figures the workload's decision reads
    (:data:`autotune.objectives.DECISION_METRICS`)."""
    from autotune.objectives import DECISION_METRICS, workload_of_metrics

    if not workload_kind:
        workload_kind = next((workload_of_metrics(r.metrics) for r in records if r.metrics), "train")
    rows = []
    for r in records:
        if not is_tracked(r):
            continue
        row: dict[str, Any] = {"trial": r.number, "status": r.status, "source": r.source}
        for m, _ in objectives:
            row[m] = r.metrics.get(m)
        # the figures the workload's decision reads (serving: max rate, attainment, p99s, cost)
        for m in DECISION_METRICS[workload_kind]:
            row.setdefault(m, r.metrics.get(m))
        row["peak_memory_gib"] = r.metrics.get("peak_memory_gib")
        row.update(r.config)
        row["reason"] = r.reason if r.status != "ok" or not r.feasible else ""  # ok, but misses a constraint
        rows.append(row)
    m, d = objectives[0]
    sign = -1 if d == "maximize" else 1

    def key(row: dict[str, Any]) -> tuple:
        v = row.get(m)
        ok = row["status"] == "ok" and isinstance(v, (int, float))
        return (0 if ok else 1, sign * v if ok else 0, row["trial"])

    return sorted(rows, key=key)


def write_results_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    """``results.csv``: one line per row, a column per key (in first-seen order). A text cell that
    a spreadsheet would run as a formula (one starting with ``=``, ``+``, ``-``, ``@``, a tab or a
    carriage return: an env value ``=cmd|' /C calc'!A0``) is written with a leading ``'``, OWASP's
    rule for CSV injection; numbers (negative ones included) are written as they are, and the JSON
    outputs (summary.json, ``report --json``) keep every value raw."""

    def cell(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(("=", "+", "-", "@", "\t", "\r")):
            return "'" + value
        return value

    columns: list[str] = []
    for row in rows:
        for k in row:
            if k not in columns:
                columns.append(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([cell(str(c)) for c in columns])
        for row in rows:
            writer.writerow([cell(row.get(c, "")) for c in columns])
    return path


def best_payload(record: TrialRecord) -> dict[str, Any]:
    """A best trial for ``--json``; a slice study's says where its figure stands: projected from the
    slice (``projected_from``) or measured again at full size (``confirmed_at_target``)."""
    return {
        "number": record.number,
        "params": record.config,
        "metrics": record.metrics,
        "source": record.source,
        "predicted": record.predicted,
        **record.measured_where(),
    }


# metrics of the before/after view, with the direction in which they improve
_VIEW = {
    "tokens_per_s_per_device": "maximize",
    "tokens_per_s": "maximize",
    "step_time_s": "minimize",
    "mfu": "maximize",
    "peak_memory_gib": "minimize",
    "ttft_ms": "minimize",
    "decode_tokens_per_s": "maximize",
}


def _gain(best: float, base: float, direction: str) -> float | None:
    if not base:
        return None
    g = (best - base) / abs(base) * 100.0
    return -g if direction == "minimize" else g


def best_by_estimate(records: list[TrialRecord], objectives: list[tuple[str, str]], top: TrialRecord | None) -> str:
    """Why the best is not the highest reading, when the guide's estimate chose it: "" otherwise."""
    if top is None or len(objectives) != 1:
        return ""
    metric, _ = objectives[0]
    estimate, sd = top.predicted.get(f"estimated_{metric}"), top.predicted.get(f"estimated_{metric}_sd")
    read = best_records(records, objectives)
    if not _finite(estimate) or not read or read[0].number == top.number:
        return ""
    other = read[0]
    n = int(top.metrics.get("measurements", 1))
    return (
        f"best by the guide's estimate, which pools every measurement of the study: trial {top.number}, "
        f"{metric} {_fmt(estimate)} ± {_fmt(sd)} (measured {_fmt(top.metrics[metric])}"
        f"{f', mean of {n}' if n > 1 else ''}); trial {other.number} read higher ({_fmt(other.metrics[metric])}) "
        "but the rest of the evidence puts it lower: a high reading within the noise"
    )


def study_summary(
    study: Any,
    records: list[TrialRecord],
    objectives: list[tuple[str, str]],
    best: list[TrialRecord],
    baseline: TrialRecord | None,
    recommendation: Any = None,
    certificate: dict[str, Any] | None = None,
    drift: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The before/after view of a finished study (what ``report`` prints and the parent run keeps):
    baseline vs best per metric with the gain, the Pareto front (several objectives), parameter
    importances, and the best config's predicted memory breakdown beside its measured peak."""
    out: dict[str, Any] = {"objectives": [{"metric": m, "direction": d} for m, d in objectives]}
    top = best[0] if best else None
    view = dict(_VIEW)
    view.update({m: d for m, d in objectives})
    rows = []
    between = (certificate or {}).get("between_runs") or {}
    if top is not None:
        for metric, direction in view.items():
            b = top.metrics.get(metric)
            if not isinstance(b, (int, float)):
                continue
            a = baseline.metrics.get(metric) if baseline else None
            a = a if isinstance(a, (int, float)) else None
            low, high = (top.metrics.get(k) for k in ci_keys(metric))
            rows.append(
                {
                    "metric": metric,
                    "direction": direction,
                    "baseline": a,
                    "best": b,
                    "gain_pct": _gain(b, a, direction) if a is not None else None,
                    # how sure the best's figure is (issue 44): its interval where its probe's steps
                    # gave one, the readings (runs) and steps it rests on, measured or predicted
                    "interval": [low, high] if _finite(low) and _finite(high) else None,
                    "readings": int(top.metrics.get("measurements", 1)),
                    # readings set aside as interference (far slower than the config's others)
                    "set_aside": list(top.info.get(INTERFERENCE_KEY) or []),
                    "steps": int(top.metrics["n_steps"]) if _finite(top.metrics.get("n_steps")) else None,
                    "source": top.source,
                }
            )
            if between.get("metric") == metric:  # and between runs, at the study's measured noise
                rows[-1]["between_runs"] = [between["low"], between["high"]]
                rows[-1]["between_runs_noise"] = between["noise"]
    out["before_after"] = rows
    out["best_trial"] = top.number if top else None
    out["best_by_estimate"] = best_by_estimate(records, objectives, top)
    if certificate is not None:  # how sure of the best (issue 44): StudyResult.certificate
        out["certificate"] = certificate
    if drift is not None:  # the control config's readings over the study (issue 44): StudyResult.drift
        out["drift"] = drift
    if recommendation is not None:
        out["recommendation"] = {
            "trial": recommendation.chosen.number,
            "best_trial": recommendation.best.number,
            "headroom_gib": recommendation.headroom_gib,
            "best_headroom_gib": recommendation.best_headroom_gib,
            "tolerance": recommendation.tolerance,
            "changed": recommendation.changed,
            "why": recommendation.sentence,
        }
    out["baseline_trial"] = baseline.number if baseline else None
    out["pareto_front"] = (
        [{"trial": r.number, "params": r.config, **{m: r.metrics.get(m) for m, _ in objectives}} for r in best]
        if len(objectives) > 1
        else []
    )
    recorded = study_importances(study, objectives)
    out["importances"] = recorded["values"]
    out["importances_source"] = recorded["source"]
    out["importances_note"] = importance_note(recorded)
    out["probes"] = probe_costs(records)
    out["memory_calibration"] = memory_calibration(records)
    usable = study.user_attrs.get(USABLE_ATTR)
    if isinstance(usable, dict) and usable:
        out["usable_memory"] = usable
    if top is not None:
        source = top.predicted if any(k.startswith("mem_") for k in top.predicted) else top.metrics
        breakdown = {k[4:]: float(v) for k, v in source.items() if k.startswith("mem_") and isinstance(v, (int, float))}
        out["memory"] = {
            "predicted_gib": breakdown,
            "predicted_peak_gib": source.get("peak_memory_gib") if breakdown else None,
            "measured_peak_gib": top.metrics.get("peak_memory_gib") if top.source != "simulated" else None,
            "source": top.source,
        }
    return out


def probe_costs(records: list[TrialRecord]) -> dict[str, float]:
    """What the probes cost: counts and wall seconds, OOM probes apart (each is a launch that
    taught only "too big", often minutes on a real cluster)."""
    probed = [r for r in records if is_tracked(r) and r.status != "running" and "cached_from" not in r.info]
    attrs = [r.budget_attrs() for r in probed]
    full = [r for r, a in zip(probed, attrs) if ran_full_probe(a)]
    oom = [r for r in full if r.status == "oom"]
    profiled = [r for r in probed if r.memory_profile]
    profile_s = sum(sum(r.memory_profile.get("walls_s") or []) for r in profiled)
    # a trial its profile ended ran no probe: its wall is its profile's; the others' walls leave it out
    outside = sum(sum(r.memory_profile.get("walls_s") or []) for r in profiled if r in full)
    return {
        "probes": len(probed),
        "full_probes": len(full),
        "probe_seconds": round(sum(r.wall_s for r in probed) + outside, 3),
        "oom_probes": len(oom),
        "oom_probe_seconds": round(sum(r.wall_s for r in oom), 3),
        "memory_profiles": len(profiled),
        "memory_profile_seconds": round(profile_s, 3),
        "oom_predicted": sum(1 for r in probed if r.status == "oom_predicted"),
        "full_probe_equivalents": round(cost_of_trials(attrs), 3),
    }


CALIBRATION_BINS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.0001))


def memory_calibration(records: list[TrialRecord]) -> list[dict[str, Any]]:
    """Was the guide's P(fits) honest? Per bin of the P(fits) it gave a probe when it chose it,
    how many probes ran and the share that fitted (did not run out of memory)."""
    return calibration_rows(calibration_pairs(records))


def calibration_pairs(records: list[TrialRecord]) -> list[tuple[float, bool]]:
    """(P(fits) a full probe ran at, whether it fitted) of every full probe with a memory verdict: the
    P(fits) of its memory profile's verdict where a profile sent it on, else the guide's when it
    chose the config (the one the guide corrects itself by: ``guided_sampler._stated_p_fit``)."""
    out = []
    for r in records:
        if not (r.probed and r.status in ("ok", "oom", "pruned", "nan")):
            continue
        stated = (r.memory_profile or {}).get("p_fit")
        stated = stated if _finite(stated) else r.predicted.get("guided_p_fit")
        if _finite(stated):
            out.append((float(stated), r.status != "oom"))
    return out


def calibration_rows(pairs: list[tuple[float, bool]]) -> list[dict[str, Any]]:
    """The pairs binned by P(fits) (``CALIBRATION_BINS``), empty bins left out."""
    rows = []
    for low, high in CALIBRATION_BINS:
        inside = [fit for p, fit in pairs if low <= p < high]
        if inside:
            rows.append(
                {
                    "p_fit_from": low,
                    "p_fit_to": min(high, 1.0),
                    "probes": len(inside),
                    "fitted": sum(inside),
                    "fit_rate": sum(inside) / len(inside),
                }
            )
    return rows


WIDTH = 120  # the terminal the report's lines must fit (summary.md shares them)


def _how_sure(row: dict[str, Any]) -> str:
    """What the best's figure rests on, for the summary's line: its 95 % interval within a run and
    the steps and runs behind it; a figure from one reading without steps says so; a prediction is
    marked as one."""
    if row.get("source") == "simulated":
        return "  (predicted)"
    if "readings" not in row:  # a summary written before intervals were kept
        return ""
    runs = row["readings"]
    runs_text = f"{runs} run{'s' if runs != 1 else ''}"
    across = ""
    if row.get("between_runs"):  # the interval a next run's mean falls in is wider than one run's steps
        low, high = row["between_runs"]
        across = f"; between runs {_fmt(low)}-{_fmt(high)} at the study's noise {row['between_runs_noise']:.1%}"
    if row.get("interval"):
        low, high = row["interval"]
        steps = f"{row['steps']} steps of " if row.get("steps") else ""
        return f"  (95 % CI {_fmt(low)}-{_fmt(high)} within a run; {steps}{runs_text}{across})"
    if across:
        return f"  ({'one reading' if runs == 1 else f'mean of {runs_text}'}{across})"
    return "  (one reading, no interval)" if runs == 1 else f"  (mean of {runs_text})"


def summary_lines(summary: dict[str, Any], width: int = WIDTH) -> list[str]:
    """The summary as text lines for the terminal and summary.md, each at most ``width`` columns
    (a longer line is wrapped at a word, its continuation indented). Text a probe or the spec
    wrote (a recommendation's config, a parameter's name) has its control, bidi and invisible
    characters escaped (:func:`~autotune.spec.errors.escape_text`): a newline is ``\\n``, not a
    line break."""
    lines: list[str] = []
    rows = summary.get("before_after") or []
    objectives = {o["metric"] for o in summary.get("objectives") or []}

    def _sureness(r: dict[str, Any]) -> str:
        return _how_sure(r) if r["metric"] in objectives else ""

    baseline = summary.get("baseline_trial")
    if rows and baseline is not None:
        lines.append(f"before/after (baseline trial {baseline}, best trial {summary.get('best_trial')}):")
        for r in rows:
            base = _fmt(r["baseline"]) if r["baseline"] is not None else "-"
            gain = _better_or_worse(r["gain_pct"])
            lines.append(f"  {r['metric']:<26} {base:>12} -> {_fmt(r['best']):>12}  {gain}{_sureness(r)}".rstrip())
    elif rows:  # no baseline in the spec: nothing to compare with, the best's figures alone
        names = [o["metric"] for o in summary.get("objectives") or []]
        several = len(names) > 1
        what = "first on the Pareto front" if several else "best"
        lines.append(f"{what}: trial {summary.get('best_trial')} (no baseline in the spec to compare with):")
        for r in rows:
            lines.append(f"  {r['metric']:<26} {_fmt(r['best']):>12}{_sureness(r)}")
    if summary.get("best_by_estimate"):
        lines.append(summary["best_by_estimate"])
    for part in ("certificate", "drift"):
        if (summary.get(part) or {}).get("sentence"):
            lines.append(summary[part]["sentence"])
    rec = summary.get("recommendation") or {}
    if rec.get("why"):
        lines.append(rec["why"])
    front = summary.get("pareto_front") or []
    if front:
        names = [o["metric"] for o in summary["objectives"]]
        lines.append(f"Pareto front ({len(front)} trials: none is better in every objective than another):")
        for p in front:
            lines.append(
                "  trial "
                + str(p["trial"])
                + ": "
                + ", ".join(f"{n} {_fmt(p[n])}" for n in names if isinstance(p.get(n), (int, float)))
            )
    importances = summary.get("importances") or {}
    for metric, values in importances.items():
        lines.append(f"parameter importances for {metric}: " + _top_importances(values))
    if importances:
        note = summary.get("importances_note") or (
            f"importance: {summary['importances_source']}" if summary.get("importances_source") else ""
        )
        if note:
            lines.append(f"  ({note})")
    cost = summary.get("probes") or {}
    if cost.get("probes"):
        lines.append(
            f"probes: {cost['probes']} in {cost['probe_seconds']:.0f} s; out of memory: {cost['oom_probes']} "
            f"({cost['oom_probe_seconds']:.0f} s)"
        )
        if cost.get("memory_profiles"):
            lines.append(
                f"memory profiles: {cost['memory_profiles']} trials ({cost['memory_profile_seconds']:.0f} s), "
                f"{cost['oom_predicted']} ended by theirs without a full probe; "
                f"{cost['full_probe_equivalents']:.1f} full-probe equivalents spent in all"
            )
    usable = summary.get("usable_memory") or {}
    if "usable_memory_gib" in usable:
        held = usable.get("runtime_held_gib")  # set where the device's total was read (not on the CPU)
        lines.append(
            f"usable memory per device, measured before the first probe: {usable['usable_memory_gib']:.2f} GiB "
            + (f"of {float(usable['total_memory_gib']):.2f} GiB (the runtime held {float(held):.2f}) " if held else "")
            + f"({usable.get('how', 'device check')})"
        )
    elif usable.get("error"):
        lines.append(f"usable memory not measured before the first probe: {usable['error']}")
    for row in summary.get("memory_calibration") or []:
        lines.append(
            f"guide said P(fits) {row['p_fit_from']:.2f}-{row['p_fit_to']:.2f}: {row['fitted']} of "
            f"{row['probes']} fitted"
        )
    mem = summary.get("memory") or {}
    if mem.get("predicted_gib"):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mem["predicted_gib"].items() if v)
        measured = mem.get("measured_peak_gib")
        lines.append(
            f"memory of the best config (GiB): predicted {parts} = {mem['predicted_peak_gib']:.2f}; "
            + (
                f"measured peak {measured:.2f}"
                if isinstance(measured, (int, float))
                else "not measured (simulated)"
                if mem.get("source") == "simulated"
                else "peak not measured (the probe did not report it)"
            )
        )
    return [wrapped for line in lines for wrapped in wrap_line(escape_text(line), width)]


def _top_importances(values: dict[str, float], n: int = 6) -> str:
    top = sorted(values.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.2f}" for k, v in top)


def wrap_line(line: str, width: int = WIDTH, indent: int | None = None) -> list[str]:
    """A line cut at words into lines of at most ``width`` columns (a word longer than that
    stays whole), continuations indented two more than the line (or ``indent``)."""
    import textwrap

    if len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    more = " " * (lead + 2 if indent is None else indent)
    return textwrap.wrap(
        line.lstrip(" "),
        width=width,
        initial_indent=" " * lead,
        subsequent_indent=more,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [line]


def _better_or_worse(gain_pct: float | None) -> str:
    """``44.4 % better`` / ``111.0 % worse``: the gain is signed by the metric's direction (a
    shorter step time is a positive gain), which a bare ``+44.4 %`` beside a falling number hid."""
    if gain_pct is None:
        return ""
    if abs(gain_pct) < 0.05:
        return "same"
    return f"{abs(gain_pct):.1f} % {'better' if gain_pct > 0 else 'worse'}"


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
    cert = summary.get("certificate") or {}
    if _finite(cert.get("p_within_tolerance")):  # how sure of the best (issue 44)
        out["best_p_within_tolerance"] = float(cert["p_within_tolerance"])
        out["race_remeasured"] = float(cert.get("remeasured", 0))
    for between in (cert.get("between_runs") or {}, cert.get("between_runs_max_rate") or {}):
        if _finite(between.get("low")) and _finite(between.get("high")):
            out[f"best_{between['metric']}_between_runs_low"] = float(between["low"])
            out[f"best_{between['metric']}_between_runs_high"] = float(between["high"])
    drift = summary.get("drift") or {}
    if _finite(drift.get("change")):
        out["drift_pct"] = 100.0 * float(drift["change"])
    return out
