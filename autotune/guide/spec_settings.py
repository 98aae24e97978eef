"""The guide's settings made from a spec: the one place the guide's knobs are read from ``search:``.

Apart from :mod:`.guided` and :mod:`.sampler`, which take :class:`~.guided.GuideSettings` and never
the spec (issue 43, narrow settings): the assembly (:func:`autotune.cli.assembly.loop_settings`) and
:meth:`~.sampler.GuidedSampler.from_spec`, the spec-facing edges, call this.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..objectives.intervals import NoisePrior
from ..spec.context import ProbeContext
from ..spec.resolve import probe_context
from ..spec.schema import Spec
from .guided import GuideSettings

__all__ = ["guide_settings", "measured_noise"]


def measured_noise(hardware: Mapping[str, Any]) -> NoisePrior | None:
    """One serving reading's relative noise between runs as ``autotune calibrate --serving`` measured
    it on this host (the profile's ``serving_steps.repeat_noise`` and ``repeat_noise_dof``: its probes
    of each prompt length, :func:`autotune.workers.calibrate_serving.repeat_noise`); None where the
    profile has none (a bundled profile, or a calibration of one round). Why the study takes it: its
    own repeats come late or never (a budget of 3 on four configs leaves none), and until then it
    compared single readings at the guide's 3 % default on a host where one config read 25.8-32.0
    req/s over three runs (benchmarks/README.md)."""
    steps = hardware.get("serving_steps") or {}
    noise, dof = steps.get("repeat_noise"), steps.get("repeat_noise_dof")
    if not isinstance(noise, (int, float)) or not noise > 0 or not isinstance(dof, (int, float)) or dof < 1:
        return None
    return NoisePrior(float(noise), int(dof), "autotune calibrate --serving's repeated probes on this host")


def guide_settings(
    spec: Spec, context: ProbeContext | None = None, remeasure_steps: int | None = None
) -> GuideSettings:
    """The guide's knobs from the spec's ``search:`` section (the same names), what the device
    check found usable on a device (``context``'s hardware), and for a serving study the noise
    between runs ``autotune calibrate --serving`` measured on this host (:func:`measured_noise`).
    ``remeasure_steps``: the timed steps a re-measurement runs on the study's backend
    (:func:`autotune.guide.short_remeasure.remeasure_steps_of`, None: a full probe); where it is
    short, the race's share buys more of them."""
    from .short_remeasure import remeasure_cost_estimate

    sp = spec.search
    remeasure_cost = remeasure_cost_estimate(spec.workload.model_dump(), remeasure_steps)
    hardware = (context if context is not None else probe_context(spec)).hardware
    noise = measured_noise(hardware) if spec.workload.kind == "serve" else None
    return GuideSettings(
        **({"noise": noise.noise, "noise_dof": noise.dof, "noise_from": noise.source} if noise else {}),
        explore_kappa=sp.explore_kappa,
        fit_confidence=sp.fit_confidence,
        stop_early=sp.stop_early,
        min_fit_probability=sp.min_fit_probability,
        max_oom_share=sp.max_oom_share,
        max_doubt_probes=sp.max_doubt_probes,
        tie_tolerance=sp.tie_tolerance,
        max_readings=sp.max_readings,
        confidence=sp.confidence,
        confirm_readings=sp.confirm_readings(remeasure_cost),
        remeasure_cost=remeasure_cost,
        drift_every=sp.drift_checks_every(),
        device_usable_gib=hardware.get("usable_memory_gib"),
    )
