"""Metric definitions: what each objective means, its unit and default direction, and how it is
derived from a probe's raw measurements.

Installed as ``autotune.objectives``. Pure definitions: the simulator uses the same
``flops_per_token`` for its MFU as ``derive_metrics`` does for measured runs, so a simulated MFU
and a measured MFU are the same quantity.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "Metric",
    "METRICS",
    "ALIASES",
    "INFER_POINT_METRICS",
    "DECISION_METRICS",
    "workload_of_metrics",
    "batch_point",
    "get_metric",
    "flops_per_token",
    "matmul_params",
    "derive_metrics",
    "infer_headline",
]


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    direction: str  # 'maximize' | 'minimize'
    workload: str  # 'train' | 'infer'
    description: str

    def __post_init__(self) -> None:
        if self.direction not in ("maximize", "minimize"):
            raise ValueError(f"metric {self.name}: direction must be maximize or minimize")
        if self.workload not in ("train", "infer", "serve"):
            raise ValueError(f"metric {self.name}: workload must be train, infer or serve")


_ALL = [
    Metric(
        "tokens_per_s_per_device",
        "tokens/s/device",
        "maximize",
        "train",
        "training tokens processed per second divided by the devices the trial uses; the fair "
        "comparison across parallel layouts",
    ),
    Metric(
        "tokens_per_s",
        "tokens/s",
        "maximize",
        "train",
        "training tokens (global_batch_size x seq_len) per second over the whole job",
    ),
    Metric("samples_per_s", "samples/s", "maximize", "train", "sequences per second over the whole job"),
    Metric("step_time_s", "s", "minimize", "train", "wall time of one optimizer step (all micro-batches)"),
    Metric(
        "mfu",
        "fraction",
        "maximize",
        "train",
        "model FLOPs utilisation: flops_per_token x tokens/s/device / peak of the precision "
        "(recompute not counted; see flops_per_token)",
    ),
    Metric(
        "peak_memory_gib",
        "GiB",
        "minimize",
        "train",
        "peak device memory of the most loaded device, runtime and communication buffers included",
    ),
    Metric(
        "memory_headroom_gib",
        "GiB",
        "maximize",
        "train",
        "device memory left at the peak: device_memory_gib - peak_memory_gib",
    ),
    Metric(
        "comm_fraction",
        "fraction",
        "minimize",
        "train",
        "share of the step's wall time in communication that compute did not hide: the torch probe's profiled "
        "step (workload.profile_step) at full size, else the calibrated model's share at the cluster",
    ),
    Metric(
        "scaling_efficiency",
        "fraction",
        "maximize",
        "train",
        "tokens/s/device at the cluster over tokens/s/device at the reference size, each rank doing the same "
        "work (weak scaling): one node's worth of data parallelism when the config spans nodes, else one "
        "replica (dp 1); 1.0 is linear. A measured config's is its measurement read at the reference size by "
        "the calibrated model (autotune scale measures it at each size)",
    ),
    Metric(
        "ttft_ms",
        "ms",
        "minimize",
        "infer",
        "time to first token at the smallest of the workload's batch sizes (the latency one request sees); "
        "ttft_ms_bs<N> at batch N",
    ),
    Metric(
        "decode_tokens_per_s",
        "tokens/s",
        "maximize",
        "infer",
        "generated tokens per second of ONE instance, summed over its batch, at steady decode, at the largest of "
        "the workload's batch sizes; decode_tokens_per_s_bs<N> at batch N",
    ),
    Metric(
        "decode_tokens_per_s_per_device",
        "tokens/s/device",
        "maximize",
        "infer",
        "decode_tokens_per_s x instances (replicas) / devices, at the largest batch size: the fair comparison "
        "across layouts (two tp4 instances on 8 devices do twice one's work)",
    ),
    Metric(
        "decode_tokens_per_s_per_device_in_bound",
        "tokens/s/device",
        "maximize",
        "infer",
        "decode_tokens_per_s_per_device at the largest batch size whose TTFT and time per output token meet the "
        "workload's ttft_bound_ms / tpot_bound_ms (0 when none does): per-device throughput under a latency bound",
    ),
    Metric(
        "time_for_100_tokens_s",
        "s",
        "minimize",
        "infer",
        "time until each sequence of the batch has 100 new tokens (prefill + 100 decode steps), at the smallest "
        "batch size; time_for_100_tokens_s_bs<N> at batch N",
    ),
]


def _serving_metrics() -> list[Metric]:
    """Serving metrics (``workload: {kind: serve}``), at the probe's operating point: the highest
    rate tried whose SLO was met (else the lowest rate tried). objectives/serving.py defines how
    each is computed from the per-request records."""
    out = [
        Metric(
            "goodput_rps",
            "requests/s",
            "maximize",
            "serve",
            "requests per second that met every SLO target (DistServe's goodput) at the highest rate tried whose "
            "SLO was met; 0 when no rate met it",
        ),
        Metric(
            "goodput_rps_per_device",
            "requests/s/device",
            "maximize",
            "serve",
            "goodput_rps divided by the devices the layout occupies (replicas x tp x pp): the fair comparison "
            "across layouts",
        ),
        Metric(
            "max_rate_rps",
            "requests/s",
            "maximize",
            "serve",
            "the highest offered rate the rate search found meeting the SLO (to workload.rate_tolerance)",
        ),
        Metric("slo_attainment", "fraction", "maximize", "serve", "share of requests meeting every SLO target"),
        Metric("request_throughput_rps", "requests/s", "maximize", "serve", "completed requests per second"),
        Metric("output_tokens_per_s", "tokens/s", "maximize", "serve", "generated tokens per second, all replicas"),
        Metric(
            "output_tokens_per_s_per_device",
            "tokens/s/device",
            "maximize",
            "serve",
            "output_tokens_per_s divided by the devices the layout occupies",
        ),
        Metric("kv_cache_usage", "fraction", "minimize", "serve", "highest KV-cache use the engine reported"),
        Metric(
            "prefix_cache_hit_rate",
            "fraction",
            "maximize",
            "serve",
            "share of prompt tokens the engine's prefix cache served during the load (vLLM's prefix_cache_hits "
            "over prefix_cache_queries)",
        ),
        Metric("preemptions", "count", "minimize", "serve", "sequences the engine preempted during the load"),
        Metric("requests_failed", "count", "minimize", "serve", "requests that ended in an error"),
        Metric(
            "cost_per_million_output_tokens",
            "currency/1M tokens",
            "minimize",
            "serve",
            "cluster.cost_per_device_hour x devices / (output tokens per hour / 1e6) at the operating point",
        ),
    ]
    what = {
        "ttft": "time to first token",
        "tpot": "time per output token after the first",
        "itl": "inter-token latency",
        "e2e": "end-to-end request latency",
    }
    for key, text in what.items():
        for q in (50, 90, 99):
            out.append(Metric(f"{key}_p{q}_ms", "ms", "minimize", "serve", f"{text}, percentile {q}"))
    return out


_ALL += _serving_metrics()

# the figures a decision of each workload reads, shown beside the objectives wherever a study's
# configs are tabled (run, plan, report, results.csv, MLflow's saved view)
DECISION_METRICS: dict[str, tuple[str, ...]] = {
    "train": ("step_time_s", "mfu", "peak_memory_gib"),
    "infer": ("decode_tokens_per_s_per_device", "ttft_ms", "time_for_100_tokens_s", "peak_memory_gib"),
    "serve": (
        "goodput_rps_per_device",
        "max_rate_rps",
        "slo_attainment",
        "ttft_p99_ms",
        "tpot_p99_ms",
        "cost_per_million_output_tokens",
    ),
}


def workload_of_metrics(metrics: Mapping[str, Any]) -> str:
    """The workload kind a trial's metrics come from (train, infer or serve)."""
    if "goodput_rps" in metrics or "goodput_rps_per_device" in metrics:
        return "serve"
    if "ttft_ms" in metrics or "decode_tokens_per_s" in metrics:
        return "infer"
    return "train"


