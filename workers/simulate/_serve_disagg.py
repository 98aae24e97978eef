"""Disaggregated serving: a prefill pool, a decode pool, and the KV cache sent between them (issue 46).

vLLM's disaggregated prefill (each instance launched with ``--kv-transfer-config``; a proxy sends a
request to a prefill instance with ``max_tokens`` 1, then to a decode instance, which loads the
prompt's KV cache through the connector and streams the answer), vLLM-Ascend's (the LLMDataDist and
Mooncake connectors) and MindIE's PD separation share one shape. It is priced here on the same
(N, K) arrays as the aggregated engine (:mod:`._serve`), with that module's :class:`Engine` for each
pool's iteration time and start-up memory, so both kinds rank side by side:

- **Prefill pool**: ``prefill_replicas`` instances of ``prefill_tp x pp`` devices (``prefill_tp`` 0:
  the decode instances' ``tp``). Their steps carry prompt tokens only, up to
  ``max_num_batched_tokens`` (whole prompts without chunked prefill: n_max = c_max / P_eff prompts a
  step). At its share of the offered rate, lambda_p = lambda / prefill_replicas, an instance is a
  batch-service queue: a step starts with every prompt waiting, up to n_max; capacity
  mu_p = n_max / T(0, c_max). Its TTFT (the wait and the step that serves it) is read from a table of
  discrete-event runs of that scheduler (:mod:`._prefill_queue`), scaled from Poisson arrivals of
  equal prompts as Kingman's wait is, by (ca^2 + cv_prompt^2), and held at what the load window can
  build. (Two closed forms were tried first. Taking the backlog's probability as lambda_p / mu_p put
  5.3 prompts of 512 tokens in every step of an A100 at 5 prompts/s, where 0.3 arrive during one.
  A fixed point of "a step carries what arrived during the one before, or while backlogged the
  whole budget" ran away at 58 % of capacity: 7.7 prompts a step and TTFT's p90 2.5x the
  scheduler's.)
- **KV transfer**: a prompt's P tokens x layers x 2 x kv_heads x head_dim x KV bytes, each prefill
  rank sending its shard: min(prefill_tp, tp) x pp links in parallel, the intra-node link when both
  pools sit on one node, else the inter-node NIC (:data:`TRANSPORTS`: the connector's efficiency on
  it; the shared-storage connector goes through a file system instead), plus a handshake per
  request. The links together also cap the rate.
- **Decode pool**: ``replicas`` instances of ``tp x pp`` devices. Their steps carry decodes only (a
  preempted request's recomputation aside): no prompt tokens mixed into a decode step, so TPOT and
  ITL carry no prefill interference, which is what disaggregation buys. Concurrency up to
  B_cap = min(max_num_seqs, what the KV cache holds); the running slot as the aggregated engine's
  G/G/c queue with S = (O - 1) t(B_cap).

TTFT = API overhead + the prefill wait + the prompt's prefill + the KV transfer + the decode slot
wait + the rest of the decode step in progress + the decode instance's own first step (it computes the
prompt's last token and samples the first); tails of the waits, the prompt
length and the transfer add as a root sum of squares, as in the aggregated model. TPOT and ITL at
quantile q: the decode step at the q-quantile of the running concurrency. E2E = TTFT + (O-1) TPOT.
Every wait is held at what the finite load window can build (``_serve.window_wait``), and beyond
capacity (any of the three stages) the window's backlog adds to it.

What wins where (the ``slo_limit`` column says which SLO metric stops each config's rate): an
aggregated engine mixes prompt tokens into decode steps, so a tight TPOT / ITL target binds it
early; a disaggregated one spends devices on a pool that only prefills and pays the transfer, so
it loses where TTFT binds or the devices are better used as more aggregated replicas.

Left out (stated): the proxy's own latency (a local HTTP hop, sub-millisecond against the rest),
the transfer's contention with the tensor-parallel collectives on the same links, prefix-cache
hits on the decode side, and a decode instance's admission of the transferred blocks (assumed as
soon as a slot is free).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..parameters import kv_connector_on, prefill_tp_or_tp, serving_parameter
from ._common import HW, Shape
from ._serve import (
    GRID,
    LEVELS,
    RHO_MAX,
    SERVE_MEM_COMPONENTS,
    _Z,
    Engine,
    Traffic,
    _col,
    batch_figures,
    batch_queue_waits,
    concurrency_at,
    overload_backlog,
    slot_wait,
    window_wait,
    within_window,
    wait_quantile,
)

# A connector's transport: (path, efficiency on it, handshake latency in s). "link": the devices'
# own links (RDMA / NVLink / HCCS through NIXL, Mooncake, LLMDataDist, NCCL), at that share of the
# link the pools share (intra-node) or of the NICs (inter-node); "storage": written to and read
# back from a file system at STORAGE_BYTES_PER_S (vLLM's shared-storage example connector).
TRANSPORTS: dict[str, tuple[str, float, float]] = {
    "nixl": ("link", 0.8, 1e-3),
    "mooncake": ("link", 0.8, 1e-3),
    "d2d": ("link", 0.8, 1e-3),  # MindIE's D2DTransfer: the NPUs' RoCE links (LLMDataDist), as Mooncake's
    "lmcache": ("link", 0.5, 2e-3),  # through the host's memory: half the device link, order of magnitude
    "shared_storage": ("storage", 1.0, 5e-3),
}
CONNECTORS = serving_parameter("kv_connector").allowed  # the column's codes index this
# a local NVMe file system's sustained write-then-read, order of magnitude (the shared-storage
# connector saves every layer's KV to a file and the decode instance loads it back)
STORAGE_BYTES_PER_S = 2.0e9


def _pool_columns(c: dict, tp: np.ndarray, replicas: np.ndarray) -> dict:
    out = dict(c)
    out["tp"], out["replicas"] = tp, replicas
    return out


def _kv_bytes_per_token(s: Shape, eng: Engine) -> np.ndarray:
    """The whole model's KV cache of one token (every layer, every K/V head), in the cache's dtype."""
    return s.layers * 2.0 * s.kv_heads * s.head_dim * eng.kvb


def priced_disaggregated(s: Shape, hw: HW, c: dict, tr: Traffic) -> dict[str, Any]:
    """Every config as a disaggregated deployment, in :func:`._serve.priced_aggregated`'s shape
    (rows that are not disaggregated are priced with one prefill instance and masked by the caller)."""
    n = c["tp"].size
    R_p = np.maximum(np.asarray(c["prefill_replicas"], dtype=float), 1.0)
    tp_p = prefill_tp_or_tp(np.asarray(c["prefill_tp"]), c["tp"]).astype(float)
    pre = Engine(s, hw, _pool_columns(c, tp_p, R_p), tr)
    dec = Engine(s, hw, c, tr)
    mem_p, mem_d = pre.memory(), dec.memory()
    dec.caps(mem_d["kv_tokens"])
    R_d, Rp = dec.r, _col(R_p)
    devices = (R_d * dec.t + Rp * pre.t) * dec.p

    # --- the prefill pool: prompt-only steps ---------------------------------------------------------
    P_eff = pre.P_eff
    cmax = np.maximum(np.where(pre.chunked, pre.mbt, np.floor(pre.mbt / P_eff) * P_eff), P_eff)
    zero = np.zeros_like(cmax)
    T_full = pre.iteration(zero, cmax)
    mu_p = (cmax / P_eff) / T_full  # prompts/s of one prefill instance
    n_max = cmax / P_eff  # prompts a step carries at most (below one: a prompt takes several steps)

    def prefill_time(P_tokens: Any) -> np.ndarray:
        """A prompt of P_tokens computed tokens alone: its step, or its chunks' steps."""
        chunk = np.minimum(P_tokens, cmax) * np.ones_like(cmax)
        return pre.iteration(np.zeros_like(chunk), chunk) * np.maximum(1.0, P_tokens / cmax)

    t_one = prefill_time(P_eff)

    # --- the decode pool: decode-only steps --------------------------------------------------------
    B_cap = np.maximum(np.minimum(dec.mns, dec.B_kv), 1e-3)
    dec.B_cap = B_cap  # the preemption and KV-use figures read the decode pool's own ceiling

    def decode_step(B: np.ndarray, over: Any = False) -> tuple[np.ndarray, np.ndarray]:
        """(seconds of a decode step at concurrency B, preemptions per request): a preempted
        request's prompt and half its output are recomputed in the decode pool's steps."""
        pre_req = dec.preempted(B, over)
        redo = pre_req * (B / dec.O_dec) * (dec.P + dec.O / 2.0)
        return dec.iteration(B, redo), pre_req

    t_cap, _ = decode_step(B_cap)
    mu_d = B_cap / (dec.O_dec * t_cap)  # requests/s of one decode instance

    # --- the KV transfer ---------------------------------------------------------------------------
    codes = np.asarray(c.get("kv_connector", np.zeros(n)), dtype=np.int64)
    names = [kv_connector_on(CONNECTORS[k], hw.accelerator) for k in codes]
    eff = _col(np.array([TRANSPORTS[name][1] for name in names]))
    hand = _col(np.array([TRANSPORTS[name][2] for name in names]))
    storage = _col(np.array([TRANSPORTS[name][0] == "storage" for name in names]))
    one_node = devices <= hw.dpn
    links = np.minimum(pre.t, dec.t) * dec.p
    link_bw = np.where(one_node, hw.intra, hw.inter) * eff * links
    bw = np.where(storage, STORAGE_BYTES_PER_S, link_bw)
    kv_tok = _kv_bytes_per_token(s, dec)

    def transfer(P_tokens: Any) -> np.ndarray:
        return hand + P_tokens * kv_tok / bw

    mu_kv = bw / (tr.prompt.mean * kv_tok)  # the links (or the file system) all requests share
    capacity = np.minimum(np.minimum(Rp * mu_p, R_d * mu_d), mu_kv)

    v_slot = (tr.ca2 + tr.output.cv2) / 2.0
    v_pf = (tr.ca2 + tr.prompt.cv2) / 2.0
    burst = 2.0 / (1.0 + tr.ca2)
    var_B = (1.0 + tr.ca2) / 2.0
    S_slot = dec.O_dec * t_cap

    def at(lam: np.ndarray, B: np.ndarray) -> dict[str, np.ndarray]:
        """Latency quantiles (seconds) at system rates lam (N, K), the decode pool at concurrency B."""
        lam_p, lam_d = lam / Rp, lam / R_d
        over_d = lam_d >= mu_d
        # the prefill stage: a batch-service queue, its TTFT from the scheduler's runs (the module docstring)
        waits = batch_queue_waits(lam_p, t_one, T_full, n_max, v_pf, tr.duration)

        # the decode pool's running slots: as busy as its running count says, each held for a request's
        # decode at this load (at capacity, the capacity's), as the aggregated engine's (_serve.Engine.evaluate)
        t_mean, pre_mean = decode_step(B, over_d)
        rho_d = np.minimum(lam_d / mu_d, RHO_MAX)
        busy = np.where(over_d, rho_d, np.minimum(B / B_cap, rho_d))
        pw_slot, scale_slot = slot_wait(busy, B_cap, np.where(over_d, S_slot, dec.O_dec * t_mean), v_slot, burst)
        scale_slot = within_window(pw_slot, scale_slot, window_wait(lam_d / mu_d, mu_d, v_slot, tr.duration))
        rho_sys = lam / np.maximum(capacity, 1e-12)
        backlog = overload_backlog(rho_sys, tr.duration)
        base_pf, base_kv = t_one, transfer(tr.prompt.mean)
        # the decode instance's first token is its own step (it computes the prompt's last token), after
        # the rest of the step in progress: a replay of vLLM's scheduler on both pools put TTFT's p50 one
        # decode step above the model's while this step was left out (benchmarks/serving_queue_vs_scheduler.py)
        fixed = dec.api + t_mean / 2.0 + t_mean
        out: dict[str, np.ndarray] = {}
        out["ttft_mean"] = fixed + base_pf + base_kv + waits["mean"] + np.hypot(pw_slot * scale_slot, 0.5 * backlog)
        t_min = dec.iteration(np.zeros_like(B), np.zeros_like(B))
        for q in LEVELS:
            z = _Z[q]
            P_q = np.maximum(tr.prompt.q(q) - np.where(pre.caching, np.minimum(pre.cached, tr.prompt.q(q)), 0.0), 1.0)
            svc_q, kv_q = prefill_time(P_q), transfer(tr.prompt.q(q))
            w_p = waits[f"{q:g}"]
            w_slot = np.hypot(wait_quantile(pw_slot, scale_slot, q), q * backlog)
            fixed_q = dec.api + q * t_mean + t_mean
            ttft = (
                fixed_q
                + base_pf
                + base_kv
                + np.sqrt((svc_q - base_pf) ** 2 + (kv_q - base_kv) ** 2 + w_p**2 + w_slot**2)
            )
            if q < 0.5:
                ttft = fixed_q + svc_q + kv_q  # the lucky: no wait, a short prompt
            Bq = np.clip(B + z * np.sqrt(np.maximum(B, 0.0) * var_B), 0.0, B_cap)
            Bq = np.where(over_d, B_cap, Bq)
            tpot = np.maximum(decode_step(Bq, over_d)[0] if z != 0.0 else t_mean, t_min)
            tag = f"{q:g}"
            out[f"ttft_{tag}"], out[f"tpot_{tag}"], out[f"itl_{tag}"] = ttft, tpot, tpot
            out[f"e2e_{tag}"] = dec.e2e_quantile(ttft, out["ttft_mean"], tpot, t_mean, q)
        out["tpot_mean"] = t_mean
        out["e2e_mean"] = out["ttft_mean"] + dec.O_dec * t_mean
        out["kv_cache_usage"] = dec.kv_cache_usage(B, over_d)
        out["preempted_per_request"] = pre_mean
        out["rho"] = rho_sys
        out["B"] = B
        return out

    # --- the SLO curve over system rates up to capacity; the traffic's rates ------------------------
    grid_lam = capacity * GRID[None, :]
    grid_B_dec = B_cap * GRID[None, :]
    grid_lam_dec = grid_B_dec / (dec.O_dec * decode_step(grid_B_dec)[0])

    def decode_concurrency(lam: np.ndarray) -> np.ndarray:
        return concurrency_at(lam / R_d, grid_B_dec, grid_lam_dec, mu_d, B_cap)

    rates = np.broadcast_to(tr.rates[None, :], (n, tr.rates.size))
    return {
        "grid_rate": grid_lam,
        "grid": at(grid_lam, decode_concurrency(grid_lam)),
        "at_rates": at(rates, decode_concurrency(rates)),
        "capacity": capacity[:, 0],
        "devices": devices[:, 0],
        "max_concurrency": B_cap[:, 0],  # per decode instance, as the aggregated engine's per replica
        "prefix_cache_hit_rate": pre.prefix_hit_rate(),  # the prompts are computed by the prefill pool
        "mem": _memory(mem_p, mem_d),
        "closed_loop": _closed_loop(pre, dec, Rp, cmax, transfer, tr),
    }


