"""Measure this host's device and write a hardware profile the simulator can use.

    autotune calibrate --accelerator cpu --out my_host.yaml      (or python -m autotune.workers.calibrate)

The bundled profiles hold data-sheet figures; a machine in front of the user may differ a lot
(a CPU without native bf16 runs bf16 matmuls 10-50x slower than fp32; a 910B variant clocks
differently). Calibration measures what the simulator's formulas take as inputs:

- **GEMM**: linear layers (forward, data and weight gradients) per precision, device-synchronised,
  median of repeats, at squares of growing
  size and at the thin shapes of transformer layers (tokens x hidden x QKV/MLP width, sharded over
  tp 1 and 2). One efficiency curve ``rate(m, k, n) = plateau * prod(d / (d + half))`` (the
  simulator's) is fitted to all of them: ``gemm_half_dim`` shared, ``peak_tflops`` per precision
  (so bf16 on a CPU without native bf16 is priced at the rate it runs the model's shapes, not at
  a square's); ``gemm_efficiency`` is then 1 (MFU against this profile is MFU against the fitted
  plateau, which the file's header says).
- **memory bandwidth**: a large device-to-device copy (read + write bytes / time).
- **attention, elementwise work, kernel dispatch** (``calibrate_kernels``): causal SDPA against the
  GEMM plateau (``flash_attention_efficiency``), a layer's norm / activation / residual chain
  against the copy (``memory_bandwidth_efficiency``), a small op's host time (``kernel_launch_us``),
  an optimizer step's fixed cost per parameter tensor (``optimizer_us_per_tensor``).
- **collectives**: all-reduce, all-gather and a point-to-point hop between ``--ranks`` processes
  with the device's backend (gloo on the CPU), at message sizes from what tensor parallelism sends
  per layer up to gradient buckets; ``t = latency + ring share * bytes / bus bandwidth`` fitted to
  them gives ``collective_latency_us`` (what a small message pays between idle ranks) and the
  bandwidth.
- **a tensor-parallel layer step in context** (``calibrate_layer``): the probe's block sharded
  over the ranks against its local shard; what each collective costs beyond its bytes there
  (DTensor dispatch, rank skew) is ``tp_collective_latency_us``, the latency the simulator's
  tensor-parallel collectives pay.

Every other figure is taken from the base profile of the accelerator. The measurements go into the
file's header comments, so the profile says where its numbers came from. Device-agnostic: the
device is looked up once (cpu, cuda, npu via torch_npu) and timing synchronises it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from .calibrate_kernels import measure_attention, measure_dispatch, measure_elementwise, measure_optimizer_step, timed
from .calibrate_collectives import calibration_device, fit_latency_bandwidth, measure_collectives
from .calibrate_layer import fit_tp_latency
from .hardware import load_profile, validate_profile
from .torch_probe._device import device_module, device_name, software_versions

__all__ = ["calibrate", "write_profile", "fit_half_dim", "fit_gemm_curve", "fit_latency_bandwidth", "layer_shapes"]

DTYPES = ("fp32", "bf16", "fp16")
BASE_PROFILE = {"cpu": "cpu", "cuda": "a100-sxm-80gb", "npu": "ascend-910b"}
SIZES = {"cpu": (128, 256, 512, 1024), "cuda": (1024, 2048, 4096, 8192), "npu": (1024, 2048, 4096, 8192)}
QUICK_SIZES = {"cpu": (64, 128, 256), "cuda": (512, 1024, 2048), "npu": (512, 1024, 2048)}


# ------------------------------------------------------------------------------------- device
def device_memory_gib(accelerator: str) -> float | None:
    """The device's memory as the device (or, on a CPU, the OS) reports it: what a profile's
    ``device_memory_gib`` must say (a figure carried over from a data-sheet profile can be the
    wrong machine's: 64 GiB written on a 24 GiB host). None where it cannot be read."""
    if accelerator == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError, AttributeError):
            return None
    try:
        return float(device_module(accelerator).get_device_properties(0).total_memory) / 2**30
    except Exception:  # a runtime without the call: the base profile's figure stays, named as not measured
        return None


