"""The resolved, JSON-ready sections a probe receives with every trial.

A probe knows only its trial file (docs/ARCHITECTURE.md), so the model, workload and cluster go with each
trial as plain mappings, the hardware profile resolved (overrides applied) inside ``cluster``.
Built once per study and shared by the simulator ranking and the trial requests, so the two can
never describe different hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .spec import Spec

__all__ = ["ProbeContext", "probe_context"]


@dataclass(frozen=True)
class ProbeContext:
    model: dict[str, Any]
    workload: dict[str, Any]
    cluster: dict[str, Any]

    @property
    def hardware(self) -> dict[str, Any]:
        return self.cluster["hardware"]


def probe_context(spec: Spec) -> ProbeContext:
    from autotune.workers.hardware import load_profile

    hardware = load_profile(spec.cluster.profile_name, spec.cluster.overrides)
    cluster = {
        "accelerator": spec.cluster.accelerator,
        "profile": spec.cluster.profile_name,
        "nodes": spec.cluster.nodes,
        "devices_per_node": spec.cluster.devices_per_node,
        "world_size": spec.cluster.world_size,
        "threads_per_rank": spec.cluster.threads_per_rank,
        "cost_per_device_hour": spec.cluster.cost_per_device_hour,
        "hardware": hardware,
    }
    from .stacks import memory_rule

    workload = spec.workload.model_dump()
    if spec.is_training:  # how the stack that runs the config holds its model states
        workload["memory_rule"] = memory_rule(spec.target_stack, spec.backend.kind)
    return ProbeContext(spec.model.model_dump(), workload, cluster)
