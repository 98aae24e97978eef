"""Scaling figures (issue 45): how a config's throughput holds as the cluster grows.

Installed as ``autotune.objectives.scaling``. Pure definitions over plain numbers:

- ``scaling_efficiency`` (fraction, maximize): tokens/s per device at a size over tokens/s per
  device at the reference size (the smallest measured), i.e. the speed-up over the devices'
  ratio. 1.0 is linear; the Ascend tuning guides' acceptance "32-card linear speed-up >= 80 %" is
  ``scaling_efficiency >= 0.8`` at 32 cards. In weak scaling (each rank's work fixed) it is the
  step time's ratio; in strong scaling (global batch fixed) it also carries the smaller per-rank
  batch.
- ``comm_fraction`` (fraction, minimize): the share of a step's wall time spent in communication
  that compute did not hide (the torch probe's profiled step, ``workload.profile_step``; the
  simulator's exposed collective terms).
"""

from __future__ import annotations

import math

__all__ = ["efficiency_interval", "scaling_efficiency"]


def scaling_efficiency(tokens_per_s_per_device: float, reference_tokens_per_s_per_device: float) -> float:
    """Throughput per device at a size over that at the reference size (1.0: linear)."""
    if reference_tokens_per_s_per_device <= 0:
        raise ValueError("the reference throughput must be positive")
    return tokens_per_s_per_device / reference_tokens_per_s_per_device


def efficiency_interval(
    value: float,
    value_interval: tuple[float, float] | None,
    reference: float,
    reference_interval: tuple[float, float] | None,
) -> tuple[float, float] | None:
    """The interval of ``value / reference`` from the two means' intervals (first-order: the
    relative half-widths add in quadrature); None unless both were repeated."""
    if value_interval is None or reference_interval is None or value <= 0 or reference <= 0:
        return None
    rel = math.hypot(
        (value_interval[1] - value_interval[0]) / 2 / value,
        (reference_interval[1] - reference_interval[0]) / 2 / reference,
    )
    ratio = value / reference
    return ratio * (1.0 - rel), ratio * (1.0 + rel)
