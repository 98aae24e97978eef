"""Refit the performance model from measured probes, as a study runs.

The simulator prices a training step as a sum of components (``time_gemm``, ``time_tp_comm``,
...). A real device departs from its profile mostly in two ways: it computes at a different
efficiency than the profile says, and its collectives run at a different bandwidth. So the refit
has two factors — one for every compute component (GEMM, attention, element-wise, recompute,
optimizer, launch, and the pipeline bubble, which is idle compute time), one for every
communication component — fitted to measured step times by least squares on the relative error
(a 10 % miss counts the same on a fast and a slow config). With fewer than three measurements,
or when the measured configs hardly communicate, the two factors cannot be told apart and one
common factor (the median measured/predicted ratio) is used.

The raw prediction is always kept; refitted values are added beside it with a ``refit_`` prefix,
so later fits never feed on their own output. The fit is derived from the study's trials each
time (nothing to store, nothing to lose on a crash).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

__all__ = ["Refit", "fit_refit", "COMPUTE_COMPONENTS", "COMM_COMPONENTS"]

COMPUTE_COMPONENTS = ("gemm", "attention", "elementwise", "launch", "recompute", "optimizer", "pp_bubble")
COMM_COMPONENTS = ("tp_comm", "cp_comm", "pp_p2p", "dp_comm", "zero3_comm")
_FACTOR_RANGE = (0.02, 50.0)
_MIN_COMM_SHARE = 0.02  # below this share of the predicted step, communication cannot be fitted apart


@dataclass(frozen=True)
class Refit:
    """Multipliers on the predicted compute and communication time, from ``n`` measurements."""

    compute: float = 1.0
    comm: float = 1.0
    n: int = 0
    mape_before: float | None = None  # % error of the raw predictions on the fitted measurements
    mape_after: float | None = None

    def apply(self, predicted: dict[str, Any]) -> dict[str, float]:
        """``refit_`` versions of the time-derived metrics of one prediction (empty without a
        time breakdown or before any measurement)."""
        parts = _parts(predicted)
        if self.n == 0 or parts is None or parts[0] + parts[1] <= 0:
            return {}
        compute, comm = parts
        raw = compute + comm
        step = self.compute * compute + self.comm * comm
        speedup = raw / step
        out = {"refit_step_time_s": step}
        for key in ("tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu"):
            value = predicted.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                out[f"refit_{key}"] = float(value) * speedup
        return out

    def as_metrics(self) -> dict[str, float]:
        out = {"refit_compute_factor": self.compute, "refit_comm_factor": self.comm, "refit_measurements": self.n}
        if self.mape_before is not None:
            out["refit_mape_before_pct"] = self.mape_before
        if self.mape_after is not None:
            out["refit_mape_after_pct"] = self.mape_after
        return out


def _parts(predicted: dict[str, Any]) -> tuple[float, float] | None:
    if not any(f"time_{k}" in predicted for k in COMPUTE_COMPONENTS):
        return None
    compute = sum(float(predicted.get(f"time_{k}", 0.0) or 0.0) for k in COMPUTE_COMPONENTS)
    comm = sum(float(predicted.get(f"time_{k}", 0.0) or 0.0) for k in COMM_COMPONENTS)
    return compute, comm


def fit_refit(pairs: Iterable[tuple[dict[str, Any], float]]) -> Refit:
    """Fit from (raw prediction with its ``time_*`` breakdown, measured step time) pairs."""
    rows = []
    for predicted, measured in pairs:
        parts = _parts(predicted)
        if parts is None or not (isinstance(measured, (int, float)) and measured > 0 and math.isfinite(measured)):
            continue
        if parts[0] + parts[1] > 0:
            rows.append((parts[0], parts[1], float(measured)))
    if not rows:
        return Refit()
    compute = np.array([r[0] for r in rows])
    comm = np.array([r[1] for r in rows])
    measured = np.array([r[2] for r in rows])
    raw = compute + comm
    common = float(np.clip(statistics.median(measured / raw), *_FACTOR_RANGE))
    a = b = common
    if len(rows) >= 3 and float(np.median(comm / raw)) >= _MIN_COMM_SHARE:
        design = np.stack([compute / measured, comm / measured], axis=1)
        (fa, fb), *_ = np.linalg.lstsq(design, np.ones(len(rows)), rcond=None)
        if fa > 0 and fb > 0:
            a, b = (float(np.clip(f, *_FACTOR_RANGE)) for f in (fa, fb))
    before = float(np.mean(np.abs(raw - measured) / measured) * 100)
    after = float(np.mean(np.abs(a * compute + b * comm - measured) / measured) * 100)
    return Refit(compute=a, comm=b, n=len(rows), mape_before=before, mape_after=after)
