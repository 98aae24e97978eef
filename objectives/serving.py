"""Serving metrics: what a request's latencies are, when it is good, what one offered rate
measured, which rate is the operating point, and what a million output tokens cost.

Pure functions over per-request records (the dicts the serving probe writes to ``requests.jsonl``,
one per request: ``ok``, ``sent_s``, ``output_tokens``, ``ttft_ms``, ``itl_ms``, ``e2e_ms``...).
The probe computes its verdict with them, the driver logs with them, and a test recomputes a
stored trial's verdict from its ``requests.jsonl`` with them: one definition, so a reported
goodput can always be checked against the requests it came from. Why each definition is this one:

- **TTFT, TPOT, ITL, E2E** follow vLLM's ``benchmarks/serve.py`` (``calculate_metrics``), the
  numbers teams compare with: TTFT from sending the request to the first streamed token; E2E to
  the last; a request's TPOT = (E2E - TTFT) / (output tokens - 1), its mean decode time per token
  after the first (a request with one output token has none); ITL = every gap between streamed
  chunks, pooled over requests (a chunk may hold several tokens, so ITL and TPOT differ).
  Percentiles are ``numpy.percentile``'s linear interpolation, as vLLM's are, over the requests
  that completed.
- **A good request** meets every per-request target at once: its own TTFT, TPOT and E2E against
  ``ttft_p99_ms``, ``tpot_p99_ms``, ``e2e_p99_ms`` (a missing target is no constraint; a request
  with no TPOT meets the TPOT target, as vLLM counts it). This is DistServe's per-request SLO
  attainment (Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized
  Large Language Model Serving", OSDI 2024, section 2: a request attains its SLO when both its
  TTFT and its TPOT are within target), and vLLM's ``--goodput`` rule (``s >= r`` for every
  target). ITL has no per-request meaning here (a request has many gaps), so it enters only the
  rate's p99 check.
- **SLO attainment** = good / sent. **Goodput** = the offered rate x the attainment: the good
  requests a second this rate brings, in expectation. Not vLLM's ``request_goodput`` (good
  requests / the benchmark's duration): in a window of a few seconds the number of Poisson
  arrivals is itself a draw, spread sqrt(N) around N (+/-30 % at 10 requests), and that quotient
  carries the draw whole. A kept CPU run read 2.09 req/s of goodput at an offered 1.297 req/s: 18 arrivals in
  8 s where 10.4 were expected. The rate is what the probe sets; the share of good requests is
  what the engine decides. The measured traffic stays in ``request_throughput_rps`` and
  ``output_tokens_per_s``, per second of the load window, which runs from the rate's start
  (``sent_s`` counts from it; the first arrival is at 0) to the later of the end of the arrival
  window (``duration_s``) and the last response's end: vLLM's ``benchmark_duration`` for an
  arrival process that runs for a fixed time.
- **A rate meets the SLO** when every request completed (a failed request is never "within
  target") and the p99 of TTFT, TPOT (and ITL, E2E when given) is within its target: the p99
  targets the workload states, checked as the percentiles they are.
- **How sure a verdict is** (issue 44): each p99 carries its distribution-free 95 % interval from
  the requests (:func:`autotune.objectives.intervals.quantile_interval`; unbounded above with too
  few requests), and the rate's ``slo_verdict`` says ``met`` or ``missed`` only when every
  interval is on one side of its target, else ``undecided`` (more requests would decide). The
  operating point is still chosen on the p99s themselves (``slo_met``); the verdict says whether
  the requests sent were enough to be sure of it.
- **The operating point** is the highest rate tried whose SLO was met; DistServe's goodput is
  that highest sustainable rate. When no rate met the SLO the lowest rate tried is reported with
  goodput 0 and ``max_rate_rps`` 0: a measurement (this config cannot meet the SLO at any rate
  tried), not a failure.
- **The serving probe's operating point** (issue 44, ``workers/serve_probe/rates.py``) is its rate
  search's answer rather than the highest ``slo_met`` of the runs: the ladder seeds a bracket
  bisected to ``workload.rate_tolerance``, a rate counts as met only when its ``slo_verdict`` is
  ``met`` (an undecided one is run again with more requests, and still undecided counts as not
  met), and the highest rate met is repeated to confirm it. :func:`metrics_at` reads the metrics
  at the run the search chose; :func:`goodput_interval` gives the goodput there an interval (the
  good share's Clopper-Pearson interval, carried up to the lowest rate missed).
- **Cost per million output tokens** = cost per device-hour x devices / million output tokens an
  hour at the operating point: what serving this traffic on this layout costs, comparable across
  layouts of different sizes.

numpy (and scipy, for the intervals) are its only dependencies: the probe imports this module on
worker nodes.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .intervals import CONFIDENCE, ci_keys, quantile_interval, share_interval, verdict

__all__ = [
    "SLO_KEYS",
    "PERCENTILES",
    "LATENCIES",
    "percentile",
    "request_tpot_ms",
    "request_good",
    "load_window_s",
    "summarize_rate",
    "operating_point",
    "serving_metrics",
    "metrics_at",
    "requests_to_bound",
    "undecided_why",
    "send_lag",
    "share_interval",
    "goodput_interval",
    "batch_summary",
    "tokens_apart_share",
    "records_by",
    "cost_per_million_output_tokens",
]

SLO_KEYS = ("ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms")
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")
_ROUND = 6  # digits kept in summaries: enough for ms and req/s, and stable to compare
# below this p99 send lag (ms) the open loop kept its plan whatever the rate: an event loop's own
# jitter, which no engine's queue tells from its arrivals' spread
SEND_LAG_FLOOR_MS = 10.0
# two streamed tokens closer than this (ms) came in one read of the socket: no engine steps that fast
TOGETHER_MS = 0.05


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation (numpy's default, vLLM's choice);
    None for no values, so that "nothing measured" is never read as 0 ms."""
    data = [float(v) for v in values if v is not None]
    if not data:
        return None
    return float(np.percentile(np.asarray(data, dtype=float), q))


