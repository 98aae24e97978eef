"""The usable memory of the study's devices, measured before its first probe (issue 41).

The stacks' logs print allocated and reserved peaks, never the memory the device leaves to the
allocator (a few percent under the nominal capacity: the runtime's context, the driver's own, other
processes), and a guide that believes the nominal capacity runs configs that fit it and not the
device. So a real study first runs the device check (:mod:`autotune.workers.device_check`) in this
python with the trial environment's variables (the visible devices, the allocator setting the spec
fixes): the torch probe, the stack presets and the command backend alike, since it measures the
device, not the launcher. Where this python cannot drive the device (no ``torch_npu`` here while the
team's launcher has it), the check says why and the study learns the usable memory from its
probes' out-of-memory messages instead. A device's figure is cached per host and software, as
calibration is (``AUTOTUNE_PROFILE_CACHE``); the CPU's, a share of the host's memory that changes
with its load, is measured each time. A Ray cluster's trials run on other nodes: there the probes
measure it (the torch probe reports it with every result).

The figure becomes the hardware profile's ``usable_memory_gib`` (through ``cluster.overrides``),
which the guide starts from (:meth:`autotune.guide.guided.Guide.usable_limit`), and the study reports it.
On an accelerator the check also reads the device's total: it becomes the profile's device memory,
and what the runtime held then its runtime reserve (:func:`check_overrides`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..spec.schema import Spec

__all__ = ["USABLE_ATTR", "check_overrides", "measure_usable_memory", "with_usable_memory", "why_not_measured"]

USABLE_ATTR = "autotune.usable_memory"  # the study's user attribute: what the device check said


def why_not_measured(spec: Spec, simulated: bool) -> str | None:
    """None when the study measures its devices' usable memory first; else why not."""
    if simulated:
        return "the simulator's study: no device"
    if spec.ray.enabled and spec.ray.address:
        return "the trials run on Ray cluster nodes: each torch probe reports its devices' usable memory"
    if spec.backend.kind == "mindspore":
        return "MindSpore exposes no free-memory query before a graph runs: its probes' OOM messages teach it"
    return None


def _cache_path(spec: Spec) -> Path:
    from .host_profile import PROFILE_CACHE_ENV, calibration_key

    key = {**calibration_key(spec), "check": "usable_memory"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    base = Path(os.environ.get(PROFILE_CACHE_ENV) or Path.home() / ".cache" / "autotune" / "profiles")
    return base / f"usable-{spec.cluster.accelerator}-{digest}.json"


def _check_env(spec: Spec) -> dict[str, str]:
    """This process's environment with the spec's fixed env settings (a searched one varies per
    trial: the check takes none of its values)."""
    env = dict(os.environ)
    for name, values in spec.space.env.items():
        if len(values) == 1:
            env[name] = str(values[0])
    return env


def measure_usable_memory(spec: Spec, timeout_s: float = 120.0) -> dict[str, Any]:
    """The device check's answer for the spec's accelerator, from the cache where a device's is kept:
    ``{usable_memory_gib, total_memory_gib, how, measured_at, cached}``, or ``{error}``."""
    accelerator = spec.cluster.accelerator
    cache = _cache_path(spec) if accelerator != "cpu" else None
    if cache is not None and cache.is_file():
        try:
            return {**json.loads(cache.read_text()), "cached": True}
        except (OSError, ValueError):
            cache.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "autotune.workers.device_check", "--accelerator", accelerator]
    try:
        done = subprocess.run(argv, env=_check_env(spec), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the device check did not answer within {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        out = json.loads(lines[-1]) if lines else {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    except ValueError:
        out = {"error": "the device check printed no JSON"}
    if "error" in out:
        return out
    out["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(out))
        os.replace(partial, cache)
    return {**out, "cached": False}


def check_overrides(spec: Spec, found: Mapping[str, Any]) -> dict[str, float]:
    """The hardware profile's figures a device check's answer sets (``cluster.overrides``):
    ``usable_memory_gib``, what a probe's allocator can use; and on an accelerator whose check read
    the device's total (``mem_get_info`` on cuda and npu; the host's memory on the CPU says nothing
    of a runtime), the device's memory as its runtime reports it (``device_memory_gib``, where below
    the profile's) and what the runtime held when the check ran, total less usable, as
    ``runtime_reserve_gib`` (a measurement where the profile's is a guess: 4 GiB on the 910B from
    MindSpeed's flat allowance).

    Why: a peak reported as the device's (npu-smi's, a team's launcher's own) holds the runtime's
    whole reserve, and what bounds it is the device's total. The guide's bound was the usable
    memory plus the profile's reserve, which is that total only when the profile's reserve is
    right: in a world of benchmarks/search_efficiency.py whose runtime held 5.6 GiB where the
    profile says 4.0, the optimum, at 97 % of the device, was believed 2.5 % over it and never run."""
    usable = float(found["usable_memory_gib"])
    out = {"usable_memory_gib": usable}
    total = found.get("total_memory_gib")
    if spec.cluster.accelerator == "cpu" or not total or float(total) <= usable:
        return out
    from ..workers.hardware import load_profile

    profile = load_profile(spec.cluster.profile_name, spec.cluster.overrides)
    total = float(total)
    if total < float(profile["device_memory_gib"]):
        out["device_memory_gib"] = round(total, 4)
    out["runtime_reserve_gib"] = round(total - usable, 4)
    return out


def with_usable_memory(spec: Spec, simulated: bool, say: Callable[[str], None]) -> tuple[Spec, dict[str, Any]]:
    """The spec with the measured usable memory in its hardware profile (``cluster.overrides``), and
    what the check said (``{}`` where no check runs). A check that fails is said; the study goes on
    and learns the usable memory from its probes."""
    why = why_not_measured(spec, simulated)
    if why is not None:
        return spec, {}
    found = measure_usable_memory(spec)
    if "error" in found:
        say(f"usable memory not measured ({found['error']}); the probes' out-of-memory messages will teach it")
        return spec, found
    usable = float(found["usable_memory_gib"])
    checked = check_overrides(spec, found)
    total = ""
    if "runtime_reserve_gib" in checked:  # the device's total was read: the report says what the runtime held
        found = {**found, "runtime_held_gib": checked["runtime_reserve_gib"]}
        total = f" of {float(found['total_memory_gib']):.2f} GiB the runtime reports"
    say(
        f"usable memory: {usable:.2f} GiB per device{total} ({found['how']}"
        + (", cached" if found.get("cached") else "")
        + ")"
    )
    overrides = {**spec.cluster.overrides, **checked}
    cluster = spec.cluster.model_copy(update={"overrides": overrides})
    return spec.model_copy(update={"cluster": cluster}), found
