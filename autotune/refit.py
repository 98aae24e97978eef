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

__all__ = ["Refit", "fit_refit", "GROUPS", "COMPONENTS"]

# The simulator's time components, grouped by what a real machine gets wrong together.
GROUPS: dict[str, tuple[str, ...]] = {
    "compute": ("gemm", "attention", "recompute", "launch"),
    "memory": ("elementwise", "optimizer"),
    "tp": ("tp_comm", "cp_comm"),
    "pipeline": ("pp_bubble", "pp_p2p"),
    "dp": ("dp_comm", "zero3_comm"),
}
# Every component of GROUPS, in the order the guide's design matrix has always used.
COMPONENTS = ("gemm", "attention", "elementwise", "launch", "recompute", "optimizer", "pp_bubble",
              "tp_comm", "cp_comm", "pp_p2p", "dp_comm", "zero3_comm")
_FACTOR_RANGE = (0.02, 50.0)
# Ridge weight on each log factor's distance from the common factor, against a data term of squared
# relative errors: a group worth 10 % of one measured step (0.01 in that term) is mostly fitted
# from the data; a group no probe exercises stays at the common factor.
_RIDGE = 0.003
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


def _fit_log_factors(a: np.ndarray) -> np.ndarray:
    """``u`` minimising ``sum_i (sum_g a_ig exp(u_g) - 1)^2 + RIDGE * |u|^2`` (Gauss-Newton): the
    log of each group's factor relative to the common one; ``a_ig`` is group g's share of
    measurement i at the common factor. In log space the ridge treats a 2x miss alike in every
    group, however small its share of the step is before the correction."""
    u = np.zeros(a.shape[1])
    for _ in range(200):
        scale = np.exp(u)
        residual = a @ scale - 1.0
        jac = a * scale[None, :]
        lhs = jac.T @ jac + _RIDGE * np.eye(len(u))
        step = np.linalg.solve(lhs, -(jac.T @ residual + _RIDGE * u))
        step = np.clip(step, -1.0, 1.0)  # damped: one e-fold per iteration at most
        u = np.clip(u + step, -_LOG_RANGE, _LOG_RANGE)
        if float(np.max(np.abs(step))) < 1e-10:
            break
    return u


def fit_refit(pairs: Iterable[tuple[dict[str, Any], float]]) -> Refit:
    """Fit from (raw prediction with its ``time_*`` breakdown, measured step time) pairs."""
    rows = []
    for predicted, measured in pairs:
        parts = _parts(predicted)
        if parts is None or not (isinstance(measured, (int, float)) and measured > 0 and math.isfinite(measured)):
            continue
        if sum(parts.values()) > 0:
            rows.append(([parts[g] for g in GROUPS], float(measured)))
    if not rows:
        return Refit()
    x = np.array([r[0] for r in rows])
    measured = np.array([r[1] for r in rows])
    raw = x.sum(axis=1)
    common = float(np.clip(statistics.median(measured / raw), *_FACTOR_RANGE))
    f = common * np.exp(_fit_log_factors(x / measured[:, None] * common))
    f = np.clip(f, *_FACTOR_RANGE)
    before = float(np.mean(np.abs(raw - measured) / measured) * 100)
    after = float(np.mean(np.abs(x @ f - measured) / measured) * 100)
    return Refit(factors={g: float(v) for g, v in zip(GROUPS, f)}, n=len(rows), mape_before=before, mape_after=after)
