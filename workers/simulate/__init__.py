"""The ``simulate`` probe: an analytical performance and memory model of LLM training and
inference, vectorised over many configurations.

It prices a whole population of configs in one numpy pass (``simulate_configs``) so the search
can pre-screen the space, and answers single trials through the probe protocol
(``simulate_trial``). Numbers it produces are tagged ``source='simulated'`` and never presented
as measured. The model: ``_memory`` (model states, activations, buffers of the most loaded
pipeline stage), ``_timing`` (one training step), ``_infer`` (prefill and decode), ``_checks``
(structural validity), ``_columns`` (params to columns); roofline and collective helpers in
``_common``. Hardware figures come from ``autotune.workers.hardware`` profiles; the MFU uses
``autotune.objectives.flops_per_token``, the same definition as for measured runs.

Rank order: tp innermost, then cp, then dp, pp outermost (Megatron-LM's default), which decides
whether a group's collectives run over the intra- or the inter-node links.

Training outputs (arrays of N): step_time_s, tokens_per_s, tokens_per_s_per_device,
samples_per_s, mfu, peak_memory_gib, memory_limit_gib, memory_headroom_gib, fits, valid, and the
breakdowns ``mem_<component>`` (GiB, summing to peak_memory_gib) and ``time_<component>``
(seconds per step, summing to step_time_s). Inference: ttft_ms, decode_tokens_per_s,
time_for_100_tokens_s, the same memory columns (with mem_kv_cache) and time_prefill /
time_decode_* breakdowns.

Serving (``workload['kind'] == 'serve'``, ``_serve``): an engine with continuous batching under
open-loop traffic. Fit as the engine decides it at start-up (weights, activations, graph pool and
reserve under ``memory_utilization``, the rest KV cache of at least one ``max_model_len``
sequence); per rate of the traffic's ladder TTFT/TPOT/ITL/E2E p50/p90/p99, goodput and SLO
attainment; at the operating point the probe's metrics (``objectives`` names), plus
``max_rate_rps_model`` (the largest rate meeting the SLO, continuous; ``_per_device`` too), ``capacity_rps``,
``max_concurrency``, ``kv_cache_tokens`` and the closed-loop ``batch{b}_*`` figures.

Optional workload keys beyond the spec's: ``flash_attention`` (default true), ``dropout``
(default: GPT yes, Llama no), ``grad_dtype`` (fp32 | bf16 | fp16 gradient buffers),
``overlap_grad_reduce`` (default true).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np
from autotune.objectives import flops_per_token
from autotune.objectives.serving import cost_per_million

from ..hardware import load_profile
from ..parameters import prefill_tensor_parallel, serving_default, value
from ..protocol import ProbeResult, TrialRequest
from ._checks import max_model_len, prepare, row_reason, sanitize
from ._columns import columns_from_params
from ._common import GIB, HW, Shape
from ._infer import infer_points
from ._memory import train_memory
from ._serve import SERVE_MEM_COMPONENTS, SLO_METRICS, Traffic
from ._serving import LIMITS, serve
from ._timing import COMM_TERMS, reference_columns, train_time

__all__ = [
    "simulate_configs",
    "columns_from_params",
    "simulate_trial",
    "resolve_hardware",
    "TRAIN_MEM_COMPONENTS",
    "TRAIN_TIME_COMPONENTS",
    "COMM_TERMS",
    "SERVE_MEM_COMPONENTS",
    "SERVE_METRICS",
]

TRAIN_MEM_COMPONENTS = (
    "weights",
    "grads",
    "optimizer",
    "activations",
    "logits",
    "zero3_gather",
    "comm_buffers",
    "runtime_reserve",
    "fragmentation",
)
TRAIN_TIME_COMPONENTS = (
    "gemm",
    "attention",
    "elementwise",
    "launch",
    "recompute",
    "tp_comm",
    "cp_comm",
    "pp_bubble",
    "pp_p2p",
    "dp_comm",
    "zero3_comm",
    "optimizer",
)
# The serving probe's metrics at its operating point (objectives/__init__.py, workload "serve").
SERVE_METRICS = (
    "goodput_rps",
    "goodput_rps_per_device",
    "max_rate_rps",
    "slo_attainment",
    "request_throughput_rps",
    "output_tokens_per_s",
    "output_tokens_per_s_per_device",
    *(f"{m}_p{q}_ms" for m in SLO_METRICS for q in (50, 90, 99)),
    "kv_cache_usage",
    "preemptions",
    "requests_failed",
)
_SERVE_EXTRA = (
    "cost_per_million_output_tokens",  # where the cluster has a cost_per_device_hour
    "max_rate_rps_model",
    "max_rate_rps_model_per_device",
    "capacity_rps",
    "max_concurrency",
    "kv_cache_tokens",
)
# the training figures a simulated trial reports (besides its memory)
TRAIN_SIM_METRICS = (
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "samples_per_s",
    "mfu",
    "comm_fraction",
    "scaling_efficiency",
)
# the inference figures a trial reports (headline and per batch: objectives.INFER_POINT_METRICS)
INFER_METRIC_PREFIXES = ("ttft_ms", "decode_tokens_per_s", "time_for_100_tokens_s")
_DEFAULT_PROFILE = {"npu": "ascend-910b", "cuda": "a100-sxm-80gb", "gpu": "a100-sxm-80gb", "cpu": "cpu"}


def simulate_configs(
    model: dict, workload: dict, hardware: dict, cluster: dict, configs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Predicted metrics, memory and time breakdowns for N configs (columns of canonical params,
    see ``columns_from_params``; missing columns take their defaults, dp and grad_accum are
    derived from the cluster and the workload when absent). Invalid configs get ``valid=False``,
    ``fits=False`` and NaN metrics."""
    return _simulate(model, workload, hardware, cluster, configs)[0]