def request_tpot_ms(record: Mapping[str, Any]) -> float | None:
    """(E2E - TTFT) / (output tokens - 1): the request's mean time per output token after the
    first; None when it produced fewer than two tokens or did not complete."""
    n = record.get("output_tokens") or 0
    ttft, e2e = record.get("ttft_ms"), record.get("e2e_ms")
    if not record.get("ok") or n < 2 or ttft is None or e2e is None:
        return None
    return (float(e2e) - float(ttft)) / (int(n) - 1)


def _target(slo: Mapping[str, Any], key: str) -> float | None:
    value = slo.get(key)
    return None if value is None else float(value)


def request_good(record: Mapping[str, Any], slo: Mapping[str, Any]) -> bool:
    """True when the request completed and its own TTFT, TPOT and E2E are within the targets."""
    if not record.get("ok"):
        return False
    checks = (
        ("ttft_p99_ms", record.get("ttft_ms")),
        ("tpot_p99_ms", request_tpot_ms(record)),
        ("e2e_p99_ms", record.get("e2e_ms")),
    )
    for key, value in checks:
        target = _target(slo, key)
        if target is None or (value is None and key == "tpot_p99_ms"):
            continue
        if value is None or float(value) > target:
            return False
    return True


def load_window_s(records: Sequence[Mapping[str, Any]], duration_s: float | None = None) -> float:
    """The seconds the measurement covers. With ``duration_s`` (open-loop load): from the phase's
    start to the later of ``duration_s`` and the last response's end. Without (a closed-loop
    batch): from the first send to the last response's end. A failed request counts until it
    failed."""
    ends = [float(r.get("sent_s") or 0.0) + float(r.get("e2e_ms") or 0.0) / 1000.0 for r in records]
    if duration_s is not None:
        return max([float(duration_s), *ends])
    if not records:
        return 0.0
    return max(max(ends) - min(float(r.get("sent_s") or 0.0) for r in records), 0.0)


def _r(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), _ROUND)


