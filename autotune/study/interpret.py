"""What a probe's result means for the study: the trial's status, its metrics, and what to tell
Optuna. Pure: no Optuna, no Ray, no files; unit-tested on plain values (tests/test_interpret.py).

- the metrics kept are the probe's, with the peak memory of every step (a config that peaks in
  its first step needs that memory too) and the derived ones (tokens/s per device, MFU, headroom:
  :func:`autotune.objectives.derive_metrics`), never replacing what the probe measured;
- a measurement that cannot be real (a negative time, MFU above 100 %) is a ``crash`` with the
  reason, and never the best (:mod:`autotune.sanity`);
- a result with no value for an objective is a ``crash``;
- Optuna is told values for ``ok``; an infeasible mark and a penalty for ``oom``/``invalid``/
  ``nan`` (constraint-aware samplers learn the region); ``PRUNED`` for a pruned trial; ``FAIL``
  otherwise. An ``infra`` failure is the machine's, never the config's: it is retried (or, when
  the cluster lost the capacity, queued for the re-run), never fed to the search as bad.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from autotune.workers.parameters import instance_devices, value
from autotune.workers.protocol import ProbeResult

from ..sanity import is_finite_number as _finite

__all__ = [
    "Interpretation",
    "interpret",
    "penalty",
    "settle_pruned",
    "step_intervals",
    "step_peak_memory",
    "measured_step_times",
]


@dataclass
class Interpretation:
    status: str  # the trial's
    reason: str
    metrics: dict[str, Any]
    tell: str  # values | infeasible | pruned | fail
    values: list[float] | None = None
    retry: str | None = None  # infra (retry once) | capacity_lost (queue for the re-run)
    capacity_lost: list[str] = field(default_factory=list)
    probe_status: str = ""  # what the probe's result file records (before a missing objective)
    probe_reason: str = ""


def penalty(objectives: list[tuple[str, str]]) -> list[float]:
    """Objective values told for infeasible trials. They are marked infeasible by constraint,
    so constraint-aware samplers rank them below every feasible trial whatever the value."""
    return [0.0 if d == "maximize" else 1e9 for _, d in objectives]


def interpret(
    config: dict[str, Any], result: ProbeResult, context: Any, objectives: list[tuple[str, str]], devices: int
) -> Interpretation:
    """The study's reading of ``result`` for ``config`` (``context``: the probe context's model,
    workload and hardware; ``devices``: the trial's device count)."""
    metrics = dict(result.metrics)
    step_peak = step_peak_memory(result.steps)
    if step_peak is not None and not (
        _finite(metrics.get("peak_memory_gib")) and metrics["peak_memory_gib"] >= step_peak
    ):
        metrics["peak_memory_gib"] = step_peak  # the peak of every step, not only the end state
    status, reason = result.status, result.reason
    if result.ok and result.source != "simulated":
        from autotune.objectives import derive_metrics

        from ..sanity import implausible_metrics

        precision = value(config, "precision")
        for k, v in derive_metrics(
            metrics,
            context.model,
            context.workload,
            context.hardware,
            devices,
            precision,
            cost_per_device_hour=context.cluster.get("cost_per_device_hour"),
            instance_devices=instance_devices(config),
        ).items():
            metrics.setdefault(k, v)
        metrics.update(step_intervals(metrics, result.steps))  # after the derived: tokens/s, MFU
        problems = implausible_metrics(metrics, context.model, context.workload, context.hardware, precision)
        if problems:
            status, reason = "crash", "implausible metrics from the probe: " + "; ".join(problems)
    out = Interpretation(status, reason, metrics, "fail", probe_status=status, probe_reason=reason)
    missing = [m for m, _ in objectives if status == "ok" and not _finite(metrics.get(m))]
    if missing:
        out.status, out.reason = "crash", f"probe reported no value for objective(s) {missing}"
    elif status == "ok":
        out.tell, out.values = "values", [float(metrics[m]) for m, _ in objectives]
    elif status in ("oom", "invalid", "nan", "oom_predicted"):
        out.tell, out.values = "infeasible", penalty(objectives)
    elif status == "pruned":
        out.tell = "pruned"
    elif status == "infra":  # a node or worker died: never fed to the search as a bad config
        lost = result.info.get("capacity_lost")
        out.retry, out.capacity_lost = ("capacity_lost", list(lost)) if lost else ("infra", [])
    return out


def settle_pruned(result: ProbeResult, live_steps: list[dict[str, Any]], because: str | None) -> None:
    """A trial the loop stopped early: its reason is why, and its partial measurement (the steps
    that streamed before it was stopped) is kept."""
    if result.status != "pruned" or not because:
        return
    result.reason = because
    if not result.steps:  # a Ray task cancelled mid-run returns none: keep what streamed
        result.steps = live_steps
    times = measured_step_times(result.steps)
    if times and "step_time_s" not in result.metrics:  # the partial measurement
        result.metrics = {
            **result.metrics,
            "step_time_s": statistics.median(times),
            "measured_steps": float(len(times)),
        }


def step_peak_memory(steps: list[dict[str, Any]]) -> float | None:
    """The highest memory any step reported (``memory_gib`` / ``peak_memory_gib``), warm-up included:
    a config that peaks in its first step needs that memory too."""
    values = [float(e[k]) for e in steps for k in ("memory_gib", "peak_memory_gib") if _finite(e.get(k))]
    return max(values) if values else None


def step_intervals(metrics: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, float]:
    """The within-run interval (95 %) of the step time and of every throughput the probe reported,
    from its measured steps (issue 44), with their count ``n_steps``: empty with fewer than two
    steps. The spread between runs is usually larger: a repeat of the config measures that."""
    from autotune.objectives.intervals import PER_STEP_TIME, ci_keys, mean_interval, throughput_interval

    times = measured_step_times(steps)
    step = metrics.get("step_time_s")
    if len(times) < 2 or not _finite(step):
        return {}
    out: dict[str, float] = {"n_steps": float(len(times))}
    interval = mean_interval(times)
    if interval is not None:
        out.update(zip(ci_keys("step_time_s"), interval))
    for name in PER_STEP_TIME:
        if _finite(metrics.get(name)):
            interval = throughput_interval(float(metrics[name]), float(step), times)
            if interval is not None:
                out.update(zip(ci_keys(name), interval))
    return out


def measured_step_times(steps: list[dict[str, Any]]) -> list[float]:
    """Step times of the measured phase (all steps when the probe names no phases)."""
    phased = any("phase" in e for e in steps)
    return [
        float(e["step_time_s"])
        for e in steps
        if _finite(e.get("step_time_s")) and (not phased or e.get("phase") == "measure")
    ]