METRICS: dict[str, Metric] = {m.name: m for m in _ALL}
# Inference runs report memory too; the train-tagged definitions apply unchanged.
ALIASES: dict[str, str] = {"memory_headroom": "memory_headroom_gib"}
METRICS.update({alias: METRICS[target] for alias, target in ALIASES.items()})


# an inference figure at one of the workload's batch sizes: ``ttft_ms_bs4``
INFER_POINT_METRICS = ("ttft_ms", "time_for_100_tokens_s", "decode_tokens_per_s", "decode_tokens_per_s_per_device")
_AT_BATCH = re.compile(r"^(?P<base>" + "|".join(INFER_POINT_METRICS) + r")_bs(?P<batch>[1-9][0-9]*)$")


def batch_point(name: str) -> tuple[str, int] | None:
    """(base metric, batch size) of a per-batch inference metric name (``ttft_ms_bs4``), else None."""
    m = _AT_BATCH.match(name)
    return (m["base"], int(m["batch"])) if m else None


def get_metric(name: str) -> Metric:
    """The metric called ``name`` (aliases and ``<inference metric>_bs<N>`` accepted); ``ValueError``
    listing the known names."""
    point = batch_point(name)
    if point is not None:
        base = METRICS[point[0]]
        return Metric(name, base.unit, base.direction, "infer", f"{base.name} at batch size {point[1]}")
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(sorted(METRICS))}") from None