def send_lag(records: Sequence[Mapping[str, Any]], rate: float | None) -> tuple[float | None, str]:
    """(the p99 of how late the client sent each request against its plan, ms; why the open loop fell
    behind, "" when it kept up). The client sends each request at its planned arrival
    (``scheduled_s``) and records when it did (``sent_s``). A client that shares the host's cores
    with the engine can be starved of them: on the 2-core CPU machine with vLLM's CPU engine (its
    worker holds one core, its scheduler process half the other) the client sent 9 requests planned
    over 0.5 s within 10 ms, the first 573 ms late, and they shared one 951 ms first token. The
    engine then served bursts the Poisson traffic did not hold, and the rate's p99s are the host's
    as much as the engine's. Behind means a p99 lag above the mean gap between planned arrivals
    (1 / rate) and above :data:`SEND_LAG_FLOOR_MS`: 1 % of the requests reached the engine more than
    one arrival late. A miss then bounds the engine's maximum rate from below, not from above. (The
    probe now runs the engine at the lowest priority, :func:`workers.serve_probe.engine.yield_host`,
    which took that machine's lag to 2-9 ms; the check stays for a host that is busy otherwise.)"""
    lags = [
        (float(r["sent_s"]) - float(r["scheduled_s"])) * 1000.0
        for r in records
        if r.get("sent_s") is not None and r.get("scheduled_s") is not None
    ]
    lag = percentile(lags, 99)
    if lag is None or not rate:
        return lag, ""
    gap_ms = 1000.0 / float(rate)
    if lag <= max(gap_ms, SEND_LAG_FLOOR_MS):
        return lag, ""
    return lag, (
        f"the load generator fell behind: 1 % of the requests were sent {lag:.0f} ms or more after their "
        f"planned arrival, {lag / gap_ms:.1f} mean gaps at {float(rate):g} req/s; the engine saw burstier "
        "arrivals than the traffic asks for (a client starved of the host's cores: run it on another host)"
    )


def summarize_rate(
    records: Sequence[Mapping[str, Any]], slo: Mapping[str, Any], rate: float | None, duration_s: float
) -> dict:
    """What one offered rate measured, from its records (phase ``load``) and its arrival window
    ``duration_s``: request counts, goodput, attainment, throughput, p50/p90/p99 of each latency,
    and whether the SLO was met."""
    done = [r for r in records if r.get("ok")]
    failed = len(records) - len(done)
    good = sum(1 for r in done if request_good(r, slo))
    window = load_window_s(records, duration_s)
    per_s = (lambda x: x / window) if window > 0 else (lambda x: 0.0)
    series = {
        "ttft": [r.get("ttft_ms") for r in done],
        "tpot": [request_tpot_ms(r) for r in done],
        "itl": [gap for r in done for gap in (r.get("itl_ms") or [])],
        "e2e": [r.get("e2e_ms") for r in done],
    }
    out: dict[str, Any] = {
        "rate": rate,
        "requests": len(records),
        "completed": len(done),
        "failed": failed,
        "good": good,
        "window_s": _r(window),
        # the offered rate x the good share (the module docstring); a phase without a rate: per second
        "goodput_rps": _r(rate * good / len(records) if rate and records else per_s(good)),
        "slo_attainment": _r(good / len(records)) if records else 0.0,
        "request_throughput_rps": _r(per_s(len(done))),
        "output_tokens_per_s": _r(per_s(sum(int(r.get("output_tokens") or 0) for r in done))),
    }
    for name, values in series.items():
        for q in PERCENTILES:
            out[f"{name}_p{q}_ms"] = _r(percentile(values, q))
        interval = quantile_interval(values, 99)
        if interval is not None:  # an end the requests cannot reach is None (unbounded)
            low, high = ci_keys(f"{name}_p99_ms")
            out[low], out[high] = (_r(v) if math.isfinite(v) else None for v in interval)
    met = bool(records) and failed == 0
    verdicts = []
    for key in SLO_KEYS:
        target = _target(slo, key)
        measured = out.get(key)
        if target is not None and measured is not None and measured > target:
            met = False
        if target is not None and measured is not None:
            low, high = (out.get(k) for k in ci_keys(key))
            verdicts.append(
                verdict((low if low is not None else -math.inf, high if high is not None else math.inf), target)
            )
    if met and _target(slo, "ttft_p99_ms") is not None and out["ttft_p99_ms"] is None:
        met = False  # nothing completed: no TTFT to meet the target with
    out["slo_met"] = met
    lag, behind = send_lag(records, rate)
    out["send_lag_p99_ms"] = _r(lag)
    if behind:
        out["generator_behind"] = behind
    if not records or failed or "missed" in verdicts or (not met and not verdicts):
        out["slo_verdict"] = "missed"
    else:
        out["slo_verdict"] = "undecided" if "undecided" in verdicts else "met"
    return out


def operating_point(summaries: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any] | None, bool]:
    """(the summary of the highest rate whose SLO was met, True), else (the lowest rate's, False);
    (None, False) when no rate was measured."""
    if not summaries:
        return None, False
    met = [s for s in summaries if s.get("slo_met")]
    if met:
        return max(met, key=lambda s: float(s["rate"])), True
    return min(summaries, key=lambda s: float(s["rate"])), False


