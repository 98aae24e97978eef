"""What a scaling study's readings say: per config, mode and size, the throughput with its
interval and count, the scaling efficiency against linear from the smallest size measured, the
communication share and the peak memory; and, from the smallest size, the model's projection to
every larger one beside what was measured there (the projection's own validation).

Pure: readings and the model's points in, a :class:`ScalingSummary` out (its rows and its JSON),
so the table, the plot, MLflow and ``--json`` all say the same.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from autotune.objectives.intervals import mean_interval
from autotune.objectives.scaling import efficiency_interval, scaling_efficiency

from .measure import Reading
from ..guide.projection import ModelPoint, projected_step
from .sizes import Size

__all__ = ["Point", "ScalingSummary", "summarise"]


@dataclass
class Point:
    """One config at one size in one mode."""

    trial: int
    mode: str
    size: Size
    readings: int = 0  # successful readings
    source: str = ""
    tokens_per_s_per_device: float | None = None
    interval: tuple[float, float] | None = None  # of tokens/s/device, from the readings
    step_time_s: float | None = None
    comm_fraction: float | None = None
    peak_memory_gib: float | None = None
    failed: str = ""  # why no reading succeeded (the last failure's status and reason)
    skipped: str = ""  # why the layout cannot run at this size
    efficiency: float | None = None
    efficiency_interval: tuple[float, float] | None = None
    projected_tokens_per_s_per_device: float | None = None  # from the smallest size, by the model
    model: ModelPoint | None = None  # the calibrated model's step at this size

    @property
    def projection_error(self) -> float | None:
        """projected / measured - 1 (None without both)."""
        if self.projected_tokens_per_s_per_device is None or not self.tokens_per_s_per_device:
            return None
        return self.projected_tokens_per_s_per_device / self.tokens_per_s_per_device - 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "trial": self.trial,
            "mode": self.mode,
            **self.size.to_json(),
            "readings": self.readings,
            "source": self.source,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "tokens_per_s_per_device_ci": list(self.interval) if self.interval else None,
            "step_time_s": self.step_time_s,
            "comm_fraction": self.comm_fraction,
            "peak_memory_gib": self.peak_memory_gib,
            "scaling_efficiency": self.efficiency,
            "scaling_efficiency_ci": list(self.efficiency_interval) if self.efficiency_interval else None,
            "projected_tokens_per_s_per_device": self.projected_tokens_per_s_per_device,
            "projection_error": self.projection_error,
            "model": self.model.to_json() if self.model is not None else None,
            "failed": self.failed or None,
            "skipped": self.skipped or None,
        }


@dataclass
class ScalingSummary:
    points: list[Point] = field(default_factory=list)

    @property
    def simulated(self) -> bool:
        return any(p.source == "simulated" for p in self.points)

    def curves(self) -> dict[tuple[int, str], list[Point]]:
        """The points of each (trial, mode), smallest size first."""
        out: dict[tuple[int, str], list[Point]] = {}
        for p in self.points:
            out.setdefault((p.trial, p.mode), []).append(p)
        return {k: sorted(v, key=lambda p: (p.size.devices, p.size.nodes)) for k, v in out.items()}

    def projection_errors(self) -> list[float]:
        return [e for p in self.points if (e := p.projection_error) is not None]

    def to_json(self) -> dict[str, Any]:
        errors = [abs(e) for e in self.projection_errors()]
        return {
            "source": "simulated" if self.simulated else "measured",
            "points": [p.to_json() for p in self.points],
            "projection": {
                "compared": len(errors),
                "median_abs_error": statistics.median(errors) if errors else None,
                "max_abs_error": max(errors) if errors else None,
            },
        }


def summarise(
    planned: Sequence[tuple[int, str, Size, str]],
    readings: Sequence[Reading],
    models: dict[tuple[int, str, str], ModelPoint | None],
) -> ScalingSummary:
    """``planned``: (trial, mode, size, why it cannot run there or "") for every point asked for;
    ``models``: the model's point per (trial, mode, size label)."""
    summary = ScalingSummary()
    for trial, mode, size, skipped in planned:
        point = Point(trial, mode, size, skipped=skipped)
        mine = [r for r in readings if (r.trial, r.mode, r.size) == (trial, mode, size)]
        ok = [r for r in mine if r.status == "ok" and r.metrics.get("tokens_per_s_per_device")]
        model = models.get((trial, mode, size.label))
        point.model = model
        if ok:
            values = [r.metrics["tokens_per_s_per_device"] for r in ok]
            point.readings, point.source = len(ok), ok[0].source
            point.tokens_per_s_per_device = statistics.fmean(values)
            point.interval = mean_interval(values)
            point.step_time_s = _mean(r.metrics.get("step_time_s") for r in ok)
            point.comm_fraction = _mean(r.metrics.get("comm_fraction") for r in ok)
            point.peak_memory_gib = max((r.metrics.get("peak_memory_gib") or 0.0 for r in ok), default=None) or None
        elif mine and not skipped:
            last = mine[-1]
            point.failed = f"{last.status}: {last.reason}"[:300]
        summary.points.append(point)
    for (trial, mode), curve in summary.curves().items():
        measured = [p for p in curve if p.tokens_per_s_per_device]
        if not measured:
            continue
        ref = measured[0]
        ref_model = models.get((trial, mode, ref.size.label))
        for p in curve:
            if not p.tokens_per_s_per_device:
                continue
            p.efficiency = scaling_efficiency(p.tokens_per_s_per_device, ref.tokens_per_s_per_device)
            if p is ref:
                continue  # 1.0 by definition: no interval
            p.efficiency_interval = efficiency_interval(
                p.tokens_per_s_per_device, p.interval, ref.tokens_per_s_per_device, ref.interval
            )
        for p in curve:
            target_model = models.get((trial, mode, p.size.label))
            if p.size.devices <= ref.size.devices or p.skipped or p.failed:
                continue  # projected up from the smallest size measured, where the config ran
            if ref_model is None or target_model is None or not ref.step_time_s:
                continue
            step = projected_step(ref.step_time_s, ref.comm_fraction, ref_model, target_model)
            p.projected_tokens_per_s_per_device = target_model.tokens_per_s_per_device(step)
    return summary


def _mean(values: Any) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.fmean(xs) if xs else None
