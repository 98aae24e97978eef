"""A serving trial's latency against the offered rate, as a picture for its MLflow run.

The probe bisects a ladder of rates; what a reader wants from that is where the latency bends up
and where it crosses the SLO. One figure per trial: p99 TTFT and p99 TPOT against the rates tried
(with the targets as lines), and the goodput on the same rates. Written with matplotlib's Agg
backend (no display on a driver node); pure: rates in, a PNG file out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["latency_vs_rate_plot", "PLOT_NAME"]

PLOT_NAME = "latency_vs_rate.png"


def latency_vs_rate_plot(rates: list[dict[str, Any]], slo: dict[str, Any], path: Path) -> Path | None:
    """Draw ``rates`` (the probe's ``info["serving"]["rates"]``) into ``path``; None when there is
    nothing to draw (no rate measured) or matplotlib is missing."""
    points = sorted((r for r in rates if isinstance(r.get("rate"), (int, float))), key=lambda r: r["rate"])
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [float(r["rate"]) for r in points]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for ax, key, target, title in (
        (axes[0], "ttft_p99_ms", slo.get("ttft_p99_ms"), "TTFT p99 (ms)"),
        (axes[1], "tpot_p99_ms", slo.get("tpot_p99_ms"), "TPOT p99 (ms)"),
    ):
        y = [_num(r.get(key)) for r in points]
        ax.plot(x, y, marker="o")
        for xi, yi, r in zip(x, y, points):
            ax.annotate(
                "met" if r.get("slo_met") else "missed", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
        if target:
            ax.axhline(float(target), color="red", linestyle="--", label=f"SLO {float(target):g} ms")
            ax.legend(fontsize=8)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title, fontsize=10)
    axes[2].plot(x, [_num(r.get("goodput_rps")) for r in points], marker="o", label="goodput")
    axes[2].plot(x, x, color="grey", linestyle=":", label="offered")
    axes[2].set_xlabel("offered rate (req/s)")
    axes[2].set_title("goodput (req/s meeting the SLO)", fontsize=10)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else float("nan")
