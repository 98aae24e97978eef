"""The spec, narrowed: the small frozen settings each consumer takes, made from the spec here.

Issue 43 ("narrow settings, not the whole spec"): like Hydra's sweeper, which takes typed settings
in its constructor, the loop, the guide, the dispatcher, the pruner and the probes' request builder
never see the :class:`~autotune.spec.schema.Spec`; the assembly (:mod:`autotune.cli.assembly`) makes their
settings once with these functions and hands them over. This module is the spec-facing edge for
the settings that modules below the assembly also need (the study's result, its storage, its plan,
``GuidedSampler.from_spec``): the resolved objectives and the probe context. The settings types
live with their consumers; this module only fills them in.
"""

from __future__ import annotations

from .context import ProbeContext, RequestSettings
from .secret_env import masked_backend, secret_values
from ..settings import Objectives, resolve_objectives
from .schema import Spec

__all__ = ["objectives_of", "probe_context", "request_settings"]


def objectives_of(spec: Spec) -> Objectives:
    """The spec's objectives with their directions (the workload's default metric when it names none)."""
    return resolve_objectives(spec.objectives, spec.workload.kind)


def probe_context(spec: Spec, backend_kind: str | None = None) -> ProbeContext:
    """The model, workload and cluster a probe is told, the hardware profile resolved (overrides
    applied) and, for training, how the target stack holds its model states. ``backend_kind``: the
    backend the study runs (``backend: auto`` resolved); the memory rule follows it, since the
    torch probe holds memory its own way (a 3B study on one H200 with ``auto`` priced its first
    probe by Megatron's rule and ran it out of memory)."""
    from autotune.workers.hardware import load_profile

    hardware = load_profile(spec.cluster.profile_name, spec.cluster.overrides)
    cluster = {
        "accelerator": spec.cluster.accelerator,
        "profile": spec.cluster.profile_name,
        "nodes": spec.cluster.nodes,
        "devices_per_node": spec.cluster.devices_per_node,
        "world_size": spec.cluster.world_size,
        "probe_nodes": spec.cluster.probe_slice,
        "threads_per_rank": spec.cluster.threads_per_rank,
        "cost_per_device_hour": spec.cluster.cost_per_device_hour,
        "hardware": hardware,
    }
    from ..stacks import memory_rule, target_of

    workload = spec.workload.model_dump()
    if spec.is_training:  # how the stack that runs the config holds its model states
        workload["memory_rule"] = memory_rule(target_of(spec), backend_kind or spec.backend.kind)
    return ProbeContext(spec.model.model_dump(), workload, cluster)


def request_settings(
    spec: Spec, context: ProbeContext | None = None, remeasure_steps: int | None = None
) -> RequestSettings:
    """The request builder's settings (``context``: the study's probe context, when made already;
    ``remeasure_steps``: the timed steps a re-measurement runs on the study's backend, None for a
    full probe, :func:`autotune.guide.short_remeasure.remeasure_steps_of`)."""
    return RequestSettings(
        study=spec.name,
        context=context if context is not None else probe_context(spec),
        backend=masked_backend(spec.backend.model_dump()),
        workload_kind=spec.workload.kind,
        secrets=tuple(secret_values(spec.model_dump(mode="json"))),
        remeasure_steps=remeasure_steps,
    )
