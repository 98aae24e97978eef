"""A scaling study's output: the table, ``scaling.json``, the plot and the study's MLflow parent run.

The plot (``scaling.png``) has two panels against the devices: the scaling efficiency per config
and mode with the linear line at 1.0 (and the model's projection from the smallest size, dashed),
and the communication share. matplotlib is imported here, lazily, as the study's own plots are
(:mod:`autotune.finish.plots`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..scaling.summary import Point, ScalingSummary

__all__ = ["log_scaling", "scaling_rows", "write_scaling_files"]

log = logging.getLogger("autotune")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def scaling_rows(summary: ScalingSummary) -> tuple[list[dict[str, str]], list[str]]:
    """One row of text per point, in the table's columns (what the terminal shows), and the notes
    the rows point to (why a size was skipped or failed: too long for a column)."""
    rows, notes = [], []
    for (trial, mode), curve in summary.curves().items():
        for p in curve:
            why = p.skipped or p.failed
            if why:
                notes.append(f"[{len(notes) + 1}] trial {trial}, {mode}, {p.size.label}: {why}")
            rows.append(
                {
                    "trial": str(trial),
                    "mode": mode,
                    "devices": f"{p.size.label}",
                    "tokens/s/device": _throughput(p),
                    "efficiency": _efficiency(p),
                    "comm": _pct(p.comm_fraction),
                    "peak GiB": _num(p.peak_memory_gib),
                    "projected": _projected(p),
                    "note": f"[{len(notes)}]" if why else "",
                }
            )
    return rows, notes


def _throughput(p: Point) -> str:
    if p.tokens_per_s_per_device is None:
        return "—"
    text = _num(p.tokens_per_s_per_device)
    if p.interval:
        text += f" [{_num(p.interval[0])}, {_num(p.interval[1])}]"
    return text + f" n={p.readings}{' sim' if p.source == 'simulated' else ''}"


def _efficiency(p: Point) -> str:
    if p.efficiency is None:
        return "—"
    if p.efficiency_interval:
        return f"{_pct(p.efficiency)} [{_pct(p.efficiency_interval[0])}, {_pct(p.efficiency_interval[1])}]"
    return _pct(p.efficiency)


def _projected(p: Point) -> str:
    if p.projected_tokens_per_s_per_device is None:
        return "—"
    err = p.projection_error
    return _num(p.projected_tokens_per_s_per_device) + ("" if err is None else f" ({100 * err:+.1f} %)")


def write_scaling_files(summary: ScalingSummary, directory: Path, context: dict[str, Any]) -> list[Path]:
    """``scaling.json`` (the summary and ``context``: the study, the sizes, the modes) and
    ``scaling.png``; a plot that cannot be drawn is skipped with a log line."""
    directory.mkdir(parents=True, exist_ok=True)
    data = {**context, **summary.to_json()}
    path = directory / "scaling.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    written = [path]
    try:
        written.append(_plot(summary, directory / "scaling.png"))
    except Exception as exc:  # matplotlib missing or a degenerate curve: the table and JSON stand
        log.info("scaling plot skipped: %s", exc)
    return written


def _plot(summary: ScalingSummary, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (eff_ax, comm_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    for (trial, mode), curve in summary.curves().items():
        pts = [p for p in curve if p.efficiency is not None]
        if not pts:
            continue
        devices = [p.size.devices for p in pts]
        line = eff_ax.plot(devices, [p.efficiency for p in pts], marker="o", label=f"trial {trial}, {mode}")[0]
        lows = [p.efficiency_interval[0] if p.efficiency_interval else p.efficiency for p in pts]
        highs = [p.efficiency_interval[1] if p.efficiency_interval else p.efficiency for p in pts]
        eff_ax.fill_between(devices, lows, highs, color=line.get_color(), alpha=0.15)
        ref = pts[0].tokens_per_s_per_device
        proj = [
            (p.size.devices, p.projected_tokens_per_s_per_device / ref)
            for p in pts
            if p.projected_tokens_per_s_per_device
        ]
        if proj and ref:
            eff_ax.plot(
                [pts[0].size.devices] + [d for d, _ in proj],
                [1.0] + [e for _, e in proj],
                linestyle="--",
                color=line.get_color(),
                alpha=0.7,
                label=f"trial {trial}, {mode}: projected",
            )
        comm = [(p.size.devices, p.comm_fraction) for p in pts if p.comm_fraction is not None]
        if comm:
            comm_ax.plot([d for d, _ in comm], [100 * c for _, c in comm], marker="o", label=f"trial {trial}, {mode}")
    eff_ax.axhline(1.0, color="grey", linewidth=1, linestyle=":", label="linear")
    ticks = sorted({p.size.devices for p in summary.points})
    for ax in (eff_ax, comm_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("devices")
        ax.grid(True, alpha=0.3)
    eff_ax.set_ylabel("efficiency vs the smallest size")
    eff_ax.set_ylim(bottom=0)
    comm_ax.set_ylabel("share of the step (%)")
    comm_ax.set_ylim(bottom=0)
    source = "simulated (the analytical model)" if summary.simulated else "measured"
    eff_ax.set_title(f"scaling efficiency, {source}", fontsize=10)
    comm_ax.set_title("communication share", fontsize=10)
    eff_ax.legend(fontsize=7)
    if comm_ax.lines:
        comm_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_scaling(tracker: Any, parent_run_id: str, summary: ScalingSummary, files: list[Path]) -> None:
    """The scaling figures as the study's parent run's metrics (``scaling_efficiency_<mode>_<devices>``
    and ``comm_fraction_<mode>_<devices>`` of its recommended config) and the files as its
    ``scaling/`` artifacts."""
    tracker.parent_run_id = parent_run_id
    curves = summary.curves()
    first = next(iter(curves))[0] if curves else None  # the recommended config: planned first
    metrics: dict[str, float] = {}
    for (trial, mode), curve in curves.items():
        if trial != first:
            continue
        for p in curve:
            if p.efficiency is not None:
                metrics[f"scaling_efficiency_{mode}_{p.size.devices}"] = p.efficiency
            if p.comm_fraction is not None:
                metrics[f"comm_fraction_{mode}_{p.size.devices}"] = p.comm_fraction
    tracker.log_parent(metrics=metrics, artifacts=files, artifact_path="scaling")
