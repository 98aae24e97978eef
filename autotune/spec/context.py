"""What a probe receives with every trial: the resolved model, workload and cluster, and the
request builder's settings.

A probe knows only its trial file (docs/ARCHITECTURE.md), so the model, workload and cluster go with each
trial as plain mappings, the hardware profile resolved (overrides applied) inside ``cluster``.
Built once per study from the spec (:func:`autotune.spec.resolve.probe_context`) and shared by
the simulator ranking and the trial requests, so the two can never describe different hardware.
:class:`RequestSettings` is what the request builder (:mod:`autotune.study.trial_run`,
:mod:`autotune.study.trial_resolve`) is given instead of the spec (issue 43: narrow settings).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from autotune.workers.parameters import weak_scaled
from autotune.workers.protocol import TrialRequest

__all__ = ["ProbeContext", "RequestSettings", "weak_request"]


@dataclass(frozen=True)
class ProbeContext:
    model: dict[str, Any]
    workload: dict[str, Any]
    cluster: dict[str, Any]

    @property
    def hardware(self) -> dict[str, Any]:
        return self.cluster["hardware"]


@dataclass(frozen=True)
class RequestSettings:
    """What a trial file needs beside the config, made once from the spec by the assembly."""

    study: str  # the study's name: every trial file and cache entry names the study it came from
    context: ProbeContext  # the model, workload and cluster (hardware resolved) every probe is told
    backend: dict[str, Any]  # the spec's backend section, secret env values masked: the probe's settings, the cache key
    workload_kind: str  # train, infer or serve: a config's devices (parameters.trial_devices)
    secrets: tuple[str, ...] = ()  # every secret value the spec holds: scrubbed from what a probe printed
    # the timed steps a re-measurement runs (autotune.guide.short_remeasure); None: the full probe
    remeasure_steps: int | None = None

    def request(self, config: dict[str, Any], number: int) -> TrialRequest:
        """What the probe of trial ``number`` is told: the config, the model, workload and cluster,
        the backend (masked); on the probe slice when the cluster has one (:meth:`slice_request`)."""
        target = self.target_request(config, number)
        return self.slice_request(target) if self.context.cluster.get("probe_nodes") else target

    def target_request(self, config: dict[str, Any], number: int) -> TrialRequest:
        """The trial at the cluster the study tunes for (what the model predicts and the study ranks)."""
        c = self.context
        return TrialRequest(
            params=config,
            model=c.model,
            workload=c.workload,
            cluster=c.cluster,
            study=self.study,
            number=number,
            backend=copy.deepcopy(self.backend),
        )

    @staticmethod
    def slice_request(target: TrialRequest) -> TrialRequest:
        """``target`` as it runs on the probe slice (``cluster.probe_nodes`` nodes): the same tp, pp, cp,
        micro-batch and grad-accum, the data-parallel size the slice's devices give, and the global
        batch that makes (each rank does the target's work: weak scaling). A layout the slice cannot
        hold never gets here (a rule of the space, :mod:`autotune.spec.space`)."""
        nodes = int(target.cluster["probe_nodes"])
        return weak_request(
            target, nodes * int(target.cluster["devices_per_node"]), target_nodes=target.cluster["nodes"]
        )


def weak_request(target: TrialRequest, devices: int, **cluster: Any) -> TrialRequest:
    """``target`` on ``devices`` devices (whole nodes when more than one node's worth, else within
    one), each rank doing the work it does at ``target`` (:func:`weak_scaled`); ``cluster``: more
    entries of the cluster it runs on."""
    per_node = int(target.cluster["devices_per_node"])
    dp, gbs = weak_scaled(target.params, devices)
    return TrialRequest(
        params={**target.params, "dp": dp},
        model=target.model,
        workload={**target.workload, "global_batch_size": gbs},
        cluster={
            **target.cluster,
            "nodes": max(1, -(-devices // per_node)),
            "world_size": devices,
            "probe_nodes": None,
            **cluster,
        },
        study=target.study,
        number=target.number,
        backend=target.backend,
    )
