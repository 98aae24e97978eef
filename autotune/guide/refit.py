"""Refit the performance model from measured probes, as a study runs.

The simulator prices a training step as a sum of components (``time_gemm``, ``time_tp_comm``,
...). A real device departs from its profile term by term: its GEMMs run at another efficiency
than the profile says, its memory-bound kernels at another bandwidth, its tensor-parallel
collectives pay another latency, its pipeline another bubble, its gradient reduction another
bandwidth. One global scale cannot fix a ranking: a slow ``tp = 2`` probe would slow every config
down alike. So the refit keeps one factor per group of terms (``GROUPS``): compute, memory,
tensor-parallel communication, pipeline and data-parallel communication. A group that a probe
exercises is corrected by it; one slow ``tp = 2`` probe corrects every ``tp = 2`` config through
the ``tp`` factor and leaves ``tp = 1`` configs (which have no such term) alone.

The fit: least squares on the relative step-time error (a 10 % miss counts the same on a fast and
a slow config), with a ridge pulling every factor toward the common factor (the median
measured/predicted ratio). A group no measured config exercises keeps the common factor; groups
that always move together (compute and memory on one device) share the correction between them.

The raw prediction is always kept; refitted values are added beside it with a ``refit_`` prefix,
so later fits never feed on their own output. The fit is derived from the study's trials each
time (nothing to store, nothing to lose on a crash).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

__all__ = ["Refit", "fit_refit", "GROUPS", "COMPONENTS", "COMM_GROUPS", "RIDGE_DATA_SHEET", "RIDGE_MEASURED"]

# The simulator's time components, grouped by what a real machine gets wrong together.
GROUPS: dict[str, tuple[str, ...]] = {
    "compute": ("gemm", "attention", "recompute", "launch"),
    "memory": ("elementwise", "optimizer"),
    "tp": ("tp_comm", "cp_comm"),
    "pipeline": ("pp_bubble", "pp_p2p"),
    "dp": ("dp_comm", "zero3_comm"),
}
# Every component of GROUPS, in the order the guide's design matrix has always used.
COMPONENTS = (
    "gemm",
    "attention",
    "elementwise",
    "launch",
    "recompute",
    "optimizer",
    "pp_bubble",
    "tp_comm",
    "cp_comm",
    "pp_p2p",
    "dp_comm",
    "zero3_comm",
)
_FACTOR_RANGE = (0.02, 50.0)
# Ridge weight on each log factor's distance from the common factor, against a data term of squared
# relative errors; it says how far the profile is trusted. A data-sheet profile can be off by 10x
# where it matters (small-message latency: the issue #17 CPU priced tensor parallelism nearly free
# where it halved the throughput), so a group worth a few % of one step is still mostly fitted from
# the data (0.003: a factor of e away from the common one costs a 5 % miss). A measured profile
# (`autotune calibrate`) is off by tens of %, and a probe's own noise (±15-45 % run to run on a
# shared 2-core machine) must not become a 40x factor on a group worth 1 % of that probe's step
# (it did at 0.003: benchmarks/README.md, rank fidelity); 0.03: a factor of e costs a 17 % miss.
RIDGE_DATA_SHEET = 0.003
RIDGE_MEASURED = 0.03
_LOG_RANGE = math.log(50.0)


@dataclass(frozen=True)
class Refit:
    """Multipliers on the predicted time of each group of ``GROUPS``, from ``n`` measurements."""

    factors: dict[str, float] = field(default_factory=lambda: {g: 1.0 for g in GROUPS})
    n: int = 0
    mape_before: float | None = None  # % error of the raw predictions on the fitted measurements
    mape_after: float | None = None

    @property
    def compute(self) -> float:
        return self.factors.get("compute", 1.0)

    def describe(self) -> str:
        """``compute x1.2, memory x0.9, tp x3.1, ...`` (the factors in ``GROUPS`` order)."""
        return ", ".join(f"{g} x{self.factors.get(g, 1.0):.3g}" for g in GROUPS)

    def apply(self, predicted: dict[str, Any]) -> dict[str, float]:
        """``refit_`` versions of the time-derived metrics of one prediction (empty without a
        time breakdown or before any measurement)."""
        parts = _parts(predicted)
        if self.n == 0 or parts is None or sum(parts.values()) <= 0:
            return {}
        raw = sum(parts.values())
        step = sum(self.factors.get(g, 1.0) * t for g, t in parts.items())
        speedup = raw / step
        out = {"refit_step_time_s": step}
        for key in ("tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu"):
            value = predicted.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[f"refit_{key}"] = float(value) * speedup
        return out

    def as_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"refit_{g}_factor": self.factors.get(g, 1.0) for g in GROUPS}
        out["refit_measurements"] = self.n
        if self.mape_before is not None:
            out["refit_mape_before_pct"] = self.mape_before
        if self.mape_after is not None:
            out["refit_mape_after_pct"] = self.mape_after
        return out


def _parts(predicted: dict[str, Any]) -> dict[str, float] | None:
    """Predicted seconds per group, or None without a time breakdown."""
    if not any(f"time_{k}" in predicted for k in COMPONENTS):
        return None
    return {g: sum(float(predicted.get(f"time_{k}", 0.0) or 0.0) for k in names) for g, names in GROUPS.items()}


def _fit_log_factors(a: np.ndarray, ridge: float) -> np.ndarray:
    """``u`` minimising ``sum_i (sum_g a_ig exp(u_g) - 1)^2 + RIDGE * |u|^2`` (Gauss-Newton): the
    log of each group's factor relative to the common one; ``a_ig`` is group g's share of
    measurement i at the common factor. In log space the ridge treats a 2x miss alike in every
    group, however small its share of the step is before the correction."""
    u = np.zeros(a.shape[1])
    for _ in range(200):
        scale = np.exp(u)
        residual = a @ scale - 1.0
        jac = a * scale[None, :]
        lhs = jac.T @ jac + ridge * np.eye(len(u))
        rhs = -(jac.T @ residual + ridge * u)
        step = np.linalg.solve(lhs, rhs)
        # a factor at its range's end that the step pushes further out is held there, and the step
        # solved for the others (projected Gauss-Newton): solving for all of them and clipping
        # made the free ones overshoot and cycle to the 200-step cap
        held = (np.abs(u) >= _LOG_RANGE - 1e-12) & (np.sign(step) == np.sign(u))
        if held.any():
            free = ~held
            step = np.zeros_like(u)
            if free.any():
                step[free] = np.linalg.solve(lhs[np.ix_(free, free)], rhs[free])
        step = np.clip(step, -1.0, 1.0)  # damped: one e-fold per iteration at most
        moved = np.clip(u + step, -_LOG_RANGE, _LOG_RANGE)
        # converged when u stops moving (the cap of 200 steps per refit, after every measured trial,
        # was 19 ms a trial of the loop's 38 with factors pinned: benchmarks/orchestration_overhead.py)
        change, u = float(np.max(np.abs(moved - u))), moved
        if change < 1e-10:
            break
    return u


# Groups whose time a probe's profiled step reports as communication (``comm_time_s``: a
# collective in flight, waiting for a pipeline peer included).
COMM_GROUPS = ("tp", "pipeline", "dp")


def _measured(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 and math.isfinite(value) else None


def fit_refit(pairs: Iterable[tuple[Any, ...]], ridge: float = RIDGE_DATA_SHEET) -> Refit:
    """Fit from (raw prediction with its ``time_*`` breakdown, measured step time[, measured
    communication time]) tuples. A probe that profiled its step (``comm_time_s``) adds a second
    equation: the communication groups' predicted time against the measured one, so the error is
    split between compute and communication by measurement, not only by the ridge. ``ridge``:
    ``RIDGE_MEASURED`` when the predictions come from a calibrated profile."""
    rows = []
    for predicted, measured, *breakdown in pairs:
        parts = _parts(predicted)
        step = _measured(measured)
        if parts is None or step is None or sum(parts.values()) <= 0:
            continue
        rows.append(([parts[g] for g in GROUPS], step, True))
        comm = _measured(breakdown[0]) if breakdown else None
        if comm is not None and sum(parts[g] for g in COMM_GROUPS) > 0:
            rows.append(([parts[g] if g in COMM_GROUPS else 0.0 for g in GROUPS], comm, False))
    steps = [r for r in rows if r[2]]
    if not steps:
        return Refit()
    x = np.array([r[0] for r in rows])
    measured = np.array([r[1] for r in rows])
    is_step = np.array([r[2] for r in rows])
    raw = x.sum(axis=1)
    common = float(np.clip(statistics.median(measured[is_step] / raw[is_step]), *_FACTOR_RANGE))
    f = common * np.exp(_fit_log_factors(x / measured[:, None] * common, ridge))
    f = np.clip(f, *_FACTOR_RANGE)
    xs, ms = x[is_step], measured[is_step]
    before = float(np.mean(np.abs(xs.sum(axis=1) - ms) / ms) * 100)
    after = float(np.mean(np.abs(xs @ f - ms) / ms) * 100)
    return Refit(factors={g: float(v) for g, v in zip(GROUPS, f)}, n=len(steps), mape_before=before, mape_after=after)
