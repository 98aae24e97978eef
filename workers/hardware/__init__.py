"""Hardware profiles: the device figures the simulator and MFU use, kept as data.

Each profile is a YAML file next to this module (package data), one per device kind, with the
public source of every figure in its comments. A profile is read into a plain ``dict`` so probes
on worker nodes need nothing but PyYAML. Users adjust a profile for their exact part (a 910B3
instead of a 910B2, a cluster with fewer NICs) through ``overrides``, which are checked here so a
typo never silently falls back to the default figure.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "PROFILE_KEYS",
    "OPTIONAL_KEYS",
    "SERVING_STEP_KEYS",
    "validate_profile",
    "ACCELERATORS",
    "available_profiles",
    "load_profile",
    "is_profile_file",
    "links_at",
    "links_note",
]

_DIR = Path(__file__).parent
ACCELERATORS = ("npu", "cuda", "cpu")
PRECISIONS = ("bf16", "fp16", "fp32")

# key -> expected type ("str", "float", "int", "peaks"); the overridable keys of every profile.
_SCHEMA: dict[str, str] = {
    "name": "str",
    "accelerator": "str",
    "description": "str",
    "calibrated_at": "str",
    "device_memory_gib": "float",
    "peak_tflops": "peaks",
    "memory_bandwidth_gbps": "float",
    "memory_bandwidth_efficiency": "fraction",
    "intra_node_bandwidth_gbps": "float",
    "allreduce_efficiency": "fraction",
    "allgather_efficiency": "fraction",
    "inter_node_bandwidth_gbps": "float",
    "inter_node_efficiency": "fraction",
    "devices_per_node": "int",
    "collective_latency_us": "float",
    "tp_collective_latency_us": "float",
    "kernel_launch_us": "float",
    "optimizer_us_per_tensor": "float",
    "gemm_efficiency": "fraction",
    "gemm_half_dim": "float",
    "flash_attention_efficiency": "fraction",
    "comm_overlap_slowdown": "float",
    "runtime_reserve_gib": "float",
    "usable_memory_gib": "float",
    "comm_buffer_model": "str",
    "comm_buffer_mib_per_comm": "float",
    "fragmentation_default": "float",
    "fragmentation_expandable": "float",
    "inter_node_links": "links",
    "serving_steps": "serving_steps",
}
PROFILE_KEYS: tuple[str, ...] = tuple(_SCHEMA)
# Keys a profile may leave out. ``calibrated_at`` (ISO time) says a profile was measured and when;
# ``tp_collective_latency_us`` is measured by ``autotune calibrate``
# (a tensor-parallel layer step in context: dispatch and rank skew on top of the wire); data-sheet
# profiles have no such figure and their tensor-parallel collectives pay ``collective_latency_us``;
# ``optimizer_us_per_tensor`` (an optimizer step's host cost per parameter tensor) is 0 there.
# ``usable_memory_gib`` is the device check's (autotune.study.usable_memory): what a probe's allocator can
# use on one device after the runtime started; absent, the guide starts from device_memory_gib.
# ``inter_node_links`` is ``autotune calibrate --nodes``'s: the link across nodes measured per node count
# ({nodes: {bandwidth_gbps, latency_us}}); absent, every count pays inter_node_bandwidth_gbps.
# ``serving_steps`` is ``autotune calibrate --serving``'s (issue 46): how a serving engine's measured step
# times relate to the model's on this host (SERVING_STEP_KEYS); absent, the serving model runs uncorrected.
OPTIONAL_KEYS = frozenset(
    {
        "description",
        "calibrated_at",
        "tp_collective_latency_us",
        "optimizer_us_per_tensor",
        "usable_memory_gib",
        "inter_node_links",
        "serving_steps",
    }
)
# ``serving_steps``: the engine measured, the factors on the model's decode part and prompt part of an
# engine step, a fixed cost added to every step, one per decoding sequence of it and one per token of
# such a sequence's context, a request's latency outside the steps (in its TTFT, no engine time), how
# far the fit stays from the readings, and the readings themselves (``points``: one per closed-loop
# batch and prompt length, measured vs modelled, each the median of ``repeats`` probes at most, which
# differed by ``repeat_spread`` at the median point; ``repeat_noise``: one probe's reading's relative
# noise between probes, pooled over the figures, with ``repeat_noise_dof`` degrees of freedom, what a
# serving study takes as its noise until its own repeats say; ``left_out``: the batches whose stream
# timed the API server's lag, not the engine, and were not fitted).
SERVING_STEP_KEYS = (
    "engine",
    "decode_scale",
    "prefill_scale",
    "step_overhead_us",
    "sequence_overhead_us",
    "context_overhead_ns",
    "prompt_token_overhead_ns",
    "request_latency_us",
    "rms_error",
    "repeats",
    "repeat_spread",
    "repeat_noise",
    "repeat_noise_dof",
    "points",
    "left_out",
)


def available_profiles() -> list[str]:
    """Names of the bundled profiles (the YAML file stems), sorted."""
    return sorted(p.stem for p in _DIR.glob("*.yaml"))


def is_profile_file(name: str) -> bool:
    """A profile named by a path (e.g. written by ``autotune calibrate``), not a bundled name."""
    return name.endswith((".yaml", ".yml")) or "/" in name


@lru_cache(maxsize=None)
def _read(name: str) -> dict[str, Any]:
    return _parse(yaml.safe_load((_DIR / f"{name}.yaml").read_text()), name)


def _read_file(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"hardware profile file {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"hardware profile file {path}: invalid YAML: {exc}") from None
    return _parse(data, path)


def _parse(data: Any, name: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {name!r}: expected a mapping")
    profile = _check(data, f"hardware profile {name!r}", require_all=True)
    missing = [k for k in PRECISIONS if k not in profile["peak_tflops"]]
    if missing:
        raise ValueError(f"hardware profile {name!r}: peak_tflops lacks {', '.join(missing)}")
    return profile


def validate_profile(data: Any, name: str) -> dict[str, Any]:
    """``data`` checked as a whole profile (every key, types, ranges), or ``ValueError`` naming
    ``name``, the key and what was expected."""
    return _parse(data, name)


def load_profile(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile ``name`` (a bundled profile, or the path of a profile file) as a fresh dict,
    with ``overrides`` applied and type-checked.

    ``peak_tflops`` may be overridden partially (``{"peak_tflops": {"bf16": 313}}`` keeps the
    other precisions). Raises ``ValueError`` for an unknown profile or key, or a badly typed value.
    """
    if is_profile_file(name):
        profile = _read_file(name)
    else:
        names = available_profiles()
        if name not in names:
            raise ValueError(
                f"unknown hardware profile {name!r}; available: {', '.join(names)} "
                "(or the path of a profile file, e.g. from `autotune calibrate`)"
            )
        profile = copy.deepcopy(_read(name))
    if overrides:
        if not isinstance(overrides, dict):
            raise ValueError(f"hardware overrides must be a mapping, got {type(overrides).__name__}")
        checked = _check(dict(overrides), f"override of hardware profile {name!r}", require_all=False)
        for key, value in checked.items():
            if key == "peak_tflops":
                profile["peak_tflops"] = {**profile["peak_tflops"], **value}
            else:
                profile[key] = value
    return profile


