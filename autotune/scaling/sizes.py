"""The sizes of a scaling study, and a config as it runs at each.

A scaling study (``autotune scale``, issue 45) measures one config at several sizes of the
cluster. A *size* is a node count (each node with the spec's devices per node) or a device count
within one node. At each size the config keeps its model-parallel layout (tp, pp, cp, vpp,
micro-batch, recompute, ZeRO stage, precision, env) and takes the data-parallel size the devices
give; the global batch is either fixed (strong scaling) or grows with dp so that each rank does
the work it did at the study's size (weak scaling: grad-accum fixed). A size at which the layout
cannot run (its devices not a multiple of tp*pp*cp, a batch that does not divide) is skipped for
that config, with the rule that forbids it.

Apart from the measurement (:mod:`autotune.scaling.measure`) because what a size *is* must be
the same for the probe, the model's projection (:mod:`autotune.guide.projection`) and the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autotune.workers.parameters import value, weak_scaled

from ..spec.schema import Spec
from ..spec.space import Space
from ..spec.space_section import DERIVED_PARAMS

__all__ = ["MODES", "ScalingInputError", "Size", "SizedConfig", "config_at", "default_sizes", "parse_sizes", "spec_at"]

MODES = ("strong", "weak")


class ScalingInputError(ValueError):
    """A scaling study the input cannot define (exit 2): ``field`` names the option or spec field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, order=True)
class Size:
    """``nodes`` x ``devices_per_node`` devices."""

    nodes: int
    devices_per_node: int

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}"

    def to_json(self) -> dict[str, int]:
        return {"nodes": self.nodes, "devices_per_node": self.devices_per_node, "devices": self.devices}


@dataclass(frozen=True)
class SizedConfig:
    """A config at one size and mode: the spec it runs under and its resolved config, or why it cannot."""

    size: Size
    mode: str
    spec: Spec | None
    config: dict[str, Any] | None
    why_not: str = ""


def parse_sizes(text: str | None, field: str) -> list[int] | None:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, unique); None for no option. Anything else is refused."""
    if text is None:
        return None
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ScalingInputError(field, f"expected a comma-separated list of positive integers, got {text!r}")
        values.append(int(part))
    if len(set(values)) < 2:
        raise ScalingInputError(field, f"a scaling study needs at least two sizes, got {text!r}")
    return sorted(set(values))


def default_sizes(spec: Spec, nodes: Sequence[int] | None, devices: Sequence[int] | None) -> list[Size]:
    """The sizes asked for: ``nodes`` (node counts of the spec's devices per node), ``devices``
    (device counts within one node), else powers of two up to the spec's cluster: its node
    counts when it has several nodes, its device counts within the node when it has one."""
    if nodes and devices:
        raise ScalingInputError("--nodes/--devices", "give node counts or device counts within a node, not both")
    per_node = spec.cluster.devices_per_node
    if devices:
        too_many = [d for d in devices if d > per_node]
        if too_many:
            raise ScalingInputError(
                "--devices",
                f"{too_many} exceed the {per_node} devices per node of the spec's cluster "
                "(cluster.devices_per_node); scale over nodes with --nodes",
            )
        return [Size(1, d) for d in devices]
    if nodes:
        if max(nodes) > 1 and not spec.ray.enabled:
            raise ScalingInputError(
                "--nodes", "sizes of more than one node run on a Ray cluster: set ray.enabled (and --ray-address)"
            )
        return [Size(n, per_node) for n in nodes]
    top = spec.cluster.nodes if spec.cluster.nodes > 1 else per_node
    counts: list[int] = []
    k = 1
    while k < top:
        counts.append(k)
        k *= 2
    counts.append(top)
    if spec.cluster.nodes > 1:
        return [Size(n, per_node) for n in counts]
    return [Size(1, d) for d in counts]


def _without_derived(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in DERIVED_PARAMS}


def spec_at(spec: Spec, size: Size, global_batch_size: int, profile_step: bool) -> Spec:
    """``spec`` with the cluster of ``size`` and the global batch given (``profile_step``: a
    profiled step for the communication share, where the backend can give one)."""
    cluster = spec.cluster.model_copy(  # measured at the size itself, never on a probe slice
        update={"nodes": size.nodes, "devices_per_node": size.devices_per_node, "probe_nodes": None}
    )
    workload = spec.workload.model_copy(
        update={"global_batch_size": global_batch_size, "profile_step": profile_step or spec.workload.profile_step}
    )
    return spec.model_copy(update={"cluster": cluster, "workload": workload})


def config_at(spec: Spec, config: dict[str, Any], size: Size, mode: str, profile_step: bool = False) -> SizedConfig:
    """``config`` (as the study resolved it at the spec's size) at ``size`` in ``mode``."""
    if mode not in MODES:
        raise ScalingInputError("--mode", f"expected one of {', '.join(MODES)} (or both), got {mode!r}")
    layout = int(value(config, "tp")) * int(value(config, "pp")) * int(value(config, "cp"))
    if size.devices % layout:
        return SizedConfig(size, mode, None, None, f"tp*pp*cp = {layout} does not divide {size.devices} devices")
    gbs = spec.workload.global_batch_size
    if mode == "weak":  # each rank's work as at the study's size: micro-batch and grad-accum kept
        gbs = weak_scaled(config, size.devices)[1]
    sized = spec_at(spec, size, gbs, profile_step)
    resolved = Space(sized).resolve(_without_derived(config))
    if not resolved.valid:
        return SizedConfig(size, mode, None, None, "; ".join(resolved.violations))
    return SizedConfig(size, mode, sized, resolved.config)
