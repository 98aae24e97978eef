"""The study's plots: history per objective, the Pareto front with several, the importances.

Each is written twice: a PNG (a few tens of kB, what MLflow previews at once) and an interactive,
self-contained HTML (plotly inlined: clusters are often offline). Split from :mod:`autotune.finish.report`
(the report's text and tables) because it is the one part that imports matplotlib and plotly,
lazily, on the way out of a study. (The serving study's own plots: :mod:`autotune.tracking.serving_plots`.)
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

__all__ = ["write_plots"]

log = logging.getLogger(__name__)


def write_plots(
    study: Any, out_dir: Path, objectives: list[tuple[str, str]], importances: dict[str, dict[str, float]] | None = None
) -> list[Path]:
    """The study's plots, each twice: a PNG (a few tens of kB, what MLflow previews at once) and
    an interactive, self-contained HTML for the run directory (plotly inlined: clusters are
    often offline, so ~5 MB each). History per objective, the Pareto front with several, and
    the importances drawn from ``importances`` (the study's one computation, so the plot says
    what the report and MLflow say). A plot that cannot be drawn is skipped with a log line."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, (png, html) in _plot_makers(study, objectives, importances or {}).items():
        try:
            written.append(png(out_dir / f"{name}.png"))
            html(out_dir / f"{name}.html")
        except Exception as exc:  # optuna raises for studies it cannot plot (e.g. one trial)
            log.info("plot %s skipped: %s", name, exc)
    return written


def _plot_makers(
    study: Any, objectives: list[tuple[str, str]], importances: dict[str, dict[str, float]]
) -> dict[str, tuple[Any, Any]]:
    import optuna.visualization as vis
    import optuna.visualization.matplotlib as mvis

    def save_png(make: Any) -> Any:
        def write(path: Path) -> Path:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            with warnings.catch_warnings():  # optuna marks its matplotlib plots experimental
                warnings.simplefilter("ignore")
                ax = make()
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 4.5)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            return path

        return write

    def save_html(make: Any) -> Any:
        return lambda path: make().write_html(str(path), include_plotlyjs=True)

    names = [m for m, _ in objectives]
    makers: dict[str, tuple[Any, Any]] = {}
    if len(objectives) > 1:
        makers["pareto_front"] = (
            save_png(lambda: mvis.plot_pareto_front(study, target_names=names)),
            save_html(lambda: vis.plot_pareto_front(study, target_names=names)),
        )
    for i, name in enumerate(names):
        suffix = "" if len(names) == 1 else f"_{name}"

        def target(t, i=i):
            return t.values[i]

        makers[f"optimization_history{suffix}"] = (
            save_png(
                lambda target=target, name=name: mvis.plot_optimization_history(study, target=target, target_name=name)
            ),
            save_html(
                lambda target=target, name=name: vis.plot_optimization_history(study, target=target, target_name=name)
            ),
        )
        if importances.get(name):
            makers[f"param_importances{suffix}"] = (
                _importance_png(importances[name], name),
                _importance_html(importances[name], name),
            )
    return makers


def _importance_png(values: dict[str, float], metric: str) -> Any:
    def write(path: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        items = sorted(values.items(), key=lambda kv: kv[1])
        fig, ax = plt.subplots(figsize=(8, 0.35 * len(items) + 1.2))
        ax.barh([k for k, _ in items], [v for _, v in items])
        ax.set_xlabel(f"importance for {metric}")
        ax.set_title("parameter importances")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    return write


def _importance_html(values: dict[str, float], metric: str) -> Any:
    def write(path: Path) -> None:
        import plotly.graph_objects as go

        items = sorted(values.items(), key=lambda kv: kv[1])
        fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h"))
        fig.update_layout(title="parameter importances", xaxis_title=f"importance for {metric}")
        fig.write_html(str(path), include_plotlyjs=True)

    return write