def _check(data: dict[str, Any], where: str, require_all: bool) -> dict[str, Any]:
    unknown = sorted(set(data) - set(_SCHEMA))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(PROFILE_KEYS)}")
    if require_all:
        missing = [k for k in PROFILE_KEYS if k not in data and k not in OPTIONAL_KEYS]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        out[key] = _coerce(key, value, _SCHEMA[key], where)
    return out


def _number(key: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}: {key} must be >= 0, got {value!r}")
    return float(value)


def _coerce(key: str, value: Any, kind: str, where: str) -> Any:
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string, got {value!r}")
        if key == "accelerator" and value not in ACCELERATORS:
            raise ValueError(f"{where}: accelerator must be one of {ACCELERATORS}, got {value!r}")
        if key == "comm_buffer_model" and value not in ("hccl", "nccl"):
            raise ValueError(f"{where}: comm_buffer_model must be hccl or nccl, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        return value
    if kind == "peaks":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: peak_tflops must be a mapping of precision to TFLOPS, got {value!r}")
        allowed = (*PRECISIONS, "int8")
        bad = sorted(set(value) - set(allowed))
        if bad:
            raise ValueError(f"{where}: peak_tflops has unknown precision(s) {bad}; valid: {', '.join(allowed)}")
        peaks = {k: _number(f"peak_tflops.{k}", v, where) for k, v in value.items()}
        if any(v == 0 for v in peaks.values()):
            raise ValueError(f"{where}: peak_tflops values must be > 0")
        return peaks
    if kind == "links":
        return _links(value, where)
    if kind == "serving_steps":
        return _serving_steps(value, where)
    number = _number(key, value, where)
    if kind == "fraction" and not 0 < number <= 1:
        raise ValueError(f"{where}: {key} must be in (0, 1], got {value!r}")
    return number


def _links(value: Any, where: str) -> dict[int, dict[str, float]]:
    """``inter_node_links`` checked: node counts (>= 2; a YAML or JSON key, int or digits) to
    ``{bandwidth_gbps: > 0, latency_us: >= 0}``."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{where}: inter_node_links must be a mapping of node count to its link, got {value!r}")
    out: dict[int, dict[str, float]] = {}
    for nodes, link in value.items():
        count = int(nodes) if isinstance(nodes, int) or (isinstance(nodes, str) and nodes.isdigit()) else None
        if count is None or count < 2:
            raise ValueError(f"{where}: inter_node_links keys are node counts >= 2, got {nodes!r}")
        if not isinstance(link, dict) or set(link) != {"bandwidth_gbps", "latency_us"}:
            raise ValueError(f"{where}: inter_node_links.{nodes} must be {{bandwidth_gbps, latency_us}}, got {link!r}")
        bandwidth = _number(f"inter_node_links.{nodes}.bandwidth_gbps", link["bandwidth_gbps"], where)
        if bandwidth == 0:
            raise ValueError(f"{where}: inter_node_links.{nodes}.bandwidth_gbps must be > 0")
        latency = _number(f"inter_node_links.{nodes}.latency_us", link["latency_us"], where)
        out[count] = {"bandwidth_gbps": bandwidth, "latency_us": latency}
    return out


def _serving_steps(value: Any, where: str) -> dict[str, Any]:
    """``serving_steps`` checked: the engine's name, both factors > 0, the costs, the latency and the
    fit's error >= 0, the readings and the batches left out lists of mappings (kept as written: what
    the factors rest on)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: serving_steps must be a mapping ({', '.join(SERVING_STEP_KEYS)}), got {value!r}")
    unknown = sorted(set(value) - set(SERVING_STEP_KEYS))
    missing = [k for k in SERVING_STEP_KEYS[:4] if k not in value]
    if unknown or missing:
        raise ValueError(
            f"{where}: serving_steps "
            + (f"has unknown key(s) {unknown}" if unknown else f"lacks {missing}")
            + f"; expected {', '.join(SERVING_STEP_KEYS)} (autotune calibrate --serving writes them)"
        )
    if not isinstance(value["engine"], str):
        raise ValueError(f"{where}: serving_steps.engine must be a string, got {value['engine']!r}")
    out: dict[str, Any] = {"engine": value["engine"]}
    for key in SERVING_STEP_KEYS[1:-2]:
        if key in value:
            out[key] = _number(f"serving_steps.{key}", value[key], where)
    for key in ("decode_scale", "prefill_scale"):
        if out[key] == 0:
            raise ValueError(f"{where}: serving_steps.{key} must be > 0 (a step cannot take no time)")
    points = value.get("points", [])
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ValueError(f"{where}: serving_steps.points must be a list of mappings, got {points!r}")
    out["points"] = points
    left_out = value.get("left_out", [])
    if not isinstance(left_out, list) or not all(isinstance(p, dict) for p in left_out):
        raise ValueError(f"{where}: serving_steps.left_out must be a list of mappings, got {left_out!r}")
    if left_out:
        out["left_out"] = left_out
    return out


