"""A serving config's figures at the SLO, aggregated and disaggregated deployments side by side
(issue 46): each priced by its own module in one shape (:func:`._serve.priced_aggregated`,
:func:`._serve_disagg.priced_disaggregated`: the SLO curve on a grid of rates, the quantiles at the
traffic's rates, capacity, memory, devices), merged row by row, then read the same way: the
continuous max rate and what stops it, the operating point on the traffic's ladder, goodput and the
per-rate predictions the probe's shape holds."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..serve_probe.rates import TOLERANCE
from ._common import GIB, HW, Shape
from ._serve import SERVE_MEM_COMPONENTS, SLO_METRICS, Traffic, _verdict, priced_aggregated
from ._serve_disagg import priced_disaggregated


def merge_rows(rows: np.ndarray, a: Any, b: Any) -> Any:
    """``a`` where ``rows`` (N,) is true, else ``b``, through nested dicts of (N, ...) arrays."""
    if isinstance(a, dict):
        return {k: merge_rows(rows, a[k], b[k]) for k in a}
    a, b = np.asarray(a), np.asarray(b)
    mask = rows.reshape((-1,) + (1,) * (max(a.ndim, b.ndim) - 1))
    return np.where(mask, a, b)


def searched_rate(rates: np.ndarray, op: np.ndarray, max_rate: np.ndarray, tolerance: float) -> np.ndarray:
    """The maximum rate the probe's search reports (workers/serve_probe/rates.py), at the model's continuous
    maximum ``max_rate``: the search bisects between the highest rung met (``rates`` (N, K) at ``op`` (N, 1))
    and the next one up, missed, until the bracket is ``tolerance`` of its low end wide, and reports its low
    end, on average half the tolerance below the maximum; never beyond the bracket. The ladder's top rung
    met ends the search there.

    Read at the highest rung met instead, the model's goodput and max rate were the ladder's rungs, up to
    2x below what the probe reports, and the study's guide corrected rungs against bisected readings: on
    vLLM's CPU engine at 256-512-token prompts its refit from three configs put max_num_seqs 16 at 1.38x
    the engine's mean (1.06x read so, benchmarks/README.md)."""
    low = np.take_along_axis(rates, op, axis=1)[:, 0]
    up = np.take_along_axis(rates, np.minimum(op + 1, rates.shape[1] - 1), axis=1)[:, 0]
    inside = max_rate * (1.0 - tolerance / 2.0)
    return np.where(up > low, np.clip(inside, low, up * (1.0 - 1e-9)), low)


def binding_metric(qs: dict[str, np.ndarray], tr: Traffic) -> np.ndarray:
    """The code (:data:`LIMITS`) of the SLO metric whose p99 sits highest over its target."""
    best = np.full(qs["ttft_0.99"].shape, -np.inf)
    code = np.zeros(best.shape)
    for i, m in enumerate(SLO_METRICS, start=1):
        target = tr.slo[f"{m}_p99_ms"]
        if target is None:
            continue
        ratio = qs[f"{m}_0.99"] * 1e3 / max(target, 1e-9)
        code = np.where(ratio > best, float(i), code)
        best = np.maximum(best, ratio)
    return code


# what stops a config's rate from growing (``slo_limit`` codes): the engine's capacity (every SLO
# still met at it) or the SLO metric that fails first
LIMITS = ("capacity", *SLO_METRICS)