def resolved_bandwidths(
    fitted: dict[str, tuple[float, float]], ceiling_bytes_s: float
) -> dict[str, tuple[float, float | None]]:
    """The collective fits with each bandwidth a link can reach, else None: a fit above
    ``ceiling_bytes_s`` (the device's own copy bandwidth, which no transfer between two devices
    of the host beats) means the times never grew with the size measured (latency-bound at every
    size): there is no bandwidth in them to report (a quick CPU run's send/recv fit gave 1 PB/s)."""
    return {name: (lat, bw if 0 < bw <= ceiling_bytes_s else None) for name, (lat, bw) in fitted.items()}


def collective_fields(
    fitted: dict[str, tuple[float, float]],
    resolved: dict[str, tuple[float, float | None]],
    tp_layer: dict[str, Any] | None,
    ceiling_bytes_s: float,
) -> dict[str, float]:
    """The profile's collective figures from the fits: ``collective_latency_us`` and
    ``tp_collective_latency_us`` whenever collectives were measured, the bandwidth and the
    efficiencies only where the all-reduce's bandwidth resolved. A latency-bound all-reduce (its
    times never grew with the size, as on a loaded 2-core host) still measured its latency; its
    bytes cost no more than a copy at the device's own bandwidth, which prices the tensor-parallel
    layer's bytes term (dropping both latencies there left the base profile's figure in place of a
    measurement, and no ``tp_collective_latency_us`` at all)."""
    if not fitted or "allreduce" not in fitted:
        return {}
    ar_latency, ar_bw = fitted["allreduce"]
    ag_latency = fitted["allgather"][0] if "allgather" in fitted else ar_latency / 2.0
    # The simulator's collectives: t = latency + ring share * bytes / (intra bandwidth * efficiency)
    # (an all-reduce pays the latency twice: reduce-scatter then all-gather).
    fields: dict[str, float] = {"collective_latency_us": round(max(ar_latency / 2.0, ag_latency) * 1e6, 2)}
    bytes_rate = ceiling_bytes_s
    if resolved["allreduce"][1] is not None:
        bytes_rate = ar_bw
        fields["intra_node_bandwidth_gbps"] = _significant(ar_bw / 1e9)
        fields["allreduce_efficiency"] = 1.0
        # a quick run's all-gather fit (3 sizes, latency-bound) can put its bandwidth near zero or
        # past any link: keep the ratio in the profile's valid range
        ag_resolved = "allgather" in resolved and resolved["allgather"][1] is not None
        ag_ratio = fitted["allgather"][1] / ar_bw if ag_resolved else 1.0
        fields["allgather_efficiency"] = _significant(min(1.0, max(0.01, ag_ratio)))
    if tp_layer and tp_layer.get("rows"):
        # What a tensor-parallel layer's collectives pay in context (dispatch, skew), never less
        # than what the idle ranks measured.
        tp_latency = fit_tp_latency(tp_layer, bytes_rate)
        fields["tp_collective_latency_us"] = round(max(tp_latency * 1e6, fields["collective_latency_us"]), 2)
    return fields


# ---------------------------------------------------------------------------------- measurements
Shape = tuple[int, int, int]  # (m, k, n) of an (m x k) @ (k x n) matmul