def _memory(mem_p: dict[str, np.ndarray], mem_d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Both pools must start; the figures are the pool that does not (the prefill pool first), else the
    one whose devices hold more."""
    peak_p = sum(mem_p[k] for k in SERVE_MEM_COMPONENTS)
    peak_d = sum(mem_d[k] for k in SERVE_MEM_COMPONENTS)
    use_p = ~mem_p["starts"] | (mem_d["starts"] & (peak_p > peak_d))
    out = {k: np.where(use_p, mem_p[k], mem_d[k]) for k in mem_d}
    out["starts"] = mem_p["starts"] & mem_d["starts"]
    out["kv_tokens"] = mem_d["kv_tokens"]
    return out


def _closed_loop(pre: Engine, dec: Engine, Rp: np.ndarray, cmax: np.ndarray, transfer: Any, tr: Traffic) -> dict:
    """b requests sent at once: their prompts in budget-sized prefill steps over the prefill instances,
    the last prompt's KV sent, then decode steps of the batch over the decode instances. The first
    request's decode does not stall for the others' prefill here (that runs on the prefill pool), so
    the batch's time for 100 tokens is the last request's."""
    out: dict[str, np.ndarray] = {}
    for b in tr.batch_sweep:
        tokens = np.ceil(b / Rp) * pre.P_eff
        c1 = np.minimum(cmax, tokens)
        zero = np.zeros_like(c1)
        ttft = dec.api + pre.iteration(zero, c1) * np.maximum(1.0, tokens / cmax) + transfer(pre.P)
        br = np.minimum(np.ceil(b / dec.r), dec.mns)
        ttft = ttft + dec.iteration(br, np.zeros_like(br))
        t100 = dec.iteration(br, np.zeros_like(br), dec.P + 50.0)
        batch_figures(out, b, ttft, t100, dec.iteration(br, np.zeros_like(br)), dec)
    return out