def serve(s: Shape, hw: HW, c: dict, workload: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(columns of N: metrics at the operating point, memory, capacity; per-rate predictions as
    (N, R) arrays with the rates). Disaggregated configs (``prefill_replicas`` >= 1) are priced by
    :mod:`._serve_disagg`, the rest as aggregated engines, side by side in the same columns."""
    tr = Traffic.of(workload)
    p = priced_aggregated(s, hw, c, tr)
    disagg = np.asarray(c.get("prefill_replicas", np.zeros(c["tp"].size))) > 0
    if disagg.any():
        p = merge_rows(disagg, priced_disaggregated(s, hw, c, tr), p)
    n = c["tp"].size
    mem = p["mem"]

    # --- the SLO curve: the continuous max rate and what stops it --------------------------------
    grid_lam = p["grid_rate"]
    _, _, margin = _verdict(p["grid"], tr)
    G = grid_lam.shape[1]
    bad = margin > 1.0
    first = np.where(bad.any(axis=1), bad.argmax(axis=1), G)
    j = np.clip(first, 1, G - 1)[:, None]
    take = lambda a, i: np.take_along_axis(a, i, axis=1)[:, 0]  # noqa: E731
    m0, m1 = take(margin, j - 1), take(margin, j)
    l0, l1 = take(grid_lam, j - 1), take(grid_lam, j)
    w = np.clip((1.0 - m0) / np.maximum(m1 - m0, 1e-12), 0.0, 1.0)
    max_rate_model = np.where(first == 0, 0.0, np.where(first >= G, p["capacity"], l0 + w * (l1 - l0)))
    binding = take(binding_metric(p["grid"], tr), np.clip(first, 0, G - 1)[:, None])
    slo_limit = np.where(first >= G, 0.0, binding)

    # --- the traffic's ladder --------------------------------------------------------------------
    rates = np.broadcast_to(tr.rates[None, :], (n, tr.rates.size))
    qs = p["at_rates"]
    met, att, _ = _verdict(qs, tr)
    window = tr.duration + qs["e2e_0.99"]  # vLLM's benchmark window: first send to last response
    served = rates * tr.duration / window
    goodput = rates * att  # the offered rate x the good share, as the probe measures it (objectives/serving.py)
    tokens = served * tr.output.mean
    # --- the operating point: the highest rate met, else the lowest --------------------------------
    any_met = met.any(axis=1)
    op = np.where(any_met, met.shape[1] - 1 - np.argmax(met[:, ::-1], axis=1), 0)[:, None]
    at = lambda a: np.take_along_axis(np.broadcast_to(a, met.shape), op, axis=1)[:, 0]  # noqa: E731
    searched = searched_rate(rates, op, max_rate_model, float(workload.get("rate_tolerance") or TOLERANCE))
    dev = p["devices"]
    out: dict[str, np.ndarray] = {
        "goodput_rps": np.where(any_met, searched * at(att), 0.0),
        "max_rate_rps": np.where(any_met, searched, 0.0),
        "slo_attainment": at(att),
        "request_throughput_rps": at(served),
        "output_tokens_per_s": at(tokens),
        "kv_cache_usage": at(qs["kv_cache_usage"]),
        "prefix_cache_hit_rate": p["prefix_cache_hit_rate"],
        "preemptions": at(qs["preempted_per_request"] * rates * tr.duration),
        "requests_failed": np.zeros(n),
        "max_rate_rps_model": max_rate_model,
        "capacity_rps": p["capacity"],
        "operating_rate_rps": at(rates),
        "max_concurrency": p["max_concurrency"],
        "kv_cache_tokens": mem["kv_tokens"][:, 0],
        "slo_limit": slo_limit,
        "devices": dev,
        "disaggregated": disagg,
    }
    out["goodput_rps_per_device"] = out["goodput_rps"] / dev
    out["max_rate_rps_model_per_device"] = max_rate_model / dev
    out["output_tokens_per_s_per_device"] = out["output_tokens_per_s"] / dev
    for m in SLO_METRICS:
        for q in (0.5, 0.9, 0.99):
            out[f"{m}_p{round(q * 100)}_ms"] = at(qs[f"{m}_{q:g}"]) * 1e3
    out.update(p["closed_loop"])
    # --- memory --------------------------------------------------------------------------------
    for k in SERVE_MEM_COMPONENTS:
        out[f"mem_{k}"] = mem[k][:, 0] / GIB
    out["peak_memory_gib"] = sum(mem[k] for k in SERVE_MEM_COMPONENTS)[:, 0] / GIB
    out["memory_limit_gib"] = np.full(n, hw.mem_bytes / GIB)
    out["fits"] = mem["starts"][:, 0]
    out["weights_oom"] = mem["weights_oom"][:, 0]
    out["kv_oom"] = mem["kv_oom"][:, 0]
    out["kv_need_one_gib"] = mem["kv_need_one"][:, 0] / GIB
    out["kv_available_gib"] = mem["kv_available"][:, 0] / GIB
    out["memory_budget_gib"] = mem["budget"][:, 0] / GIB
    per_rate = {
        "rate": rates,
        "slo_met": met,
        "goodput_rps": goodput,
        "slo_attainment": att,
        "requests": np.round(rates * tr.duration),
        "output_tokens_per_s": tokens,
        "request_throughput_rps": served,
        "kv_cache_usage": qs["kv_cache_usage"],
        "preemptions": qs["preempted_per_request"] * rates * tr.duration,
    }
    for m in SLO_METRICS:
        for q in (0.5, 0.99):
            per_rate[f"{m}_p{round(q * 100)}_ms"] = qs[f"{m}_{q:g}"] * 1e3
    return out, per_rate