def _simulate(
    model: dict, workload: dict, hardware: dict, cluster: dict, configs: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    hw = HW.of(hardware, cluster)
    s, c, world, checks = prepare(model, workload, cluster, configs)
    valid = ~np.logical_or.reduce([mask for _, mask in checks])
    if str(workload.get("kind", "train")) == "serve":
        return _serve_columns(s, hw, c, workload, valid, cluster.get("cost_per_device_hour"))
    if str(workload.get("kind", "train")) == "infer":
        sanitize(c, valid, ("tp", "pp"))
        c["batch_size"] = np.where(valid, c["batch_size"], 0.0)
        out = infer_points(s, hw, c, workload)
        metrics = tuple(k for k in out if k.startswith(INFER_METRIC_PREFIXES))
    else:
        sanitize(c, valid, ("tp", "pp", "cp", "vpp", "dp", "micro_batch_size", "grad_accum"))
        for k in ("zero_stage", "recompute", "precision"):
            c[k] = np.where(valid, c[k], 0.0)
        out = _train(s, hw, c, workload, model)
        metrics = TRAIN_SIM_METRICS
    n = valid.size
    limit = np.full(n, hw.mem_bytes / GIB)
    out["memory_limit_gib"] = limit
    out["memory_headroom_gib"] = limit - out["peak_memory_gib"]
    out["valid"] = valid
    out["fits"] = valid & (out["peak_memory_gib"] <= limit)
    for key in (*metrics, "peak_memory_gib", "memory_headroom_gib"):
        out[key] = np.where(valid, out[key], np.nan)
    return out, {}


def _serve_columns(
    s: Shape, hw: HW, c: dict, workload: Mapping[str, Any], valid: np.ndarray, cost_per_device_hour: Any = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Serving columns; metrics are NaN where the config is invalid or the engine would refuse to
    start (it reports nothing then). With the cluster's ``cost_per_device_hour``, the cost per
    million output tokens at the operating point, by the definition measured runs use
    (:func:`autotune.objectives.serving.cost_per_million_output_tokens`)."""
    sanitize(c, valid, ("tp", "pp", "replicas", "max_num_seqs", "max_num_batched_tokens"))
    c["memory_utilization"] = np.where(valid, c["memory_utilization"], serving_default("memory_utilization"))
    c["block_size"] = np.where(valid, c["block_size"], 0.0)
    for k in ("graph_mode", "kv_cache_dtype", "quantization", "precision", "kv_connector", "prefill_tp"):
        c[k] = np.where(valid, c[k], 0.0)
    c["prefill_replicas"] = np.where(valid, c["prefill_replicas"], 0.0)
    out, per_rate = serve(s, hw, c, workload)
    if cost_per_device_hour is not None:
        devices = out["devices"]
        tokens = out["output_tokens_per_s"]
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = cost_per_million(float(cost_per_device_hour), devices, tokens)
        out["cost_per_million_output_tokens"] = np.where(tokens > 0, cost, np.nan)
    fits = valid & out["fits"]
    out["valid"] = valid
    out["fits"] = fits
    out["memory_headroom_gib"] = out["memory_limit_gib"] - out["peak_memory_gib"]
    for key in ("peak_memory_gib", "memory_headroom_gib"):
        out[key] = np.where(valid, out[key], np.nan)
    for key in out:
        if key in SERVE_METRICS or key in _SERVE_EXTRA or key.startswith("batch"):
            out[key] = np.where(fits, out[key], np.nan)
    return out, per_rate


def _train(s: Shape, hw: HW, c: dict, workload: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, np.ndarray]:
    params_first, mem_first = train_memory(s, hw, c, workload, first=True)
    params_last, mem_last = train_memory(s, hw, c, workload, first=False)
    # with fewer layers on the first stage, the second (when it is not the last) may be the fullest:
    # priced only when some config has such a stage (the common even split needs no third pass)
    has_second = (c["pp"] > 2) & (c["first_stage_layers"] > 0)
    if has_second.any():
        params_second, mem_second = train_memory(s, hw, c, workload, first=True, second=True)
    else:
        params_second, mem_second = params_first, mem_first
    peaks = np.stack([sum(mem_first.values()), sum(mem_last.values()), sum(mem_second.values())])
    peaks[2] = np.where(has_second, peaks[2], -np.inf)
    fullest = np.argmax(peaks, axis=0)
    out: dict[str, np.ndarray] = {}
    for k in TRAIN_MEM_COMPONENTS:
        out[f"mem_{k}"] = np.choose(fullest, [mem_first[k], mem_last[k], mem_second[k]]) / GIB
    out["peak_memory_gib"] = np.max(peaks, axis=0) / GIB
    params = np.maximum(np.maximum(params_first, params_last), np.where(has_second, params_second, 0.0))
    times = train_time(s, hw, c, workload, params)
    step = sum(times[k] for k in TRAIN_TIME_COMPONENTS)
    for k in TRAIN_TIME_COMPONENTS:
        out[f"time_{k}"] = times[k]
    seq = float(workload["seq_len"])
    gbs = float(workload["global_batch_size"])
    world = c["world"]
    out["step_time_s"] = step
    out["tokens_per_s"] = gbs * seq / step
    out["tokens_per_s_per_device"] = out["tokens_per_s"] / world
    out["samples_per_s"] = gbs / step
    out["mfu"] = flops_per_token(model, int(seq), True) * out["tokens_per_s_per_device"] / hw.peak_of(c["precision"])
    out["comm_fraction"] = sum(times[k] for k in COMM_TERMS) / step
    # each rank does the same work at the reference size: tokens/s/device's ratio is the steps'
    reference = train_time(s, hw, reference_columns(c, hw), workload, params)
    out["scaling_efficiency"] = sum(reference[k] for k in TRAIN_TIME_COMPONENTS) / step
    return out


def resolve_hardware(cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The hardware profile of a trial: ``cluster['hardware']`` as a full profile dict, a profile
    name, or a partial dict ``{name: ..., <overrides>}``; else the default profile of
    ``cluster['accelerator']``."""
    hw = cluster.get("hardware")
    if isinstance(hw, str):
        return load_profile(hw)
    if isinstance(hw, Mapping):
        if "peak_tflops" in hw and "gemm_efficiency" in hw:
            return dict(hw)
        name = hw.get("name") or _DEFAULT_PROFILE.get(str(cluster.get("accelerator", "cuda")), "a100-sxm-80gb")
        return load_profile(str(name), {k: v for k, v in hw.items() if k != "name"} or None)
    accel = str(cluster.get("accelerator", "cpu"))
    if accel not in _DEFAULT_PROFILE:
        raise ValueError(f"no default hardware profile for accelerator {accel!r}")
    return load_profile(_DEFAULT_PROFILE[accel])


def simulate_trial(request: TrialRequest) -> ProbeResult:
    """One trial through the analytical model: 'ok' with metrics, 'oom' when the predicted peak
    exceeds the device memory, 'invalid' when the config cannot run at all. The memory and time
    breakdowns go into ``info``."""
    start = time.perf_counter()
    try:
        hardware = resolve_hardware(request.cluster)
        workload = dict(request.workload)
        cols = columns_from_params([request.params])
        out, per_rate = _simulate(request.model, workload, hardware, request.cluster, cols)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return ProbeResult(
            status="invalid", source="simulated", reason=f"simulate: {exc}", wall_s=time.perf_counter() - start
        )
    row = {k: (bool(v[0]) if v.dtype == bool else float(v[0])) for k, v in out.items()}
    info = {
        "hardware": hardware.get("name", ""),
        "memory_gib": {k[4:]: round(v, 4) for k, v in row.items() if k.startswith("mem_")},
        "time_s": {k[5:]: v for k, v in row.items() if k.startswith("time_")},
        "model": "autotune analytical model (roofline GEMMs, Korthikanti activations, ring collectives)",
    }
    wall = time.perf_counter() - start
    if not row["valid"]:
        _, c, _, checks = prepare(request.model, workload, request.cluster, cols)
        return ProbeResult(
            status="invalid",
            source="simulated",
            reason=row_reason(checks, c),
            wall_s=wall,
            info={"hardware": info["hardware"]},
        )
    if workload.get("kind") == "serve":
        return _serve_result(workload, row, per_rate, info, wall, request.params)
    peak, limit = row["peak_memory_gib"], row["memory_limit_gib"]
    if not row["fits"]:
        top = sorted(info["memory_gib"].items(), key=lambda kv: -kv[1])[:3]
        detail = ", ".join(f"{k} {v:.1f}" for k, v in top)
        info["predicted_peak_memory_gib"] = peak
        return ProbeResult(
            status="oom",
            source="simulated",
            wall_s=wall,
            info=info,
            reason=f"predicted peak memory {peak:.1f} GiB exceeds the device limit {limit:.1f} GiB "
            f"(largest: {detail} GiB)",
        )
    if workload.get("kind", "train") == "infer":
        keys = (*(k for k in row if k.startswith(INFER_METRIC_PREFIXES)), "peak_memory_gib", "memory_headroom_gib")
    else:
        keys = (*TRAIN_SIM_METRICS, "peak_memory_gib", "memory_headroom_gib")
    return ProbeResult(status="ok", source="simulated", metrics={k: row[k] for k in keys}, wall_s=wall, info=info)


def deployment(params: Mapping[str, Any], devices: int) -> dict[str, Any]:
    """What a serving config deploys: aggregated instances, or a disaggregated deployment's pools
    and its KV connector (``auto`` as written: the export resolves it on the accelerator)."""
    pp = value(params, "pp")
    decode = {"instances": value(params, "replicas"), "tp": value(params, "tp"), "pp": pp}
    if value(params, "prefill_replicas") <= 0:
        return {"kind": "aggregated", "instances": decode, "devices": devices}
    return {
        "kind": "disaggregated",
        "prefill": {"instances": value(params, "prefill_replicas"), "tp": prefill_tensor_parallel(params), "pp": pp},
        "decode": decode,
        "kv_connector": value(params, "kv_connector"),
        "devices": devices,
    }


def _serve_result(
    workload: Mapping[str, Any],
    row: dict[str, Any],
    per_rate: dict[str, Any],
    info: dict[str, Any],
    wall: float,
    params: Mapping[str, Any],
) -> ProbeResult:
    """A serving trial: 'oom' in the engine's words when it would refuse to start, else the
    probe's metrics at the operating point and, in ``info['serving']``, the per-rate predictions
    in the probe's shape."""
    info["memory_gib"] = {k: round(row[f"mem_{k}"], 4) for k in SERVE_MEM_COMPONENTS}
    info["model"] = (
        "autotune analytical serving model (engine start-up memory rule, roofline iterations, continuous "
        "batching, G/G/c queueing)"
    )
    mem = info["memory_gib"]
    if not row["fits"]:
        info["predicted_peak_memory_gib"] = row["peak_memory_gib"]
        limit = row["memory_limit_gib"]
        if row["weights_oom"]:
            reason = (
                f"not enough memory for the weights: {mem['weights']:.1f} GiB of weights per device plus the "
                f"{mem['runtime_reserve']:.1f} GiB runtime exceed the device's {limit:.1f} GiB (predicted)"
            )
        else:
            util = row["memory_budget_gib"] / limit
            reason = (
                f"not enough memory for the KV cache: memory_utilization {util:g} x {limit:.1f} GiB = "
                f"{row['memory_budget_gib']:.1f} GiB, of which weights {mem['weights']:.1f}, activations "
                f"{mem['activations']:.1f}, graph pool {mem['graph_pool']:.1f}, runtime "
                f"{mem['runtime_reserve'] + mem['comm_buffers']:.1f} GiB leave {max(row['kv_available_gib'], 0.0):.2f}"
                f" GiB; one {max_model_len(workload)}-token sequence needs {row['kv_need_one_gib']:.2f} GiB (predicted)"
            )
        return ProbeResult(status="oom", source="simulated", wall_s=wall, info=info, reason=reason)
    keys = (*SERVE_METRICS, *_SERVE_EXTRA, "peak_memory_gib", "memory_headroom_gib")
    metrics = {k: row[k] for k in keys if k in row}  # the cost only where the cluster has one
    metrics.update({k: v for k, v in row.items() if k.startswith("batch")})
    rates = []
    for i in range(per_rate["rate"].shape[1]):
        entry = {k: v[0, i].item() for k, v in per_rate.items()}
        entry["slo_met"] = bool(entry["slo_met"])
        entry["requests"] = int(entry["requests"])
        entry["failed"] = 0
        rates.append(entry)
    traffic = Traffic.of(workload)
    info["serving"] = {
        "slo": traffic.slo,
        "rates": rates,
        "operating_rate": row["operating_rate_rps"],
        "engine": "simulated",
        "closed_loop": {
            str(b): {
                "ttft_ms": row[f"batch{b}_ttft_ms"],
                "time_for_100_tokens_s": row[f"batch{b}_time_for_100_tokens_s"],
                "output_tokens_per_s": row[f"batch{b}_output_tokens_per_s"],
            }
            for b in traffic.batch_sweep
        },
        "capacity_rps": row["capacity_rps"],
        "max_rate_rps_model": row["max_rate_rps_model"],
        # what stops the rate growing (capacity, or the SLO metric missed first), and the deployment
        "limited_by": LIMITS[int(row["slo_limit"])],
        "deployment": deployment(params, int(row["devices"])),
        "max_concurrency": row["max_concurrency"],
        "kv_cache_tokens": row["kv_cache_tokens"],
    }
    return ProbeResult(status="ok", source="simulated", metrics=metrics, wall_s=wall, info=info)