def layer_shapes(hidden: int, ffn: int, tokens: tuple[int, ...], tps: tuple[int, ...] = (1, 2)) -> list[Shape]:
    """The forward GEMMs of a Llama layer as the simulator prices them (``tokens`` rows of one
    micro-batch; QKV, attention output, gate+up, down), each sharded over every ``tp``: the thin
    shapes a model really runs, not only squares, so the fitted curve is right where it is used."""
    shapes: list[Shape] = []
    for tok in tokens:
        for tp in tps:
            for k, n in (
                (hidden, 2 * hidden // tp),
                (hidden // tp, hidden),
                (hidden, 2 * ffn // tp),
                (ffn // tp, hidden),
            ):
                shapes.append((tok, max(1, k), max(1, n)))
    return sorted(set(shapes))


# Layer shapes of models each accelerator runs (CPU: the tiny probes' hidden sizes).
LAYER_SHAPES = {
    "cpu": layer_shapes(256, 688, (256, 1024)) + layer_shapes(512, 1376, (512,), (1,)),
    "cuda": layer_shapes(4096, 11008, (4096,)),
    "npu": layer_shapes(4096, 11008, (4096,)),
}
QUICK_LAYER_SHAPES = {
    "cpu": layer_shapes(256, 688, (256,)),
    "cuda": layer_shapes(4096, 11008, (2048,), (1,)),
    "npu": layer_shapes(4096, 11008, (2048,), (1,)),
}


def measure_gemm(
    accelerator: str,
    shapes: list[Shape],
    min_time_s: float,
    repeats: int,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[Shape, float]]:
    """TFLOPS of each (m, k, n) GEMM per precision as a linear layer runs it: ``F.linear`` forward
    and its backward (data and weight gradients: 3 GEMMs, 6mkn FLOPs), median of repeats,
    device-synchronised. Not ``torch.mm`` alone: kernels differ by op and layout (on a CPU without
    native bf16, a bf16 ``mm`` runs ~6x slower than the bf16 ``linear`` a model calls)."""
    torch, device, sync = calibration_device(accelerator)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    linear = torch.nn.functional.linear
    out: dict[str, dict[Shape, float]] = {}
    for name in DTYPES:
        out[name] = {}
        for i, (m, k, n) in enumerate(shapes):
            progress(f"GEMM {name} {m}x{k}x{n} ({i + 1}/{len(shapes)})")
            x = torch.randn(m, k, device=device).to(dtypes[name]).requires_grad_()
            w = torch.randn(n, k, device=device).to(dtypes[name]).requires_grad_()
            grad = torch.randn(m, n, device=device).to(dtypes[name])

            def step() -> None:
                x.grad = w.grad = None
                linear(x, w).backward(grad)

            seconds = timed(step, sync, min_time_s, repeats)
            out[name][(m, k, n)] = 6.0 * m * k * n / seconds / 1e12
    return out


# A GEMM timed at under this many times its step's host overhead (the same linear forward and
# backward on an 8x8x8 problem: Python, autograd and kernel launches, no arithmetic to speak of)
# measures the host, not the device, and is left out of the fit. On an H200 the step's overhead is
# ~160 us: 512^3, 1024^3 and 2048^3 each took 160-172 us (4.7, 40 and 320 TFLOP/s); fitted with
# the rest, the curve's plateau went to 2,734 TFLOP/s bf16 (the large shapes ran at 641-729; the
# data sheet's dense peak is ~990): the first run of the accelerator check on a GPU, 2026-11-28.
# Where the host and the device add up (a CPU), a step at 3x the overhead reads up to a third low.
HOST_BOUND_FACTOR = 3.0
OVERHEAD_SHAPE: Shape = (8, 8, 8)


def gemm_seconds(shape: Shape, tflops: float) -> float:
    """Seconds of one timed step (forward and backward of a linear layer, 6mkn FLOPs) at ``tflops``."""
    m, k, n = shape
    return 6.0 * m * k * n / (tflops * 1e12)


def device_bound(
    gemm: dict[str, dict[Shape, float]], overhead_s: dict[str, float], factor: float = HOST_BOUND_FACTOR
) -> tuple[dict[str, dict[Shape, float]], dict[str, list[Shape]]]:
    """The GEMM rates to fit (each precision's shapes whose step took at least ``factor`` times its
    host overhead) and the shapes left out per precision. A precision with fewer than two shapes
    that long keeps its two longest: a curve needs two points, and the longest are the least
    host-bound there are (the header says which were fitted)."""
    kept: dict[str, dict[Shape, float]] = {}
    left: dict[str, list[Shape]] = {}
    for precision, table in gemm.items():
        floor = factor * overhead_s.get(precision, 0.0)
        timed_s = {shape: gemm_seconds(shape, rate) for shape, rate in table.items() if rate > 0}
        long_enough = [shape for shape, t in timed_s.items() if t >= floor]
        if len(long_enough) < 2:
            long_enough = sorted(timed_s, key=timed_s.__getitem__)[-2:]
        kept[precision] = {shape: table[shape] for shape in long_enough}
        left[precision] = sorted(shape for shape in table if shape not in kept[precision])
    return kept, left


def measure_memory_bandwidth(accelerator: str, mib: int, min_time_s: float, repeats: int) -> float:
    """GB/s of a device copy (bytes read + bytes written)."""
    torch, device, sync = calibration_device(accelerator)
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), sync, min_time_s, repeats)
    return 2 * n * 4 / seconds / 1e9


# ------------------------------------------------------------------------------------------- fit
def _shape(key: int | Shape) -> Shape:
    return (key, key, key) if isinstance(key, int) else tuple(key)  # type: ignore[return-value]


def _efficiency(shape: Shape, half: float) -> float:
    return math.prod(d / (d + half) for d in shape)


# The plateau is at most this many times the fastest GEMM measured in its precision: the largest
# shapes measured run at >= 75 % of it. Past a device's knee (a GPU's large GEMMs all near one
# rate), the measurements do not fix ``half``, and a free fit explains the kernels' ~10 % spread
# with a huge ``half`` and a plateau to match (half 2,435, 2,737 TFLOP/s bf16 on an H200 whose large
# GEMMs ran at 641-707).
PLATEAU_HEADROOM = 1.0 / 0.75


def fit_gemm_curve(rates: dict[str, dict[Any, float]]) -> tuple[float, dict[str, float]]:
    """(``half``, plateau TFLOPS per precision) of ``rate(m, k, n) = plateau * prod(d / (d + half))``,
    the simulator's GEMM efficiency curve: one ``half`` shared by every precision (the simulator
    has one), a plateau per precision; least squares in log space over a grid of ``half``, the
    plateaus in closed form (the mean log residual), no plateau beyond ``PLATEAU_HEADROOM`` times
    the fastest rate measured (``half`` 0, the flat curve, always qualifies). Keys are (m, k, n)
    or a square's d."""
    best, best_err, best_plateaus = 0.0, math.inf, {}
    for half in [0.0] + [2 ** (k / 8) for k in range(0, 8 * 14)]:  # 1 .. 16k
        err, plateaus, extrapolates = 0.0, {}, False
        for precision, table in rates.items():
            logs = [math.log(r) - math.log(_efficiency(_shape(key), half)) for key, r in table.items() if r > 0]
            if not logs:
                continue
            mean = sum(logs) / len(logs)
            plateaus[precision] = math.exp(mean)
            extrapolates |= half > 0 and plateaus[precision] > PLATEAU_HEADROOM * max(table.values())
            err += sum((x - mean) ** 2 for x in logs)
        if err < best_err and not extrapolates:
            best, best_err, best_plateaus = half, err, plateaus
    return round(best, 2), best_plateaus


def fit_half_dim(rates: dict[Any, float]) -> float:
    """``half`` of the efficiency curve fitted to one precision's rates (see ``fit_gemm_curve``)."""
    return fit_gemm_curve({"one": rates})[0]


COLLECTIVE_KIB = {"cpu": (4, 32, 256, 1024, 8192), "cuda": (64, 1024, 16384, 131072), "npu": (64, 1024, 16384, 131072)}
QUICK_COLLECTIVE_KIB = {"cpu": (4, 64, 1024, 8192), "cuda": (64, 4096, 65536), "npu": (64, 4096, 65536)}


def calibrate(
    accelerator: str,
    *,
    quick: bool = False,
    ranks: int = 2,
    threads: int | None = None,
    base: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Measure and return ``{"profile": ..., "measured": ...}`` (the profile ready to write).

    ``base`` is the profile whose figures calibration does not measure (memory size, inter-node
    links, fragmentation) are kept: the spec's own (an H100 stays an H100), else the
    accelerator's default. On the CPU one "device" is one probe process: ``threads`` (default:
    cores / ranks, what the torch probe gives each rank) is the intra-op thread count the GEMMs
    and the copy run with."""
    if accelerator not in BASE_PROFILE:
        raise ValueError(f"accelerator must be one of {', '.join(BASE_PROFILE)}, got {accelerator!r}")
    if accelerator == "cpu":
        import torch

        threads = threads or max(1, (os.cpu_count() or 1) // max(1, ranks))
        torch.set_num_threads(threads)
    sizes = (QUICK_SIZES if quick else SIZES)[accelerator]
    shapes = sorted(set([(d, d, d) for d in sizes] + (QUICK_LAYER_SHAPES if quick else LAYER_SHAPES)[accelerator]))
    min_time, repeats = (0.02, 3) if quick else (0.2, 5)
    progress(f"GEMM {', '.join(DTYPES)} at {len(shapes)} shapes (squares and transformer-layer shapes)")
    gemm = measure_gemm(accelerator, shapes, min_time, repeats, progress)
    overhead = {
        k: gemm_seconds(OVERHEAD_SHAPE, rates[OVERHEAD_SHAPE])
        for k, rates in measure_gemm(accelerator, [OVERHEAD_SHAPE], min_time, repeats).items()
    }
    fitted_gemm, host_bound = device_bound(gemm, overhead)
    progress("memory bandwidth (device copy)")
    bandwidth = measure_memory_bandwidth(accelerator, 64 if quick else 512, min_time, repeats)
    progress("attention (causal SDPA), a layer's elementwise chain, a kernel's host dispatch, an optimizer step")
    torch, device, sync = calibration_device(accelerator)
    attention = measure_attention(accelerator, torch, device, sync, min_time, repeats)
    elementwise = measure_elementwise(accelerator, torch, device, sync, min_time, repeats)
    dispatch_s = measure_dispatch(torch, device, sync, min_time, repeats)
    optimizer_tensor_s = measure_optimizer_step(torch, device, sync, min_time, repeats)
    collectives: dict[str, dict[int, float]] = {}
    fitted: dict[str, tuple[float, float]] = {}
    tp_layer: dict[str, Any] = {}
    if ranks > 1:
        kib = (QUICK_COLLECTIVE_KIB if quick else COLLECTIVE_KIB)[accelerator]
        progress(
            f"all-reduce / all-gather / send-recv between {ranks} processes, {kib[0]} KiB to {kib[-1]} KiB; "
            f"a tensor-parallel layer step over them (tp {ranks}) against its local shard"
        )
        collectives, tp_layer = measure_collectives(accelerator, ranks, kib, max(repeats, 5), quick=quick)
        ring = {"allreduce": 2.0 * (ranks - 1) / ranks, "allgather": (ranks - 1) / ranks, "p2p": 1.0}
        fitted = {name: fit_latency_bandwidth(times, ring[name]) for name, times in collectives.items() if times}
    resolved = resolved_bandwidths(fitted, bandwidth * 1e9)
    memory_gib = device_memory_gib(accelerator)

    profile = load_profile(base or BASE_PROFILE[accelerator])
    half, plateaus = fit_gemm_curve(fitted_gemm)
    profile["name"] = f"calibrated-{platform.node() or accelerator}"
    name = device_name(accelerator, device_module(accelerator))  # the device measure_gemm bound
    profile["description"] = f"calibrated on {platform.node()} ({name}) {_dt.date.today().isoformat()}" + (
        " (quick)" if quick else ""
    )
    profile["calibrated_at"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    profile["peak_tflops"] = {**profile["peak_tflops"], **{k: _significant(plateaus[k], 6) for k in DTYPES}}
    profile["gemm_efficiency"] = 1.0
    profile["gemm_half_dim"] = half
    profile["memory_bandwidth_gbps"] = round(bandwidth, 2)
    # The simulator's memory-bound work (norms, activations, residuals, softmax, the optimizer) at
    # the rate this host runs a layer's elementwise chain, not at a copy's; its attention at the
    # rate SDPA runs against the GEMM plateau; its kernel dispatch as measured.
    profile["memory_bandwidth_efficiency"] = _significant(min(1.0, max(0.01, elementwise["gbps"] / bandwidth)))
    profile["flash_attention_efficiency"] = _significant(
        min(1.0, max(0.01, attention["tflops"] / plateaus[attention["dtype"]]))
    )
    profile["kernel_launch_us"] = _significant(dispatch_s * 1e6)
    profile["optimizer_us_per_tensor"] = _significant(optimizer_tensor_s * 1e6)
    if memory_gib:
        profile["device_memory_gib"] = round(memory_gib, 2)
    profile.update(collective_fields(fitted, resolved, tp_layer, bandwidth * 1e9))
    validate_profile(profile, "the measured profile")  # a degenerate measurement fails here, not in a study
    measured = {
        "gemm_tflops": {k: {"x".join(map(str, shape)): v for shape, v in table.items()} for k, table in gemm.items()},
        "gemm_host_overhead_us": {k: v * 1e6 for k, v in overhead.items()},
        "gemm_host_bound": {k: ["x".join(map(str, shape)) for shape in v] for k, v in host_bound.items() if v},
        "memory_bandwidth_gbps": bandwidth,
        "attention": attention,
        "elementwise": elementwise,
        "dispatch_us": dispatch_s * 1e6,
        "optimizer_us_per_tensor": optimizer_tensor_s * 1e6,
        "collective_seconds": {k: {str(n): t for n, t in v.items()} for k, v in collectives.items()},
        "collective_fit": {
            k: {"latency_us": lat * 1e6, "busbw_gbps": None if bw is None else bw / 1e9}
            for k, (lat, bw) in resolved.items()
        },
        "collective_busbw_gbps": {k: None if bw is None else bw / 1e9 for k, (_, bw) in resolved.items()},
        "device_memory_gib": memory_gib,
        "not_measured": sorted(_not_measured(profile, memory_gib, resolved)),
        "base_profile": base or BASE_PROFILE[accelerator],
        "tp_layer_step": tp_layer,
        "sizes": list(sizes),
        "quick": quick,
        "ranks": ranks,
        "threads_per_device": threads,
        "software": {**software_versions(accelerator), "python": platform.python_version()},
    }
    return {"profile": profile, "measured": measured}


# what calibration measures; the rest of a profile is the base profile's (its data sheet)
_MEASURED_KEYS = (
    "peak_tflops",
    "gemm_efficiency",
    "gemm_half_dim",
    "memory_bandwidth_gbps",
    "memory_bandwidth_efficiency",
    "flash_attention_efficiency",
    "kernel_launch_us",
    "optimizer_us_per_tensor",
)
_COLLECTIVE_KEYS = (
    "intra_node_bandwidth_gbps",
    "allreduce_efficiency",
    "allgather_efficiency",
    "collective_latency_us",
    "tp_collective_latency_us",
)
_DESCRIPTIVE = ("name", "accelerator", "description", "calibrated_at", "devices_per_node")


def _not_measured(
    profile: dict[str, Any], memory_gib: float | None, resolved: dict[str, tuple[float, float | None]]
) -> list[str]:
    """The profile's figures this calibration did not measure (kept from the base profile)."""
    measured = set(_MEASURED_KEYS) | ({"device_memory_gib"} if memory_gib else set())
    if resolved.get("allreduce", (0, None))[1] is not None:
        measured |= set(_COLLECTIVE_KEYS)
    return [k for k in profile if k not in measured and k not in _DESCRIPTIVE]


def _significant(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (not decimals: bf16 on a CPU runs at ~0.004 TFLOPS)."""
    return float(f"{x:.{digits}g}")


def _host_bound_line(m: dict[str, Any]) -> str:
    """The header line that says which GEMMs the plateau was not fitted to, and why."""
    overhead = m.get("gemm_host_overhead_us") or {}
    left = m.get("gemm_host_bound") or {}
    if not left:
        return f"# every GEMM above fitted (each step >= {HOST_BOUND_FACTOR:g}x its host overhead)"
    return (
        f"# not fitted, host-bound (step < {HOST_BOUND_FACTOR:g}x the host overhead of a linear step, us: "
        + ", ".join(f"{k} {v:.3g}" for k, v in overhead.items())
        + "): "
        + "; ".join(f"{k} {', '.join(shapes)}" for k, shapes in left.items())
    )


def write_profile(result: dict[str, Any], path: Path) -> Path:
    """The profile as YAML with the raw measurements in its header comments."""
    m = result["measured"]
    lines = [
        f"# Hardware profile written by `autotune calibrate` on {_dt.datetime.now().isoformat(timespec='seconds')}.",
        "# peak_tflops are the sustained matmul plateaus fitted here (gemm_efficiency 1), not data-sheet",
        "# peaks: MFU against this profile is MFU against what this device sustains.",
        f"# software: {json.dumps(m['software'])}; threads per device: {m['threads_per_device'] or 'all'}",
        "# GEMM TFLOPS measured (m x k x n): "
        + "; ".join(
            f"{k} " + ", ".join(f"{d}:{v:.4g}" for d, v in rates.items()) for k, rates in m["gemm_tflops"].items()
        ),
        _host_bound_line(m),
        (
            f"# attention (causal SDPA fwd+bwd, {m['attention']['dtype']}): {m['attention']['tflops']:.4g} TFLOPS; "
            f"elementwise chain fwd+bwd: {m['elementwise']['gbps']:.3g} GB/s; dispatch: {m['dispatch_us']:.3g} us; "
            f"optimizer step: {m['optimizer_us_per_tensor']:.3g} us per parameter tensor"
            if "attention" in m
            else "# attention, elementwise, dispatch: not measured"
        ),
        f"# device copy: {m['memory_bandwidth_gbps']:.1f} GB/s; collectives (latency us, bus bandwidth GB/s; null: "
        "latency-bound at every size measured, no bandwidth resolved): "
        + (
            json.dumps(
                {
                    k: {f: (None if v is None else round(v, 3)) for f, v in fit.items()}
                    for k, fit in m["collective_fit"].items()
                }
            )
            if m.get("collective_fit")
            else "not measured"
        ),
        "# device memory: "
        + (
            f"{m['device_memory_gib']:.2f} GiB as the device (or the OS) reports it"
            if m.get("device_memory_gib")
            else "not readable here"
        ),
        f"# not measured, kept from the base profile {m.get('base_profile', '?')!r} (data-sheet figures): "
        + (", ".join(m.get("not_measured") or []) or "none"),
        "# tensor-parallel layer step (seconds, sharded vs local shard): "
        + (
            json.dumps(
                [
                    {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
                    for row in m["tp_layer_step"]["rows"]
                ]
            )
            if m.get("tp_layer_step")
            else "not measured"
        ),
    ]
    if m.get("inter_node_seconds"):  # autotune calibrate --nodes: the fit is the profile's inter_node_links
        lines.append(
            f"# across nodes ({m.get('inter_node_ranks_per_node')} rank(s) per node; seconds per message size in "
            "bytes): " + json.dumps(m["inter_node_seconds"])
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(result["profile"], sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", choices=tuple(BASE_PROFILE), default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="CPU: threads per device (default cores / ranks)")
    args = ap.parse_args(argv)
    result = calibrate(
        args.accelerator,
        quick=args.quick,
        ranks=args.ranks,
        threads=args.threads,
        progress=lambda text: print(text, file=sys.stderr),
    )
    print(write_profile(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
