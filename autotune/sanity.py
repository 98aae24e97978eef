"""Is what a probe reported physically possible? A check before a measurement may win.

A probe is somebody's program: a wrong unit, a clock read backwards or a parsing slip gives a
negative step time or a throughput beyond what the devices can compute, and such a trial would
become the study's best and be exported. The trial is then recorded as a ``crash`` with the
reason (its metrics kept, nothing measured is lost), and never wins.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["implausible_metrics", "is_finite_number"]

# metric names that can never be negative: durations, rates, sizes, shares, counts
_NON_NEGATIVE_SUFFIXES = ("_s", "_ms", "_gib", "_per_s", "_per_s_per_device", "_steps", "_bytes_per_param")
_NON_NEGATIVE = {"mfu", "tokens", "loss"}
# differences, not sizes: the headroom is the profile's capacity minus the measured peak, and a
# probe that ran may have used more than a profile's nominal figure (a device with a little more
# than the profile says, a capacity given in GB, a peak read a little high): the measurement
# stands (a config near the limit is the one worth finding), the profile is what is off
_MAY_BE_NEGATIVE = {"memory_headroom_gib"}
_MAX_MFU = 1.0  # model FLOPs above the device's data-sheet peak: impossible whatever the kernels
# A calibrated profile (``calibrated_at``) holds no data-sheet peak: ``autotune calibrate`` fits the
# sustained matmul plateau it measured on the host, which is no bound. A model's GEMMs may beat the
# fit (this 2-core host's largest GEMM read 13 % above it), and a calibration taken while the host
# was busy reads low: 53 GFLOPS fp32 with four local Ray nodes starting, 100 idle, one thread each;
# a 1-node slice probe then ran at 103 % of it. What this check is for, a unit slip (seconds read as
# milliseconds, sequences as tokens), is a factor of 100 or more.
_MAX_MFU_SUSTAINED = 4.0


def is_finite_number(v: Any) -> bool:
    """A plain finite int or float (not a bool, not NaN or infinite): a value a metric may take."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def implausible_metrics(
    metrics: Mapping[str, Any],
    model: Mapping[str, Any],
    workload: Mapping[str, Any],
    hardware: Mapping[str, Any],
    precision: str,
) -> list[str]:
    """Why these metrics cannot be a real measurement (empty when they can): non-finite values,
    negative durations / rates / sizes (a negative headroom is a profile that understates the
    device, not an impossible measurement), a zero step time, or a throughput whose model FLOPs exceed
    the hardware profile's peak for the precision (MFU > 100 %; > 400 % of a calibrated profile's
    measured plateau, which is no bound)."""
    problems = []
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            problems.append(f"{name} = {value} is not a finite number")
        elif (
            value < 0
            and name not in _MAY_BE_NEGATIVE
            and (name in _NON_NEGATIVE or name.endswith(_NON_NEGATIVE_SUFFIXES))
        ):
            problems.append(f"{name} = {value:g} is negative")
    if is_finite_number(metrics.get("step_time_s")) and metrics["step_time_s"] == 0:
        problems.append("step_time_s = 0: no step takes no time")
    mfu = _mfu(metrics, model, workload, hardware, precision)
    sustained = bool(hardware.get("calibrated_at"))
    if mfu is not None and mfu > (_MAX_MFU_SUSTAINED if sustained else _MAX_MFU):
        peak = (hardware.get("peak_tflops") or {}).get(precision)
        bound, profile = (
            (f"{_MAX_MFU_SUSTAINED:g}x the matmul plateau `autotune calibrate` measured", "calibrated profile")
            if sustained
            else ("the device's peak", "hardware profile")
        )
        problems.append(
            f"{mfu:.0%} MFU: the reported throughput needs more than {bound} ({peak:g} TFLOPS {precision} "
            f"in the {profile})"
        )
    return problems


def _mfu(
    metrics: Mapping[str, Any],
    model: Mapping[str, Any],
    workload: Mapping[str, Any],
    hardware: Mapping[str, Any],
    precision: str,
) -> float | None:
    """The highest MFU the reported figures imply: the probe's own ``mfu``, and the one its
    per-device token rate gives (training only; inference rates include the prompt)."""
    values = []
    if is_finite_number(metrics.get("mfu")):
        values.append(float(metrics["mfu"]))
    peak = (hardware.get("peak_tflops") or {}).get(precision)
    rate = metrics.get("tokens_per_s_per_device")
    if (
        workload.get("kind", "train") == "train"
        and is_finite_number(peak)
        and peak > 0
        and is_finite_number(rate)
        and model
    ):
        from autotune.objectives import flops_per_token

        try:
            values.append(flops_per_token(model, int(workload["seq_len"]), True) * float(rate) / (float(peak) * 1e12))
        except (KeyError, TypeError, ValueError):
            pass
    return max(values) if values else None