def serving_metrics(summaries: Sequence[Mapping[str, Any]], devices: int) -> dict[str, float]:
    """The trial's metrics at its operating point (see the module docstring); ``devices`` = the
    devices of the layout (replicas x tp x pp). Latency percentiles that could not be measured
    are left out, never reported as 0."""
    point, met = operating_point(summaries)
    return metrics_at(point, met, summaries, devices)


def metrics_at(
    point: Mapping[str, Any] | None, met: bool, summaries: Sequence[Mapping[str, Any]], devices: int
) -> dict[str, float]:
    """:func:`serving_metrics` at a given operating point: ``point`` the summary of the run it is
    read from, ``met`` whether that rate met the SLO, ``summaries`` every run (their failed requests
    count). The serving probe's rate search picks the point itself (the highest rate it counted as
    met and confirmed, not merely the highest whose p99s were under target)."""
    if point is None:
        return {}
    devices = max(int(devices), 1)
    goodput = float(point["goodput_rps"] or 0.0) if met else 0.0
    tokens = float(point["output_tokens_per_s"] or 0.0)
    out: dict[str, float] = {
        "goodput_rps": goodput,
        "goodput_rps_per_device": goodput / devices,
        "max_rate_rps": float(point["rate"]) if met else 0.0,
        "slo_attainment": float(point["slo_attainment"] or 0.0),
        "request_throughput_rps": float(point["request_throughput_rps"] or 0.0),
        "output_tokens_per_s": tokens,
        "output_tokens_per_s_per_device": tokens / devices,
        "requests_failed": float(sum(int(s.get("failed") or 0) for s in summaries)),
        # runs whose arrivals the client could not send on time (:func:`send_lag`): their misses are the host's
        "load_generator_behind_runs": float(sum(1 for s in summaries if s.get("generator_behind"))),
    }
    for name in LATENCIES:
        for q in PERCENTILES:
            value = point.get(f"{name}_p{q}_ms")
            if value is not None:
                out[f"{name}_p{q}_ms"] = float(value)
        for key in ci_keys(f"{name}_p99_ms"):  # its interval, where the requests bound it
            if point.get(key) is not None:
                out[key] = float(point[key])
    if met:  # 1: the requests sent at the operating rate were too few to be sure it meets the SLO
        out["slo_undecided"] = float(point.get("slo_verdict") == "undecided")
    return out


def requests_to_bound(q: float = 99, confidence: float = CONFIDENCE) -> int:
    """The fewest samples whose order-statistic interval of the ``q``-th percentile has an upper end
    (:func:`autotune.objectives.intervals.quantile_interval`): the largest sample bounds it once
    P(all n below the percentile) = (q/100)^n is within the upper tail. 368 for a p99 at 95 %: a
    rate with fewer completed requests can miss its SLO but never be sure it meets it."""
    tail = (1.0 - confidence) / 2.0
    return int(math.ceil(math.log(tail) / math.log(q / 100.0) - 1e-12))


def undecided_why(summary: Mapping[str, Any], slo: Mapping[str, Any]) -> str:
    """Why a rate's ``slo_verdict`` is ``undecided``, in words: each p99 whose interval holds its
    target, and, when an interval has no upper end, how many requests a p99 needs. "" when the
    verdict is decided."""
    if summary.get("slo_verdict") != "undecided":
        return ""
    parts = []
    for key in SLO_KEYS:
        target, measured = _target(slo, key), summary.get(key)
        if target is None or measured is None:
            continue
        low, high = (summary.get(k) for k in ci_keys(key))
        interval = (low if low is not None else -math.inf, high if high is not None else math.inf)
        if verdict(interval, target) != "undecided":
            continue
        name = key.replace("_p99_ms", "").upper()
        end = "no upper end" if high is None else f"up to {high:g} ms"
        parts.append(f"{name} p99 {measured:g} ms, its 95 % interval ({end}) holds the target {target:g} ms")
    if any(summary.get(ci_keys(k)[1]) is None for k in SLO_KEYS if _target(slo, k) is not None):
        parts.append(
            f"{summary.get('completed', 0)} completed requests cannot bound a p99 from above "
            f"(it takes at least {requests_to_bound()})"
        )
    return "; ".join(parts) or "the p99 intervals hold their targets"


