"""A measured config projected to another size by the calibrated model (issue 45).

The projection anchors on a measurement and lets the model say only how the step changes with
size: the step measured at the reference size is split into compute and communication (the
profiled step's communication share where the probe gave one, else the model's share at the
reference), and each part is scaled by the model's own ratio between the two sizes:

    step(target) = compute(ref) * model_compute(target) / model_compute(ref)
                 + comm(ref)    * model_comm(target)    / model_comm(ref)

A part the model puts at zero at the reference (no data-parallel gradient reduction on one
device) has no ratio: it takes the model's absolute figure at the target, whose bandwidths and
latencies are the host's measured ones (``autotune calibrate``), scaled by the measured step's
ratio to the model's at the reference. Anchoring cancels what the model gets wrong uniformly at
both sizes (a kernel's speed on this host); what it cannot cancel is an effect present at one
size only (a link shared at the target, a straggler), which the validation measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..spec.resolve import request_settings
from .measure import COMM_TERMS
from .sizes import SizedConfig

__all__ = ["ModelPoint", "model_point", "point_of_result", "projected_step"]


@dataclass(frozen=True)
class ModelPoint:
    """The model's step at one size: its compute and exposed communication (seconds), the
    tokens one step processes and the devices it uses."""

    compute_s: float
    comm_s: float
    tokens_per_step: float
    devices: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    def tokens_per_s_per_device(self, step_s: float | None = None) -> float:
        step = self.step_s if step_s is None else step_s
        return self.tokens_per_step / step / self.devices if step > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_s,
            "comm_fraction": self.comm_fraction,
            "tokens_per_s_per_device": self.tokens_per_s_per_device(),
        }


def model_point(sized: SizedConfig) -> ModelPoint | None:
    """The analytical model's step for ``sized`` (on its spec's hardware profile: the measured one
    for a real study); None when the model cannot price it (a config it finds invalid). A config
    the model predicts out of memory is still priced: its time is what is projected."""
    from autotune.workers.simulate import simulate_trial

    if sized.spec is None or sized.config is None:
        return None
    result = simulate_trial(request_settings(sized.spec).request(sized.config, -1))
    w = sized.spec.workload
    return point_of_result(result, float(w.global_batch_size * w.seq_len), sized.size.devices)


def point_of_result(result: Any, tokens_per_step: float, devices: int) -> ModelPoint | None:
    """The :class:`ModelPoint` of a simulator result (:func:`autotune.workers.simulate.simulate_trial`:
    its step-time breakdown in ``info["time_s"]``); None when it has none (an invalid config)."""
    times = (result.info or {}).get("time_s") or {}
    if not times:
        return None
    comm = sum(float(times.get(k, 0.0)) for k in COMM_TERMS)
    step = float(result.metrics.get("step_time_s") or sum(float(v) for v in times.values()))
    return ModelPoint(max(step - comm, 0.0), comm, tokens_per_step, devices)


def projected_step(
    measured_step_s: float, measured_comm_fraction: float | None, reference: ModelPoint, target: ModelPoint
) -> float:
    """The step time at ``target`` projected from the one measured at ``reference`` (see the module
    docstring); ``measured_comm_fraction`` from the reference's profiled step, None without one."""
    share = reference.comm_fraction if measured_comm_fraction is None else min(max(measured_comm_fraction, 0.0), 1.0)
    compute, comm = measured_step_s * (1.0 - share), measured_step_s * share
    anchor = measured_step_s / reference.step_s if reference.step_s > 0 else 1.0
    compute_t = (
        compute * target.compute_s / reference.compute_s if reference.compute_s > 0 else target.compute_s * anchor
    )
    comm_t = comm * target.comm_s / reference.comm_s if reference.comm_s > 0 and comm > 0 else target.comm_s * anchor
    return compute_t + comm_t
