"""A measured config projected to another size by the calibrated model (issue 45).

In the guide because it is the model's job: :mod:`autotune.scaling` projects a scaling study's
smallest size to the larger ones with it, and a study that probes on a slice of its target
cluster (``cluster.probe_nodes``) ranks every measured config at the target size with it.

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

from autotune.workers.hardware import links_note
from autotune.workers.simulate import COMM_TERMS

__all__ = [
    "COMM_TERMS",
    "PROJECTION_BAND",
    "PROJECTION_BAND_80",
    "ModelPoint",
    "host_load",
    "point_of_result",
    "project_result",
    "projected_step",
    "reference_devices",
    "scaling_figures",
    "simulated_comm",
]


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
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "tokens_per_step": self.tokens_per_step,
            "devices": self.devices,
            "step_time_s": self.step_s,
            "comm_fraction": self.comm_fraction,
            "tokens_per_s_per_device": self.tokens_per_s_per_device(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelPoint":
        return cls(
            float(data["compute_s"]), float(data["comm_s"]), float(data["tokens_per_step"]), int(data["devices"])
        )


def host_load(ranks_on_host: int, threads_per_rank: int | None, ranks_per_node: int, host_cores: int) -> float:
    """How much slower each rank computes when ``ranks_on_host`` ranks of ``threads_per_rank``
    threads each (default: the host's cores over the node's ranks, as the torch probe sets them)
    share ``host_cores`` cores: the threads over the cores, at least 1. A CPU device is its cores:
    several nodes of a test cluster on one host divide them, which no link model prices."""
    threads = threads_per_rank or max(1, host_cores // max(1, ranks_per_node))
    return max(1.0, ranks_on_host * threads / max(1, host_cores))


def point_of_result(result: Any, tokens_per_step: float, devices: int) -> ModelPoint | None:
    """The :class:`ModelPoint` of a simulator result (:func:`autotune.workers.simulate.simulate_trial`:
    its step-time breakdown in ``info["time_s"]``); None when it has none (an invalid config)."""
    times = (result.info or {}).get("time_s") or {}
    if not times:
        return None
    comm = _exposed_comm_s(times)
    step = float(result.metrics.get("step_time_s") or sum(float(v) for v in times.values()))
    return ModelPoint(max(step - comm, 0.0), comm, tokens_per_step, devices)


def _exposed_comm_s(times: dict[str, Any]) -> float:
    """The communication terms of the simulator's step-time breakdown (:data:`COMM_TERMS`), summed."""
    return sum(float(times.get(k, 0.0)) for k in COMM_TERMS)


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


def simulated_comm(info: dict[str, Any], step_time_s: float | None = None) -> dict[str, float]:
    """The simulator's communication share of the step: its exposed communication terms (``info``'s
    step-time breakdown) over the step (``step_time_s``, else the breakdown's sum)."""
    times = info.get("time_s") or {}
    step = float(step_time_s or sum(float(v) for v in times.values()))
    if step <= 0:
        return {}
    comm = _exposed_comm_s(times)
    return {"comm_fraction": comm / step, "comm_time_s": comm}


# the throughputs a training probe reports: derived again from the projected step at the target size
_THROUGHPUTS = ("tokens_per_s", "tokens_per_s_per_device", "samples_per_s", "mfu")
# what the band of a projection is, until a study measures its own: the median absolute error of
# the projection on published multi-node rows at 4-16x the reference size, and the error that 80 %
# of those rows stay within (benchmarks/scaling_fidelity.py prints both; tests/test_probe_slice.py
# recomputes them): half the rows are further off than the first, one in five than the second
PROJECTION_BAND = 0.056
PROJECTION_BAND_80 = 0.088