def goodput_interval(
    point: Mapping[str, Any], rate_above: float | None = None, confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """An interval of the goodput at the highest rate a config sustains, from the run measured at
    the operating rate ``point`` (the highest rate the search counted as met) and ``rate_above``
    (the lowest rate counted as missed; None when the top of the ladder met).

    Goodput = the offered rate x (good / requests). Two things are unsure: the share of good
    requests, a binomial share given its Clopper-Pearson interval; and where between the operating
    rate and ``rate_above`` the sustainable maximum lies. The share of good requests does not grow
    with load, so the low end is the rate x the share's low end, and the high end is ``rate_above``
    (the maximum is below it) x the share's high end. None when the run sent nothing."""
    n, good = int(point.get("requests") or 0), int(point.get("good") or 0)
    rate = float(point.get("rate") or 0.0)
    share = share_interval(good, n, confidence)
    if share is None or rate <= 0:
        return None
    goodput = float(point.get("goodput_rps") or 0.0)
    low, high = rate * share[0], max(float(rate_above or rate), rate) * share[1]
    if goodput > 0:
        low, high = min(low, goodput), max(high, goodput)
    return _r(low), _r(high)


def batch_summary(records: Sequence[Mapping[str, Any]], batch: int) -> dict[str, Any]:
    """Closed-loop figures of one batch of ``batch`` concurrent requests: TTFT (the last first
    token of the batch: the batch's prefill), time until every sequence has 100 new tokens (TTFT +
    99 x TPOT per request, the last of the batch; extrapolated when fewer were asked), output
    tokens per second over the batch, and the least share of a request's tokens that reached the
    client apart (:func:`tokens_apart_share`)."""
    done = [r for r in records if r.get("ok")]
    if not done:
        return {"batch": batch, "requests": len(records), "failed": len(records)}
    ttft = max(float(r["ttft_ms"]) for r in done)
    to_100 = []
    for r in done:
        tpot = request_tpot_ms(r)
        to_100.append(float(r["ttft_ms"]) / 1000.0 + 99.0 * (tpot or 0.0) / 1000.0)
    window = load_window_s(records)
    tokens = sum(int(r.get("output_tokens") or 0) for r in done)
    shares = [share for share in map(tokens_apart_share, done) if share is not None]
    return {
        "batch": batch,
        "requests": len(records),
        "failed": len(records) - len(done),
        "ttft_ms": _r(ttft),
        "time_for_100_tokens_s": _r(max(to_100)),
        "output_tokens_per_s": _r(tokens / window) if window > 0 else 0.0,
        # its worst request's: the batch's figures are the largest over its requests, which one piled-up stream sets
        "tokens_apart_share": _r(min(shares)) if shares else None,
    }


def tokens_apart_share(record: Mapping[str, Any]) -> float | None:
    """The share of a request's decoded tokens (after its first) that reached the client apart from
    the one before (a gap over :data:`TOGETHER_MS`): 1 when the server streamed every step as it
    came, lower when its API server fell behind and what had piled up arrived at once. On the
    2-core CPU machine one request of 32 tokens arrived whole, its 32 events in one read, 98 ms
    after it was sent: its TPOT read 0 and its TTFT the whole request, figures of the server's lag,
    not of the engine's steps. None when it decoded no more than one token."""
    tokens = int(record.get("output_tokens") or 0) - 1
    if tokens <= 0:
        return None
    return min(sum(1 for g in (record.get("itl_ms") or ()) if float(g) > TOGETHER_MS) / tokens, 1.0)


def records_by(lines: Iterable[str], phase: str, key: str) -> dict[int, list[dict[str, Any]]]:
    """The request records of one ``phase`` (``load``, ``batch``) among the lines of a
    ``requests.jsonl``, grouped by ``key`` (a load's ``run``, a closed-loop ``batch``); a line that
    is no record of that phase is skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("phase") == phase and record.get(key) is not None:
            out.setdefault(int(record[key]), []).append(record)
    return out


def cost_per_million_output_tokens(
    cost_per_device_hour: float | None, devices: int, output_tokens_per_s: float | None
) -> float | None:
    """Cost per device-hour x devices / (output tokens an hour / 1e6); None when the cost is unknown
    or nothing was generated."""
    if cost_per_device_hour is None or not output_tokens_per_s or output_tokens_per_s <= 0:
        return None
    return float(cost_per_million(float(cost_per_device_hour), max(int(devices), 1), float(output_tokens_per_s)))


def cost_per_million(cost_per_device_hour: Any, devices: Any, output_tokens_per_s: Any) -> Any:
    """The formula alone, on numbers or numpy arrays alike (the simulator prices a population)."""
    return cost_per_device_hour * devices / (output_tokens_per_s * 3600.0 / 1e6)