def _kv_heads(model: Mapping[str, Any]) -> int:
    return int(model.get("num_key_value_heads") or model["num_attention_heads"])


def matmul_params(model: Mapping[str, Any]) -> tuple[float, float]:
    """(matmul parameters per transformer layer, output-layer parameters V*h).

    Only weights that take part in a matrix multiply: Q, K, V (GQA-aware), output projection and
    the MLP (3 matrices for SwiGLU / llama, 2 for GeLU / gpt). Norms, biases and the embedding
    lookup do no matmul work.
    """
    h = int(model["hidden_size"])
    heads = int(model["num_attention_heads"])
    head_dim = h // heads
    kv = _kv_heads(model)
    f = int(model["intermediate_size"])
    attn = h * (h + 2 * kv * head_dim) + h * h
    mlp = (3 if model.get("arch", "llama") == "llama" else 2) * h * f
    return float(attn + mlp), float(int(model["vocab_size"]) * h)


def flops_per_token(model: Mapping[str, Any], seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token, the Megatron-LM accounting (Narayanan et al. 2021, eq. 3;
    Korthikanti et al. 2022) generalised to GQA and SwiGLU.

    Forward = 2 x matmul parameters (every layer plus the output/logit layer) + 4 * l * h * s for
    the attention scores QK^T and the context AV, counted without discounting causal masking
    (as Megatron-LM, PaLM appendix B and llm-foundry do, so MFU is comparable to published
    figures). Training = 3 x forward (backward is twice the forward); recomputation is not
    counted (this is MFU, not hardware FLOPs utilisation). For the 12h^2-per-layer GPT this is
    exactly Megatron's 72*l*h^2*(1 + s/(6h) + V/(12*h*l)) per token.
    """
    per_layer, output = matmul_params(model)
    layers = int(model["num_hidden_layers"])
    h = int(model["hidden_size"])
    forward = 2.0 * (layers * per_layer + output) + 4.0 * layers * h * float(seq_len)
    return 3.0 * forward if training else forward


def derive_metrics(
    raw: Mapping[str, Any],
    model: Mapping[str, Any],
    workload: Mapping[str, Any],
    hardware: Mapping[str, Any],
    world_size: int,
    precision: str,
    cost_per_device_hour: float | None = None,
    instance_devices: int | None = None,
) -> dict[str, Any]:
    """Raw probe measurements completed with the derived metrics.

    Training: from ``step_time_s`` (or, failing that, ``tokens_per_s``) derives tokens_per_s,
    tokens_per_s_per_device, samples_per_s and mfu; from ``peak_memory_gib`` the headroom against
    ``hardware['device_memory_gib']``. Inference: headroom, and ``time_for_100_tokens_s`` when
    ``ttft_ms``, ``decode_tokens_per_s`` and ``batch_size`` are known; from the per-batch figures
    (``<metric>_bs<N>``) and ``instance_devices`` (tp x pp) the headline figures
    (:func:`infer_headline`). Serving: goodput and output tokens per device (``world_size`` = the
    devices of the layout) and the cost per million output tokens when ``cost_per_device_hour`` is
    known. A value the probe reported is never overwritten.
    """
    out: dict[str, Any] = dict(raw)
    world = max(int(world_size), 1)
    kind = workload.get("kind", "train")

    def put(key: str, value: float) -> None:
        if key not in out or out[key] is None:
            out[key] = float(value)

    if kind == "train":
        seq = int(workload["seq_len"])
        gbs = int(workload["global_batch_size"])
        tokens = float(seq * gbs)
        step = out.get("step_time_s")
        if not step and out.get("tokens_per_s"):
            put("step_time_s", tokens / float(out["tokens_per_s"]))
        elif not step and out.get("tokens_per_s_per_device"):
            put("step_time_s", tokens / (float(out["tokens_per_s_per_device"]) * world))
        step = out.get("step_time_s")
        if step and float(step) > 0:
            step = float(step)
            put("tokens_per_s", tokens / step)
            put("tokens_per_s_per_device", tokens / step / world)
            put("samples_per_s", gbs / step)
            peak = _peak(hardware, precision)
            if peak:
                put("mfu", flops_per_token(model, seq, True) * float(out["tokens_per_s_per_device"]) / peak)
    elif kind == "serve":
        for key in ("goodput_rps", "output_tokens_per_s"):
            if out.get(key) is not None:
                put(f"{key}_per_device", float(out[key]) / world)
        cost = cost_per_device_hour
        tokens = out.get("output_tokens_per_s")
        if cost is not None and tokens:
            put("cost_per_million_output_tokens", float(cost) * world / (float(tokens) * 3600.0 / 1e6))
    else:
        batch = out.get("batch_size")
        if out.get("ttft_ms") is not None and out.get("decode_tokens_per_s") and batch:
            step = float(batch) / float(out["decode_tokens_per_s"])
            put("time_for_100_tokens_s", float(out["ttft_ms"]) / 1e3 + 100.0 * step)
        points = {
            b: {m: out[f"{m}_bs{b}"] for m in ("ttft_ms", "time_for_100_tokens_s", "decode_tokens_per_s")}
            for b in workload.get("batch_sizes") or []
            if all(
                out.get(f"{m}_bs{b}") is not None for m in ("ttft_ms", "time_for_100_tokens_s", "decode_tokens_per_s")
            )
        }
        if points and instance_devices:
            for k, v in infer_headline(points, float(instance_devices), workload).items():
                put(k, v)
        elif out.get("decode_tokens_per_s") and instance_devices:
            put("decode_tokens_per_s_per_device", float(out["decode_tokens_per_s"]) / float(instance_devices))
    if out.get("peak_memory_gib") is not None and hardware.get("device_memory_gib"):
        put("memory_headroom_gib", float(hardware["device_memory_gib"]) - float(out["peak_memory_gib"]))
    return out


def infer_headline(points: Mapping[int, Mapping[str, Any]], instance_devices: Any, workload: Mapping[str, Any]) -> dict:
    """The figures an inference study ranks by, from its per-batch measurements
    (``{batch: {ttft_ms, time_for_100_tokens_s, decode_tokens_per_s}}``; numbers, or numpy arrays of
    a population): every point as ``<metric>_bs<N>`` with its per-device decode throughput
    (an instance's, divided by the ``instance_devices`` it occupies: tp x pp), latency at the smallest
    batch, throughput at the largest, and the per-device throughput at the largest batch meeting the
    workload's latency bounds (``ttft_bound_ms``, ``tpot_bound_ms``; 0 where none does). One
    definition for the simulator, the torch probe and a command backend's figures."""
    import numpy as np

    sizes = sorted(points)
    out: dict[str, Any] = {}
    ttft_bound = workload.get("ttft_bound_ms")
    tpot_bound = workload.get("tpot_bound_ms")
    in_bound: Any = 0.0
    for b in sizes:
        p = points[b]
        per_device = p["decode_tokens_per_s"] / instance_devices
        out.update(
            {
                f"ttft_ms_bs{b}": p["ttft_ms"],
                f"time_for_100_tokens_s_bs{b}": p["time_for_100_tokens_s"],
                f"decode_tokens_per_s_bs{b}": p["decode_tokens_per_s"],
                f"decode_tokens_per_s_per_device_bs{b}": per_device,
            }
        )
        ok = np.ones_like(np.asarray(per_device, dtype=float), dtype=bool)
        if ttft_bound:
            ok = ok & (np.asarray(p["ttft_ms"]) <= float(ttft_bound))
        if tpot_bound:  # one decode step of the batch: b tokens in b / (tokens/s) seconds
            ok = ok & (
                1e3 * b / np.maximum(np.asarray(p["decode_tokens_per_s"], dtype=float), 1e-12) <= float(tpot_bound)
            )
        in_bound = np.where(ok, per_device, in_bound)  # the larger batches come later
    lo, hi = points[sizes[0]], points[sizes[-1]]
    out.update(
        ttft_ms=lo["ttft_ms"],
        time_for_100_tokens_s=lo["time_for_100_tokens_s"],
        decode_tokens_per_s=hi["decode_tokens_per_s"],
        decode_tokens_per_s_per_device=out[f"decode_tokens_per_s_per_device_bs{sizes[-1]}"],
    )
    if ttft_bound or tpot_bound:
        out["decode_tokens_per_s_per_device_in_bound"] = in_bound if np.ndim(in_bound) else float(in_bound)
    return out


def _peak(hardware: Mapping[str, Any], precision: str) -> float:
    peaks = hardware.get("peak_tflops") or {}
    value = peaks.get(precision) if isinstance(peaks, Mapping) else None
    return float(value) * 1e12 if value else 0.0