def links_at(profile: dict[str, Any], nodes: int) -> tuple[int, dict[str, float]] | None:
    """The measured link a trial over ``nodes`` nodes pays (``inter_node_links``): that count's own,
    else the nearest measured count below it (beyond the largest: the largest's), else the
    smallest above; None on one node or without per-count measurements."""
    links = profile.get("inter_node_links")
    if not links or nodes < 2:
        return None
    table = {int(k): v for k, v in links.items()}
    below = [n for n in table if n <= nodes]
    at = max(below) if below else min(table)
    return at, table[at]


def links_note(profile: dict[str, Any], nodes: int) -> str | None:
    """What the link figure at ``nodes`` nodes rests on, said where the model projects across
    nodes: measured at that count, or read from another count (an extrapolation); None on one
    node. Without per-count measurements: the profile's single inter-node figure."""
    if nodes < 2:
        return None
    found = links_at(profile, nodes)
    if found is None:
        return f"links across {nodes} nodes: the profile's inter-node figure (not measured per node count)"
    at, _ = found
    measured = ", ".join(str(n) for n in sorted(int(k) for k in profile["inter_node_links"]))
    if at == nodes:
        return f"links across {nodes} nodes: measured there (autotune calibrate --nodes: {measured})"
    return (
        f"links across {nodes} nodes: extrapolated from the {at}-node measurement (measured at {measured} nodes; "
        f"run autotune calibrate --nodes {nodes} on the cluster to measure it)"
    )