def project_result(result: Any, measured_on: Any, target: Any) -> Any:
    """A probe's result on the probe slice (``measured_on``, a :class:`TrialRequest`) as the study
    reads it at ``target`` (the same config at the cluster it tunes for): the step projected
    (:func:`projected_step`), the throughputs dropped so that they are derived again at the target's
    batch and devices, each step's time scaled alike, the peak memory moved by the model's
    difference between the two sizes (ZeRO shards over a smaller dp on the slice). What was
    measured is kept in ``info["projected_from"]``. A failed probe is returned as it ran, its
    ``info`` saying where it ran."""
    import dataclasses

    from autotune.workers.parameters import trial_devices

    where = {
        "nodes": int(measured_on.cluster["nodes"]),
        "devices": trial_devices("train", measured_on.params),
        "target_nodes": int(target.cluster["nodes"]),
        "target_devices": trial_devices("train", target.params),
    }
    if not result.ok:
        return dataclasses.replace(result, info={**result.info, "projected_from": where})
    (sim_on, point_on), (sim_target, point_target) = _priced(measured_on), _priced(target)
    sims, points = (sim_on, sim_target), [point_on, point_target]
    measured = dict(result.metrics)
    step = measured.get("step_time_s")
    if not step and measured.get("tokens_per_s"):
        step = points[0].tokens_per_step / float(measured["tokens_per_s"]) if points[0] else None
    if not step or points[0] is None or points[1] is None:
        return dataclasses.replace(
            result,
            status="crash",
            reason="measured on the probe slice, but the step cannot be projected to the target "
            "(no step time from the probe, or a config the model cannot price)",
            info={**result.info, "projected_from": where},
        )
    step = float(step)
    projected = projected_step(step, measured.get("comm_fraction"), points[0], points[1])
    ratio = projected / step
    metrics = {k: v for k, v in measured.items() if k not in _THROUGHPUTS}
    metrics["step_time_s"] = projected
    shift = _peak(sims[1]) - _peak(sims[0]) if _peak(sims[0]) and _peak(sims[1]) else 0.0
    if metrics.get("peak_memory_gib") is not None:
        metrics["peak_memory_gib"] = max(0.0, float(metrics["peak_memory_gib"]) + shift)
    if "comm_fraction" in metrics:  # the share at the target is the model's there
        metrics["comm_fraction"] = points[1].comm_fraction
    steps = [_scaled_step(e, ratio, shift) for e in result.steps]
    links = links_note(target.cluster.get("hardware") or {}, where["target_nodes"])
    info = {
        **result.info,
        "projected_from": {
            **where,
            "measured": measured,
            "step_ratio": ratio,
            "band": PROJECTION_BAND,
            "band_80": PROJECTION_BAND_80,
            **({"links": links} if links else {}),
        },
    }
    return dataclasses.replace(result, metrics=metrics, steps=steps, info=info)


def _priced(request: Any) -> tuple[Any, ModelPoint | None]:
    """The simulator's result for a training ``request`` and its :class:`ModelPoint` (the tokens
    of one step, the devices of the config)."""
    from autotune.workers.parameters import trial_devices
    from autotune.workers.simulate import simulate_trial

    sim = simulate_trial(request)
    tokens = float(request.workload["global_batch_size"]) * float(request.workload["seq_len"])
    return sim, point_of_result(sim, tokens, trial_devices("train", request.params))


def _peak(sim: Any) -> float:
    return float(sim.metrics.get("peak_memory_gib") or (sim.info or {}).get("predicted_peak_memory_gib") or 0.0)


def _scaled_step(event: dict[str, Any], ratio: float, shift: float) -> dict[str, Any]:
    out = dict(event)
    if isinstance(out.get("step_time_s"), (int, float)):
        out["step_time_s"] = float(out["step_time_s"]) * ratio
    for key in ("memory_gib", "peak_memory_gib"):
        if isinstance(out.get(key), (int, float)):
            out[key] = max(0.0, float(out[key]) + shift)
    return out


def reference_devices(params: dict[str, Any], cluster: dict[str, Any]) -> int:
    """The devices a training config's scaling efficiency is read against (the simulator's rule,
    :data:`autotune.workers.parameters.REFERENCE_DP_RULE`)."""
    from autotune.workers.parameters import reference_dp, value

    tp, pp, cp, dp = (int(value(params, k)) for k in ("tp", "pp", "cp", "dp"))
    return tp * pp * cp * int(reference_dp(tp, pp, cp, dp, int(cluster["devices_per_node"])))


def scaling_figures(measured: dict[str, Any], measured_on: Any, target: Any) -> dict[str, float]:
    """``scaling_efficiency`` and ``comm_fraction`` of a config measured at ``measured_on`` (its
    metrics ``measured``: the step time, the profiled step's communication share where the probe
    gave one), read at ``target`` (a :class:`TrialRequest`; the same request when the probe ran at
    full size). The efficiency is the step at the reference size (:func:`reference_devices`) over
    the step at the target, each rank doing the same work: the measured step where the probe ran
    at that size, else the calibrated model's projection from it (:func:`projected_step`). The
    share is the measured one at full size, else the model's at the target. Empty when the model
    cannot price the config or the probe gave no step time."""
    from autotune.spec.context import weak_request
    from autotune.workers.parameters import trial_devices

    step = measured.get("step_time_s")
    devices = trial_devices("train", measured_on.params)
    if not step or float(step) <= 0:
        return {}
    sizes = {"target": target, "reference": weak_request(target, reference_devices(target.params, target.cluster))}
    points = {name: _priced(request)[1] for name, request in sizes.items()}
    points["measured"] = points["target"] if measured_on is target else _priced(measured_on)[1]
    if any(p is None for p in points.values()):
        return {}
    share = measured.get("comm_fraction")

    def step_at(name: str) -> float:
        request = sizes[name]
        if trial_devices("train", request.params) == devices:  # measured at this size
            return float(step)
        return projected_step(float(step), share, points["measured"], points[name])

    out = {"scaling_efficiency": step_at("reference") / step_at("target")}
    at_full_size = trial_devices("train", target.params) == devices
    out["comm_fraction"] = float(share) if share is not None and at_full_size else points["target"].comm_fraction
    return out
