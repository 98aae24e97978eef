"""Serving: an engine with continuous batching (vLLM / vLLM-Ascend, MindIE) under open-loop traffic.

Everything is per *replica* (one engine instance on tp*pp devices); ``replicas`` instances behind
one load balancer split the offered rate evenly. Vectorised over N configs: config columns are
(N, 1), loads are (N, K) (K rates of the traffic's ladder, or the G points of the concurrency
grid below), so a whole space is priced in one numpy pass.

**Fit, as the engine decides it** (vLLM ``Worker.determine_available_memory``, vLLM-Ascend's
``NPUWorker`` likewise): the engine may use ``memory_utilization x device memory``; from it go the
weights (tp-sharded, 1/pp of the layers, quantised as ``_infer`` prices them), the runtime
reserve and the communicators' buffers, the activation peak of the profiling forward pass
(``max_num_batched_tokens`` tokens through one layer's working set, plus ``max_num_seqs`` fp32
logits and probabilities of the sampler's dummy run) and the graph pool (the largest captured
batch, ``min(2 max_num_seqs, 512)`` tokens, vLLM 0.32's ``max_cudagraph_capture_size``). The rest
is the KV cache, in blocks of ``block_size`` tokens of ``2 x layers/pp x max(kv_heads/tp, 1) x
head_dim x kv bytes``. The engine refuses to start, rather than run out of memory later, when the
weights cannot be loaded (weights + reserve > device memory: "not enough memory for the
weights") or the KV cache cannot hold one ``max_model_len`` sequence (vLLM's
``_check_enough_kv_cache_memory``: "not enough memory for the KV cache"). ``peak_memory_gib`` is
then the reservation, ``memory_utilization x device memory``.

**One engine iteration** (Sarathi-Serve's and vLLM V1's scheduler: decodes first, then prompt
tokens up to ``max_num_batched_tokens``) with B decoding sequences and c prompt tokens:

    T(B, c) = L x [max(GEMM(B/pp + c/pp) + attn + elementwise, host launches) + TP all-reduce]
              + pp x LM head + (pp-1) x p2p + scheduler overhead (per step and per sequence)

GEMMs through ``_common.gemm_time`` (a roofline: decode rows stream the weights, memory-bound;
prompt rows are compute-bound), decode attention streams B x context x KV bytes, prompt attention
is causal flash attention at its FLOP rate, the tensor-parallel all-reduces as ``_infer`` (when tp
spans nodes, in two levels: the node's ring, then each device's share over its NIC; an instance
wider than a node sends its cross-node stage hops over the NICs too). With
pp > 1 vLLM keeps pp micro-batches in flight, so a token of each sequence takes pp stage times of
B/pp rows: pipeline parallelism adds memory, not speed, for a token. Graph capture
(``graph``/``torchair``) cuts the host launches of captured shapes to a quarter, as ``_infer``
does for compile; mixed prefill batches run piecewise (half); eager pays every launch.

**Continuous batching, parametrised by the running concurrency B** (no fixed point to solve):
a request runs its prompt's step (or the chunks of a prompt longer than the budget left) and then
decodes O-1 tokens, one per iteration, so Little's law gives the prompts admitted per iteration
k = lambda t = B / (O - 1 + its prompt's steps). An iteration carries prompt tokens with probability f and
then a chunk c_busy: the prompts that arrived together, min(c_max, P_eff max(1, k)), or, while
prompts are backlogged (probability rho_p = k P_eff / c_max, the prompt stage's utilisation),
the whole leftover budget c_max = max_num_batched_tokens - B with chunked prefill, or the whole
prompts that fit in it without (vLLM V1 schedules an unchunked prompt only whole). Work
conservation gives f = k P_eff / c_busy and the mean iteration

    t(B) = f T(B, c_busy) + (1 - f) T(B, 0),        lambda(B) = k(B) / t(B).

The replica's capacity mu = lambda(B_cap) at the largest concurrency it can hold:
B_cap = min(max_num_seqs, KV cache tokens / (P_own + O/2 + block/2), the concurrency at which
prompts use the whole token budget). Prefix caching stores the shared prefix once and skips its
prefill (whole blocks). When the concurrency the load brings (Poisson-like, variance B x
(1 + ca^2)/2) exceeds what the KV cache holds, vLLM preempts: the expected excess over the KV
limit gives the preemptions, each re-computing its prompt and half its output.

**Queueing at an offered rate lambda** (per replica, rho = lambda / mu):
- waiting for a running slot: the replica as a G/G/c queue with c = B_cap slots, each held for
  S = TTFT + (O-1) t(B_cap); Sakasegawa's (1977) mean wait W = v rho^(sqrt(2(c+1)) - 1) S /
  (c (1 - rho)) with the Allen-Cunneen / Kingman variability factor v = (ca^2 + cs^2)/2 (ca^2 =
  1/burstiness for gamma arrivals, 1 for Poisson, a replayed trace's own gaps'; cs^2 the squared
  coefficient of variation of the output length); a request waits with probability
  P_w = (rho^(sqrt(2(c+1)) - 1))^(2/(1+ca^2)) (the Poisson value, raised for burstier arrivals)
  and then an exponential time of mean W / P_w,
  so the q-quantile of the wait is max(0, ln(P_w / (1 - q))) W / P_w;
- waiting for the prompt stage: the steps that carry prompts batch every prompt waiting, up to the
  budget left beside the B decodes, so the stage is a batch-service queue with steps T(B, n P_eff)
  (n prompts), read from a table of discrete-event runs of vLLM's scheduler (:mod:`._prefill_queue`,
  as the disaggregated prefill pool) at the admitted rate, and scaled as Kingman's wait,
  (ca^2 + cv_prompt^2), for burstier arrivals and unequal prompts. (A G/G/1 of one prompt's share of
  the budget, rho_p = k P_eff / c_max, with the arrival's wait for the step in progress taken as
  q E[T^2] / E[T], put TTFT's p99 at 0.45-0.7x the scheduler's on the same steps:
  benchmarks/serving_queue_vs_scheduler.py);
- a finite load window D: the steady-state waits are held at what D can build from the
  fluctuations alone (:func:`window_wait`), and beyond capacity (rho >= 1) the backlog grows: the
  q-th arrival waits q (rho - 1) D more, added to the steady part as a root sum of squares.
TTFT = API overhead + the rest of a decode step (quantile q waits q T(B, 0); the prompt step in
progress is the prompt stage's) + the prompt's own iterations + both waits;
its percentiles add the tail excesses of the waits and of the prompt length as a root sum of
squares (exact for independent normal parts). TPOT at quantile q: the iteration time at the
q-quantile of the running concurrency and the stalls of the prompts that arrive during the request's
decode (a Poisson count, its skew by Cornish-Fisher, amplified as the stalls lengthen the decode),
as a root sum of squares; ITL:
the two-point mixture of decode-only and prompt-carrying iterations (p99 ITL is the
prompt-carrying step once f > 1 %). E2E = TTFT + (O-1) TPOT, tails as a root sum of squares. A
rate meets the SLO when every p99 target holds; the attainment is the quantile at which each
targeted metric reaches its target (the least of them), goodput = offered rate x attainment (as
the probe measures it: objectives/serving.py).
``max_rate_rps_model`` is the largest lambda on the concurrency grid (continuous, not only the
ladder) whose p99s meet the SLO.

**Chunked prefill under load**: chunking lets a prompt use the whole leftover budget instead of
waiting for room for all of it, so prompts clear faster (TTFT falls), while the iterations that
carry prompt tokens are larger and more of them (TPOT and ITL tails rise): vLLM's own tuning
guide ("higher max_num_batched_tokens: better TTFT; smaller: better ITL").

What the model leaves out (stated, not hidden): speculative decoding, KV swapping to the host,
MindIE's separate prefill/decode batching limits (``engine.*`` keys are not priced), the probe's
token-id prompts' tokenisation (none) and request failures (always 0).

Why one module of over 500 lines: 86 of them are this statement of the model, and the code is one
derivation over the same (N, K) arrays (the fit, one iteration's time, the queue at each load, the
verdict at the SLO), each step the input of the next: after the statement, about 460 lines of code and docstrings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from scipy.stats import poisson

from ._checks import max_model_len
from ..parameters import instance_nodes, serving_default
from ..trace_prefix import MOONCAKE_BLOCK_TOKENS, reuse_share
from ._common import GIB, HW, Shape, allreduce, gemm_time, group_bandwidth, quant_peak, quant_weight_bytes
from ._infer import DECODE_OPS
from ._prefill_queue import prefill_ttft

# Host-side cost of one engine step (scheduling, input preparation, sampling), in kernel-launch
# equivalents of the profile (vLLM V1's CPU overhead per step, and per running sequence).
STEP_LAUNCHES = 100.0
SEQ_LAUNCHES = 1.0
# HTTP, request parsing and the first streamed chunk: a few ms above the engine's own prefill in
# vLLM's benchmark_serving at batch 1 (order of magnitude).
API_OVERHEAD_S = 0.003
# Graph capture: host launches left of captured decode batches (as _infer for compile), of mixed
# batches run piecewise (attention outside the graph), and with torchair (whole-graph on Ascend).
GRAPH_HOST_SCALE = 0.25
PIECEWISE_HOST_SCALE = 0.5
TORCHAIR_HOST_SCALE = 0.2
# The graph pool beyond the captured activations (per-graph bookkeeping, captured workspaces).
GRAPH_BASE_BYTES = 0.25 * GIB
STALL_SKEW_MAX = 2.0  # Cornish-Fisher's skew term tracks a Poisson count's p99 to a mean of about 0.25
RHO_MAX = 0.99  # the steady-state queue formulas are held at this utilisation beyond it
LEVELS = (0.01, 0.5, 0.9, 0.99, 0.999)  # quantiles priced; 0.01 and 0.999 bound the attainment
_Z = {0.01: -2.3263, 0.5: 0.0, 0.9: 1.2816, 0.99: 2.3263, 0.999: 3.0902}
# concurrency grid as fractions of B_cap: geometric at light load, linear near capacity
GRID = np.concatenate([np.geomspace(1e-4, 0.5, 24, endpoint=False), np.linspace(0.5, 1.0, 25)])
SERVE_MEM_COMPONENTS = ("weights", "activations", "graph_pool", "comm_buffers", "runtime_reserve", "kv_cache")
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: fixed, uniform over [low, high], or the empirical one of a
    list of lengths."""

    mean: float
    cv2: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, spec: Any, pairs: list | None = None, index: int = 0) -> "Lengths":
        if pairs:
            x = np.array([float(p[index]) for p in pairs])
        elif isinstance(spec, Mapping):
            lo, hi = float(spec["low"]), float(spec["high"])
            x = np.linspace(lo, hi, 101)
        else:
            x = np.array([float(spec)])
        mean = float(x.mean())
        return cls(mean, float(x.var() / max(mean, 1e-9) ** 2), tuple(float(v) for v in np.sort(x)))

    def q(self, level: float) -> float:
        return float(np.quantile(np.asarray(self.values), level))


@dataclass(frozen=True)
class Traffic:
    rates: np.ndarray
    ca2: float
    prompt: Lengths
    output: Lengths
    shared: float
    duration: float
    slo: dict[str, float | None]
    batch_sweep: tuple[int, ...]
    max_model_len: int

    @classmethod
    def of(cls, workload: Mapping[str, Any]) -> "Traffic":
        tr = workload.get("traffic") or {}
        rates = tr.get("rates")
        if rates is None and tr.get("rate") is not None:
            rates = [tr["rate"]]
        if not rates:
            raise ValueError("serve workload: traffic.rates is empty")
        pairs = tr.get("length_pairs")
        arrival = str(tr.get("arrival", "poisson"))
        shape = 1.0 if arrival == "poisson" else float(tr.get("burstiness", 1.0) or 1.0)
        if arrival == "trace":  # the trace's own burstiness: its gaps' squared coefficient of variation
            gaps = np.diff(np.asarray(tr.get("arrival_times") or [0.0, 1.0], dtype=float))
            shape = 1.0 / max(float(gaps.var() / max(gaps.mean(), 1e-12) ** 2), 0.05) if gaps.size > 1 else 1.0
        if shape <= 0:
            raise ValueError(f"serve workload: burstiness must be positive, got {shape}")
        slo = dict(workload.get("slo") or {})
        return cls(
            rates=np.sort(np.asarray([float(r) for r in rates])),
            ca2=1.0 / shape,
            prompt=Lengths.of(tr.get("prompt_len", 512), pairs, 0),
            output=Lengths.of(tr.get("output_len", 128), pairs, 1),
            shared=_shared_share(tr, pairs),
            duration=float(tr.get("duration_s", 60.0) or 60.0),
            slo={
                f"{m}_p99_ms": (None if slo.get(f"{m}_p99_ms") is None else float(slo[f"{m}_p99_ms"]))
                for m in SLO_METRICS
            },
            batch_sweep=tuple(int(b) for b in (workload.get("batch_sweep") or ())),
            max_model_len=max_model_len(workload),
        )


def _shared_share(tr: Mapping[str, Any], pairs: Any) -> float:
    """The share of each prompt a prefix cache may reuse: ``shared_prefix``, or with a trace's block
    ids (``prefix_blocks``, Mooncake's ``hash_ids``) the share its repeated prefixes would save an
    unbounded cache in one run of the probe (workers/trace_prefix.py), whichever is larger."""
    share = float(tr.get("shared_prefix", 0.0) or 0.0)
    blocks = tr.get("prefix_blocks")
    if blocks and pairs:
        prompts = [int(p) for p, _ in pairs]
        # a run of the probe replays rate x duration consecutive requests (at the ladder's middle rate)
        rates = sorted(float(r) for r in (tr.get("rates") or [1.0]))
        window = max(int(rates[len(rates) // 2] * float(tr.get("duration_s", 60.0) or 60.0)), 1)
        size = int(tr.get("block_tokens") or MOONCAKE_BLOCK_TOKENS)
        share = max(share, reuse_share(blocks, prompts, size, window))
    return share


def _col(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=float)[:, None]


def _excess(mean: np.ndarray, sd: np.ndarray, k: np.ndarray) -> np.ndarray:
    """E[(N - k)+] for N ~ Normal(mean, sd^2)."""
    sd = np.maximum(sd, 1e-9)
    z = (k - mean) / sd
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + _erf(z / math.sqrt(2.0)))
    return sd * pdf + (mean - k) * (1.0 - cdf)


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7), vectorised without scipy."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    y = 1.0 - (
        ((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592
    ) * t * np.exp(-a * a)
    return s * y


class Engine:
    """One replica of every config: memory, iteration time and the load -> latency map."""

    def __init__(self, s: Shape, hw: HW, c: dict, tr: Traffic):
        self.s, self.hw, self.tr = s, hw, tr
        # what a request waits outside the engine's steps (HTTP, the API server, the first chunk's way
        # back): the model's few ms, plus what `autotune calibrate --serving` measured on this host
        self.api = API_OVERHEAD_S + hw.serve_latency
        n = c["tp"].size
        self.n = n
        t, p = _col(c["tp"]), _col(c["pp"])
        self.t, self.p, self.r = t, p, _col(c["replicas"])
        self.mns, self.mbt = _col(c["max_num_seqs"]), _col(c["max_num_batched_tokens"])
        default_bs = float(serving_default("block_size", hw.accelerator))  # 0: the engine's own on this device
        self.bs = np.where(_col(c["block_size"]) > 0, _col(c["block_size"]), default_bs)
        self.chunked = _col(c["enable_chunked_prefill"]) > 0
        self.caching = _col(c["enable_prefix_caching"]) > 0
        self.util = _col(c["memory_utilization"])
        self.gm = _col(c["graph_mode"])
        prec = c["precision"].astype(np.int64)
        q = c["quantization"].astype(np.int64)
        self.e = _col(np.where(prec == 2, 4.0, 2.0))
        self.wq = _col(quant_weight_bytes(q, np.where(prec == 2, 4.0, 2.0)))
        self.peak = _col(quant_peak(hw, q, prec))
        self.peak_prec = _col(hw.peak_of(prec))
        self.kvb = np.where(_col(c["kv_cache_dtype"]) == 0, self.e, _col(c["kv_cache_bytes"]))
        self.hccl_mb = _col(c["hccl_buffsize_mb"])
        self.layers = s.layers / p
        kv_dev = np.maximum(s.kv_heads / t, 1.0)  # K/V heads on one rank (replicated when tp > kv)
        self.kv_layer = 2.0 * kv_dev * s.head_dim * self.kvb  # bytes per token per layer per device
        self.kv_tok = self.layers * self.kv_layer
        self.shapes = ((s.h, s.qkv_out / t), (s.h / t, s.h), (s.h, s.mlp_in_out / t), (s.ffn / t, s.h))
        # tp within a node: one ring; tp across whole nodes: HCCL's and NCCL's two levels, the ring of a
        # node's devices, then each device's share over its NIC between the nodes (alpha, the NICs' latency)
        self.tp_local = np.minimum(t, float(hw.dpn))
        self.tp_nodes = np.maximum(t / hw.dpn, 1.0)
        self.bw_ar = group_bandwidth(hw, self.tp_local, np.ones_like(t), hw.ar_eff)
        self.p2p_bw = hw.intra * hw.ag_eff
        # an instance wider than a node (whole nodes, INSTANCE_NODES_RULE): its stage boundaries that
        # cross a node go over the NICs (every boundary when one stage's tp spans nodes itself)
        nodes = instance_nodes(t * p, float(hw.dpn))
        self.p2p_across = np.where(t >= hw.dpn, p - 1.0, np.minimum(nodes - 1.0, p - 1.0))

        # --- lengths (means per request; prefix caching skips the shared prefix's whole blocks) ---
        P, out_len = tr.prompt.mean, tr.output.mean
        self.P, self.O = P, out_len
        self.O_dec = max(out_len - 1.0, 1.0)
        # the iterations a request runs, its prompt's step and one a token after the first (in one step
        # when its prompt fits the budget left: :meth:`state` counts the chunks of a longer one)
        self.O_run = max(out_len - 1.0, 0.0) + 1.0
        self.cached = np.where(self.caching, np.floor(tr.shared * P / self.bs) * self.bs, 0.0)
        self.P_eff = np.maximum(P - self.cached, 1.0)  # prompt tokens computed per request
        self.ctx_dec = P + out_len / 2.0
        self.ctx_pre = self.cached + self.P_eff / 2.0  # mean causal context of a computed prompt token

    # ------------------------------------------------------------------------------------------
    def memory(self) -> dict[str, np.ndarray]:
        """Bytes per device, the engine's start-up verdict and the KV cache it gets."""
        s, hw, t, p, e = self.s, self.hw, self.t, self.p, self.e
        mm = s.h * s.qkv_out + s.h * s.h + (3.0 if s.arch == "llama" else 2.0) * s.h * s.ffn
        embed = s.vocab * s.h / t
        out_layer = 0.0 if s.tied else embed
        weights = self.layers * mm / t * self.wq + (embed + np.where(p == 1, out_layer, 0.0)) * e
        per_tok = (2.0 * s.h + s.qkv_out / t + s.mlp_in_out / t + s.ffn / t) * e  # one layer's working set
        acts = self.mbt * per_tok + self.mns * s.vocab * 8.0  # profile forward + sampler logits/probs
        capture = np.minimum(2.0 * self.mns, 512.0)
        graph = np.where(self.gm >= 1, GRAPH_BASE_BYTES + capture * per_tok, 0.0)
        n_comm = (t > 1) * 1.0 + (p > 1)
        per_comm = 2.0 * self.hccl_mb * 2.0**20 if hw.hccl else hw.comm_mib * 2.0**20
        comm = n_comm * per_comm
        reserve = np.full_like(t, hw.reserve)
        non_kv = weights + acts + graph + comm + reserve
        budget = self.util * hw.mem_bytes
        kv_mem = budget - non_kv
        block = self.bs * self.kv_tok
        blocks = np.floor(np.maximum(kv_mem, 0.0) / block)
        need_one = np.ceil(self.tr.max_model_len / self.bs) * block
        weights_oom = weights + reserve + comm > hw.mem_bytes
        kv_oom = ~weights_oom & (kv_mem < need_one)
        starts = ~weights_oom & ~kv_oom
        return {
            "weights": weights,
            "activations": acts,
            "graph_pool": graph,
            "comm_buffers": comm * np.ones_like(t),
            "runtime_reserve": reserve,
            "kv_cache": np.where(starts, kv_mem, need_one),
            "kv_available": kv_mem,
            "kv_need_one": need_one,
            "kv_tokens": blocks * self.bs,
            "budget": budget,
            "weights_oom": weights_oom,
            "kv_oom": kv_oom,
            "starts": starts,
        }

    # ------------------------------------------------------------------------------------------
    def iteration(self, B: np.ndarray, c: np.ndarray, ctx_dec: Any = None) -> np.ndarray:
        """Seconds of one engine step with B decoding sequences and c prompt tokens (per replica):
        the model's step, or where the profile holds the engine's measured steps
        (``serving_steps``, ``autotune calibrate --serving``) its decode part and its prompt part
        each scaled as the measurements say, plus their costs per step, per decoding sequence and
        per token of its context."""
        step = self._modelled_step(B, c, ctx_dec)
        hw = self.hw
        if not hw.serving_calibrated:
            return step
        decode = self._modelled_step(B, np.zeros_like(c), ctx_dec)
        ctx = self.ctx_dec if ctx_dec is None else ctx_dec
        measured = hw.serve_step + B * (hw.serve_seq + ctx * hw.serve_ctx) + c * hw.serve_tok
        return measured + hw.serve_decode * decode + hw.serve_prefill * (step - decode)

    def _modelled_step(self, B: np.ndarray, c: np.ndarray, ctx_dec: Any = None) -> np.ndarray:
        """The analytical step (roofline GEMMs, attention, collectives, host launches)."""
        s, hw, t, p, e = self.s, self.hw, self.t, self.p, self.e
        ctx = self.ctx_dec if ctx_dec is None else ctx_dec
        Bm, cm = B / p, c / p  # pp micro-batches in flight
        m = np.maximum(Bm + cm, 1e-3)
        g = sum(gemm_time(hw, self.peak, m, k, n_, e, self.wq) for k, n_ in self.shapes)
        attn = Bm * ctx * self.kv_layer / hw.bw + 4.0 * cm * self.ctx_pre * s.h / t / (self.peak_prec * hw.fa_eff)
        ew = (12.0 * s.h + 3.0 * s.ffn / t) * m * e / hw.bw
        tp = 2.0 * (
            allreduce(m * s.h * e, self.tp_local, self.bw_ar, hw.tp_alpha)
            + allreduce(m * s.h * e / self.tp_local, self.tp_nodes, hw.inter, hw.alpha)
        )
        capture = np.minimum(2.0 * self.mns, 512.0)
        captured = np.where(self.gm == 2, TORCHAIR_HOST_SCALE, GRAPH_HOST_SCALE)
        scale = np.where(
            self.gm == 0, 1.0, np.where(m > capture, 1.0, np.where(cm > 0, PIECEWISE_HOST_SCALE, captured))
        )
        host = DECODE_OPS * hw.launch * scale
        layer = np.maximum(g + attn + ew, host) + tp
        prompts = cm / self.P_eff  # prompts finishing in this step sample a token too
        head = gemm_time(hw, self.peak_prec, np.maximum(Bm + np.minimum(prompts, cm), 1e-3), s.h, s.vocab / t, e)
        hop = m * s.h * e
        p2p = (p - 1.0 - self.p2p_across) * (hop / self.p2p_bw + hw.alpha) + self.p2p_across * (
            hop / hw.inter + hw.alpha
        )
        overhead = hw.launch * (STEP_LAUNCHES + SEQ_LAUNCHES * (B + c / self.P_eff))
        return s.layers * layer + p * head + p2p + overhead

    # ------------------------------------------------------------------------------------------
    def caps(self, kv_tokens: np.ndarray) -> None:
        """The concurrency a replica holds: max_num_seqs, the KV cache, the token budget."""
        shared_tok = np.where(self.caching, self.cached, 0.0)
        self.kv_tokens = kv_tokens
        self.tok_seq = self.P - shared_tok + self.O / 2.0 + self.bs / 2.0  # mean blocks held, in tokens
        self.B_kv = np.maximum(kv_tokens - shared_tok, 0.0) / self.tok_seq
        # vLLM admits a waiting request when its prompt's blocks are free: the admission ceiling
        self.B_adm = np.minimum(self.mns, np.maximum(kv_tokens - shared_tok, 0.0) / (self.P - shared_tok + self.bs))
        P, Od = self.P_eff, self.O_run
        b_chunk = self.mbt / (1.0 + P / Od)  # k P_eff = mbt - B
        n_star = np.maximum(np.floor(self.mbt / (P + Od)), 1.0)
        b_whole = np.maximum(
            np.minimum(self.mbt - n_star * P, n_star * Od),
            np.minimum(self.mbt - (n_star + 1.0) * P, (n_star + 1.0) * Od),
        )
        self.B_pf = np.where(self.chunked, b_chunk, np.maximum(b_whole, 1e-3))
        self.B_cap = np.maximum(np.minimum(np.minimum(self.mns, self.B_kv), self.B_pf), 1e-3)

    def preempted(self, B: np.ndarray, overloaded: Any = False) -> np.ndarray:
        """Expected preemptions per request at mean concurrency B: the running count fluctuates
        (variance B (1 + ca^2)/2) up to the admission ceiling; whatever exceeds what the KV cache
        holds is preempted."""
        mean = np.where(overloaded, self.B_adm, B)
        sd = np.sqrt(np.maximum(mean, 0.0) * (1.0 + self.tr.ca2) / 2.0)
        top = np.maximum(self.B_adm, self.B_kv)
        over = _excess(mean, sd, self.B_kv) - _excess(mean, sd, top)
        return np.where(self.B_kv < self.mns, np.maximum(over, 0.0) / np.maximum(mean, 1e-9), 0.0)

    def state(self, B: np.ndarray, overloaded: Any = False) -> dict[str, np.ndarray]:
        """Everything at running concurrency B (explicit: no fixed point)."""
        pre = self.preempted(B, overloaded)
        Pw = self.P_eff + pre * (self.P + self.O / 2.0)  # prompt tokens per request, recomputation included
        room = np.maximum(self.mbt - B, 0.0)
        cmax = np.where(self.chunked, room, np.floor(room / self.P_eff) * self.P_eff)
        cmax = np.maximum(cmax, 1e-3)
        # prompts admitted per iteration (Little's law): a request is one of the B running for its
        # prompt's steps and its O-1 decode steps (vLLM's max_num_seqs counts it from its prompt's step;
        # counted from its first decode, the model had an engine of one sequence at 12.1 requests/s where
        # vLLM's CPU engine completed 9.9-10.1 with its prompt's step and 31 decodes taking 100 ms)
        k = B / (self.O_run - 1.0 + np.maximum(1.0, Pw / cmax))
        rho_p = k * Pw / cmax
        # Prompt tokens of a prompt-carrying step: the prompts that arrived together, or, while
        # prompts are backlogged (probability rho_p: an arrival finds the prompt stage busy), the
        # whole leftover budget (decode-first scheduling fills it).
        light = np.minimum(cmax, Pw * np.maximum(1.0, k))
        cbusy = light + np.clip(rho_p, 0.0, 1.0) * (cmax - light)
        f = np.minimum(1.0, k * Pw / cbusy)
        T0 = self.iteration(B, np.zeros_like(B))
        T1 = self.iteration(B, cbusy)
        t = f * T1 + (1.0 - f) * T0
        return dict(B=B, k=k, pre=pre, Pw=Pw, cmax=cmax, cbusy=cbusy, f=f, T0=T0, T1=T1, t=t, lam=k / t, rho_p=rho_p)

    # ------------------------------------------------------------------------------------------
    def capacity(self) -> None:
        cap = self.state(self.B_cap)
        self.cap = cap
        self.mu = cap["lam"]
        svc = self.prompt_time(cap, self.P_eff)
        self.S_cap = self.api + cap["t"] / 2.0 + svc + self.O_dec * cap["t"]

    def prompt_time(self, st: dict, P_tokens: Any) -> np.ndarray:
        """Iterations a prompt of P_tokens computed tokens takes once admitted, alone with the B
        decoding sequences (the prompts that ride with it are the prompt stage's queue's)."""
        c = np.maximum(np.minimum(P_tokens, st["cmax"]), 1e-3)
        return self.iteration(st["B"], c) * np.maximum(1.0, P_tokens / st["cmax"])

    def itl_quantile(self, st: dict, sq: dict, q: float, lam: np.ndarray) -> np.ndarray:
        """ITL's q-quantile at the mean state ``st`` (the share of steps that carry prompts), its steps
        at the running count's q-quantile ``sq``, and the admitted rate ``lam``: a decoding sequence's gap
        is a decode-only step (a share 1 - f of them) or a prompt-carrying one, which carries the
        prompts that arrived during the step before (a Poisson count of mean lam t, at least one), each
        of the traffic's lengths. Above 1 - f the quantile is that step's at the conditional level: the
        count's quantile times the mean prompt, or one prompt's own quantile where that is longer, held
        at the budget. Taken as the mean prompt-carrying step, ITL's p99 read 0.52-0.67x a replay of
        vLLM's scheduler from half its capacity up (benchmarks/serving_queue_vs_scheduler.py)."""
        f = st["f"]  # at the running count's quantile the share of prompt steps overstates the mean's
        level = np.clip((q - 1.0 + f) / np.maximum(f, 1e-12), 0.0, 1.0 - 1e-9)
        carrying = level > 0.0
        # prompts arriving during a step, more while they queue: a prompt step's share of the time
        # lengthens the stretches of back-to-back prompt steps over which they gather
        busy = np.minimum(st["f"] * st["T1"] / np.maximum(st["t"], 1e-12), RHO_MAX)
        m, level = np.broadcast_arrays(np.maximum(lam * st["t"] / (1.0 - busy), 1e-9), level)
        none = np.exp(-m)
        target = none + level * (1.0 - none)  # the count's CDF level, given at least one prompt
        # one prompt up to P(N <= 1); scipy's Poisson quantile (slow: it searched every (config, rate) and
        # was half the pricing time) only where the level asks for more
        count = np.ones_like(m)
        more = (level > 0.0) & (target > none * (1.0 + m))
        count[more] = np.maximum(poisson.ppf(target[more], m[more]), 1.0)
        prompt = self.tr.prompt
        own = np.quantile(np.asarray(prompt.values), np.where(carrying, level, 0.5))
        own = own - np.where(self.caching, np.minimum(self.cached, own), 0.0)
        tokens = np.clip(np.maximum(count * self.P_eff, own), 1e-3, sq["cmax"])
        step = self.iteration(sq["B"], tokens)
        return np.where(carrying, np.maximum(step, sq["T0"]), sq["T0"])

    def prompt_stalls(self, st: dict, lam: np.ndarray) -> dict[str, np.ndarray]:
        """How the prompts that arrive while a request decodes spread its TPOT (s a token): each
        stalls its O-1 steps by its share of a prompt-carrying step beyond a decode step, and the
        stalls lengthen the request's decode, during which more prompts arrive. The count is Poisson
        (the arrivals over the decode, lambda (O-1) t), each prompt's cost in proportion to its
        length (1 + cv_prompt^2), amplified by 1 / (1 - lambda x a prompt's cost) for that feedback.
        Counted over the decode's steps as Bernoulli trials (f of them carrying prompts) instead, the
        spread was 0.6x and TPOT's p99 read 0.76-0.84x a replay of vLLM's scheduler near capacity
        (benchmarks/serving_queue_vs_scheduler.py)."""
        per_prompt = np.maximum(st["T1"] - st["T0"], 0.0) * st["Pw"] / st["cbusy"]
        arrivals = lam * self.O_dec * st["t"]
        feedback = 1.0 / (1.0 - np.minimum(lam * per_prompt, RHO_MAX))
        sd = np.sqrt(arrivals * (1.0 + self.tr.prompt.cv2)) * per_prompt * feedback / self.O_dec
        return {"sd": sd, "mean_count": arrivals}

    def prompt_stage_waits(self, st: dict, lam: np.ndarray, t_one: np.ndarray, vp: float) -> dict[str, np.ndarray]:
        """What the prompt stage adds to TTFT beyond a prompt's own step (mean and quantiles, s): the
        steps that carry prompts batch every prompt waiting, up to the budget left beside the B
        decodes, so the stage is the prefill pool's batch-service queue (:mod:`._prefill_queue`, a
        table of vLLM's scheduler's runs) with steps T(B, n P_eff); an arrival it keeps waiting waits
        the prompt step in progress, then the prompts ahead. Scaled as Kingman's wait for burstier
        arrivals and unequal prompts, held at what the load window can build."""
        n_max = st["cmax"] / self.P_eff
        t_max = self.iteration(st["B"], np.maximum(st["cmax"], self.P_eff))
        return batch_queue_waits(lam, t_one, np.maximum(t_max, t_one), n_max, vp, self.tr.duration)

    def evaluate(self, B: np.ndarray, lam: np.ndarray) -> dict[str, np.ndarray]:
        """Latency quantiles (seconds) and load figures at running concurrency B (<= B_cap) under
        an offered rate lam per replica (lam > mu: overloaded, B = B_cap)."""
        tr = self.tr
        over = lam >= self.mu
        st = self.state(B, over)
        rho = lam / self.mu
        rc = np.minimum(rho, RHO_MAX)
        c = self.B_cap
        v = (tr.ca2 + tr.output.cv2) / 2.0
        # Probability of waiting: rho for Poisson arrivals (PASTA), higher for burstier ones
        # (exponent 2 / (1 + ca^2)); the mean wait stays Sakasegawa's / Kingman's, so the
        # conditional (exponential) wait is the mean over that probability.
        burst = 2.0 / (1.0 + tr.ca2)
        base_svc = self.prompt_time(st, self.P_eff)
        # The slots are as busy as the running count says (B of c) and each is held for a request's
        # time at this load, not at capacity: at light load a request holds its slot for its own few
        # steps (on vLLM's CPU engine at 2 req/s, 8 slots and 0.5 running: the wait for one at
        # capacity's pace had put TTFT's p99 at 794 ms against the engine's 218). At capacity both
        # are the capacity's.
        held = self.api + st["t"] / 2.0 + base_svc + self.O_dec * st["t"]
        busy = np.where(over, rc, np.minimum(B / c, rc))
        pw_slot, scale_slot = slot_wait(busy, c, held, v, burst)
        scale_slot = within_window(pw_slot, scale_slot, window_wait(rho, self.mu, v, tr.duration))
        backlog = overload_backlog(rho, tr.duration)
        vp = (tr.ca2 + tr.prompt.cv2) / 2.0
        admitted = np.minimum(lam, self.mu)  # what reaches the engine's steps; the rest waits for a slot
        pf_wait = self.prompt_stage_waits(st, admitted, base_svc, vp)
        # an arrival the prompt stage does not keep waiting lands in a decode step (uniformly)
        fixed = self.api + st["T0"] / 2.0
        out: dict[str, np.ndarray] = {}
        out["ttft_mean"] = fixed + base_svc + pf_wait["mean"] + np.hypot(pw_slot * scale_slot, 0.5 * backlog)
        var_B = (1.0 + tr.ca2) / 2.0
        t_min = self.iteration(np.zeros_like(B), np.zeros_like(B))
        stalls = self.prompt_stalls(st, admitted)
        for q in LEVELS:
            z = _Z[q]
            w_slot = np.hypot(wait_quantile(pw_slot, scale_slot, q), q * backlog)
            w_pf = pf_wait[f"{q:g}"]
            cached_q = np.where(self.caching, np.minimum(self.cached, tr.prompt.q(q)), 0.0)
            P_q = np.maximum(tr.prompt.q(q) - cached_q, 1.0)
            svc_q = self.prompt_time(st, P_q)
            fixed_q = self.api + q * st["T0"]
            ttft = fixed_q + base_svc + np.sqrt((svc_q - base_svc) ** 2 + w_pf**2 + w_slot**2)
            if q < 0.5:
                ttft = fixed_q + svc_q  # the lucky: no wait, a short prompt
            # running concurrency at its q-quantile, and the iteration then
            Bq = np.clip(B + z * np.sqrt(np.maximum(B, 0.0) * var_B), 0.0, self.B_cap)
            Bq = np.where(over, self.B_cap, Bq)
            sq = self.state(Bq, over) if z != 0.0 else st
            # a request's TPOT moves with the running count (the step at Bq) and with how many
            # prompts stall its steps (those arriving during its decode: prompt_stalls): two sources, so their
            # quantile offsets add as a root sum of squares (as E2E's do), not one on top of the other
            # (that put the p99 at two quantiles at once: 32.5 ms against vLLM's 14-24 on this CPU)
            spread = np.sqrt((sq["t"] - st["t"]) ** 2 + (stall_z(z, stalls) * stalls["sd"]) ** 2)
            tpot = np.maximum(st["t"] + np.sign(z) * spread, t_min)
            itl = self.itl_quantile(st, sq, q, admitted)
            tag = f"{q:g}"
            out[f"ttft_{tag}"], out[f"tpot_{tag}"], out[f"itl_{tag}"] = ttft, tpot, itl
            out[f"e2e_{tag}"] = self.e2e_quantile(ttft, out["ttft_mean"], tpot, st["t"], q)
        out["tpot_mean"] = st["t"]
        out["e2e_mean"] = out["ttft_mean"] + self.O_dec * st["t"]
        out["kv_cache_usage"] = self.kv_cache_usage(B, over)
        out["preempted_per_request"] = st["pre"]
        out["rho"] = rho
        out["B"] = B
        return out

    # ------------------------------------------------------------------------------------------
    def e2e_quantile(self, ttft: np.ndarray, ttft_mean: np.ndarray, tpot: np.ndarray, t: np.ndarray, q: float):
        """E2E at quantile q: TTFT + (O-1) TPOT around the mean, the tails of TTFT, of the output
        length and of TPOT added as a root sum of squares; never below the TTFT."""
        mid = ttft_mean + self.O_dec * t
        e2e = mid + np.sign(_Z[q]) * np.sqrt(
            (ttft - ttft_mean) ** 2
            + ((max(self.tr.output.q(q) - 1.0, 0.0) - self.O_dec) * t) ** 2
            + (self.O_dec * (tpot - t)) ** 2
        )
        return np.maximum(e2e, ttft)

    def prefix_hit_rate(self) -> np.ndarray:
        """The share of prompt tokens the prefix cache serves (the whole blocks of the shared prefix;
        0 with caching off), as vLLM's prefix_cache_hits over prefix_cache_queries counts them."""
        return (np.where(self.caching, self.cached, 0.0) / max(self.P, 1.0))[:, 0]

    def kv_cache_usage(self, B: np.ndarray, overloaded: Any) -> np.ndarray:
        """The KV cache's use at the run's high-water mark: the running concurrency's mean + 3 sd
        (variance B (1 + ca^2)/2), up to the admission ceiling (at it, overloaded)."""
        var_B = (1.0 + self.tr.ca2) / 2.0
        hi = np.where(overloaded, self.B_adm, np.minimum(self.B_adm, B + 3.0 * np.sqrt(np.maximum(B, 0.0) * var_B)))
        shared_tok = np.where(self.caching, self.cached, 0.0)
        return np.clip((hi * self.tok_seq + shared_tok) / np.maximum(self.kv_tokens, 1.0), 0.0, 1.0)

    def concurrency_at(self, lam: np.ndarray, grid_B: np.ndarray, grid_lam: np.ndarray) -> np.ndarray:
        """Running concurrency at offered rates lam (N, K) per replica: :func:`concurrency_at`."""
        return concurrency_at(lam, grid_B, grid_lam, self.mu, self.B_cap)


def slot_wait(rho: np.ndarray, c: np.ndarray, S: np.ndarray, v: float, burst: float):
    """The wait for one of c running slots each held S (G/G/c): (P_w, the conditional wait's mean).
    Sakasegawa's mean wait v rho^(sqrt(2(c+1)) - 1) S / (c (1 - rho)); a request waits with that
    power of rho raised to ``burst`` (2 / (1 + ca^2): rho for Poisson arrivals, PASTA; higher for
    burstier ones), and then an exponential time of the mean over that probability."""
    with np.errstate(divide="ignore", invalid="ignore"):
        sak = np.where(rho > 0, rho ** (np.sqrt(2.0 * (c + 1.0)) - 1.0), 0.0)
        pw = sak**burst
        return pw, np.where(sak > 0, v * sak / np.maximum(pw, 1e-300), 0.0) * S / (c * (1.0 - rho))


def window_wait(rho: np.ndarray, rate: np.ndarray, v: float, duration: float) -> np.ndarray:
    """The mean wait (s) that a load window of ``duration`` seconds can build from the arrivals' and
    the services' fluctuations alone, at utilisation rho of a stage serving ``rate`` jobs/s: the
    queue a window starts empty is a reflected random walk of variance 2 v rho rate jobs^2 a second
    (lambda (ca^2 + cs^2)), whose mean after t seconds is sigma sqrt(2 t / pi); an arrival lands
    uniformly in the window (2/3 of the end's), and waits that queue over the rate.

    The steady-state formulas (Sakasegawa's, Kingman's) diverge as rho -> 1 and were held at
    :data:`RHO_MAX`, which put the slot wait at 100 times a request's time: on vLLM's CPU engine at
    4 requests/s for 6 s (twice its capacity) a wait of 26-41 s where the engine's whole TTFT p50 was
    2.8-3.8 s. A finite window cannot build more than this."""
    r = np.maximum(np.asarray(rho, dtype=float), 0.0)
    rate = np.maximum(rate, 1e-12)
    return (2.0 / 3.0) * np.sqrt(2.0 * v * r * rate * 2.0 * duration / np.pi) / rate


def within_window(pw: np.ndarray, scale: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """A wait's conditional mean ``scale`` held so that its mean (pw x scale) is at most ``cap``."""
    return np.minimum(scale, cap / np.maximum(pw, 1e-300))


def overload_backlog(rho: np.ndarray, duration: float) -> np.ndarray:
    """Seconds the last arrival of a window of ``duration`` waits beyond capacity (rho > 1): the queue
    grows at lambda - mu and drains at mu, so an arrival at x duration waits (rho - 1) x duration
    (the q-th arrival q of this). It adds to the steady part as a root sum of squares (a random walk
    with drift: the drift's mean once it dominates, the fluctuation's near rho = 1)."""
    return np.maximum(rho - 1.0, 0.0) * duration


def batch_queue_waits(
    lam: np.ndarray, t_one: np.ndarray, t_max: np.ndarray, n_max: np.ndarray, v: float, duration: float
) -> dict[str, np.ndarray]:
    """What a stage whose steps take every prompt waiting, up to n_max (a step of one prompt
    ``t_one``, of n_max ``t_max``), adds to TTFT beyond a prompt's own step at ``lam`` prompts/s (mean
    and quantiles, s; keys as :data:`._prefill_queue.FIGURES`): the table of vLLM's scheduler's runs
    (:func:`._prefill_queue.prefill_ttft`), scaled from its Poisson arrivals of equal prompts (v = 1/2)
    to ``v`` as Kingman's wait is, held at what a load window of ``duration`` s can build. The
    disaggregated prefill pool's queue and the aggregated engine's prompt stage."""
    pf = prefill_ttft(lam, t_one, t_max, n_max)
    waits = {f: (pf[f] - t_one) * (v / 0.5) for f in pf}
    mu = np.maximum(n_max, 1.0) / np.maximum(t_max, t_one)  # prompts/s at capacity
    held = np.minimum(1.0, window_wait(lam / mu, mu, v, duration) / np.maximum(waits["mean"], 1e-12))
    return {f: w * held for f, w in waits.items()}


def stall_z(z: float, stalls: dict[str, np.ndarray]) -> np.ndarray:
    """The standard normal quantile z moved by Cornish-Fisher's skew term for a Poisson count of mean
    ``stalls['mean_count']`` (skewness 1 / sqrt(mean), held at :data:`STALL_SKEW_MAX`): a request meets
    few prompts (OPT-13B on an A100 at 6 req/s: about 10), so their count's upper tail is longer than a
    normal's."""
    if z <= 0.0:
        return np.full_like(stalls["mean_count"], z)
    with np.errstate(divide="ignore"):
        skew = np.minimum(1.0 / np.sqrt(np.maximum(stalls["mean_count"], 1e-300)), STALL_SKEW_MAX)
    return z + (z * z - 1.0) * skew / 6.0


def wait_quantile(pw: np.ndarray, scale: np.ndarray, q: float) -> np.ndarray:
    """The q-quantile of a wait that happens with probability pw, exponential of mean scale then."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.maximum(0.0, np.log(np.maximum(pw, 1e-300) / (1.0 - q))) * scale


def batch_figures(
    out: dict,
    b: int,
    ttft: np.ndarray,
    t100: np.ndarray,
    t_all: np.ndarray,
    eng: "Engine",
    first_ttft: np.ndarray | None = None,
) -> None:
    """A closed-loop batch of b requests, its TTFT (s) and the decode steps it then runs (one with
    100 more tokens of context, one at the mean): the probe's batch figures, into ``out``.

    The probe's time for 100 tokens is the last of the batch's TTFT + 99 x TPOT
    (``objectives.serving.batch_summary``), and that is the request served first, not the last: its
    decode stalls while the rest of the batch is prefilled (``first_ttft`` to ``ttft``), and its TPOT
    spreads that stall over its output. On vLLM's CPU engine at 512-token prompts, 8 at once, the
    probe read 15.0 s where the last request's own figure was 6.9 s; priced as the last one, the
    calibration fitted a decode step of 108 ms to an engine whose step took 25 ms."""
    out[f"batch{b}_ttft_ms"] = (ttft * 1e3)[:, 0]
    last = ttft + 99.0 * t100
    if first_ttft is not None:
        stall = np.maximum(ttft - first_ttft, 0.0)
        last = np.maximum(last, first_ttft + 99.0 * (stall + eng.O_dec * t100) / eng.O_dec)
    out[f"batch{b}_time_for_100_tokens_s"] = last[:, 0]
    out[f"batch{b}_output_tokens_per_s"] = (b * eng.O / (ttft + eng.O_dec * t_all))[:, 0]


def concurrency_at(
    lam: np.ndarray, grid_B: np.ndarray, grid_lam: np.ndarray, mu: np.ndarray, B_cap: np.ndarray
) -> np.ndarray:
    """Running concurrency at offered rates lam (N, K), by log-log interpolation of the grid's
    lambda(B) (monotone); B_cap at and beyond the capacity mu."""
    lg = np.maximum.accumulate(grid_lam, axis=1)
    idx = (lg[:, None, :] <= lam[:, :, None]).sum(axis=2)  # (N, K): grid points below
    G = lg.shape[1]
    lo = np.clip(idx - 1, 0, G - 2)
    hi = lo + 1
    take = lambda a, i: np.take_along_axis(a, i, axis=1)  # noqa: E731
    l0, l1, b0, b1 = take(lg, lo), take(lg, hi), take(grid_B, lo), take(grid_B, hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.clip(np.log(np.maximum(lam, 1e-300) / l0) / np.log(np.maximum(l1 / l0, 1.0 + 1e-12)), 0.0, 1.0)
        B = np.exp(np.log(b0) + w * (np.log(b1) - np.log(b0)))
    B = np.where(lam < lg[:, :1], grid_B[:, :1] * lam / lg[:, :1], B)
    return np.where(lam >= mu, B_cap, np.minimum(B, B_cap))


def _attainment(qs: dict[str, np.ndarray], metric: str, target: float) -> np.ndarray:
    """The quantile level at which ``metric`` reaches ``target`` (piecewise linear in
    -log10(1 - q) between the priced levels): the share of requests meeting it."""
    ys = [-math.log10(1.0 - q) for q in LEVELS]
    xs = [qs[f"{metric}_{q:g}"] for q in LEVELS]
    att = np.where(target >= xs[-1], 1.0, 0.0)
    for i in range(len(LEVELS) - 1):
        x0, x1 = xs[i], xs[i + 1]
        inside = (target >= x0) & (target < x1)
        w = np.clip((target - x0) / np.maximum(x1 - x0, 1e-15), 0.0, 1.0)
        y = ys[i] + w * (ys[i + 1] - ys[i])
        att = np.where(inside, 1.0 - 10.0 ** (-y), att)
    return att


def _verdict(qs: dict[str, np.ndarray], tr: Traffic) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(SLO met, attainment, worst p99 / target ratio) of priced quantiles."""
    shape = qs["ttft_0.99"].shape
    met = np.ones(shape, bool)
    att = np.ones(shape)
    margin = np.zeros(shape)
    for m in SLO_METRICS:
        target = tr.slo[f"{m}_p99_ms"]
        if target is None:
            continue
        x = qs[f"{m}_0.99"] * 1e3
        met &= x <= target
        margin = np.maximum(margin, x / max(target, 1e-9))
        if m != "itl":  # a request's own TTFT, TPOT, E2E decide whether it is good
            att = np.minimum(att, _attainment(qs, m, target / 1e3))
    return met, att, margin


def priced_aggregated(s: Shape, hw: HW, c: dict, tr: Traffic) -> dict[str, Any]:
    """An aggregated deployment (``replicas`` engines each running both phases) priced: the SLO
    curve on the concurrency grid, the quantiles at the traffic's rates, capacity, memory, devices
    and the closed-loop batches, every rate a system rate (all replicas together)."""
    eng = Engine(s, hw, c, tr)
    mem = eng.memory()
    eng.caps(mem["kv_tokens"])
    eng.capacity()
    R = eng.r
    grid_B = eng.B_cap * GRID[None, :]
    grid_lam = eng.state(grid_B)["lam"]
    rates = np.broadcast_to(tr.rates[None, :], (eng.n, tr.rates.size))
    lam = rates / R
    return {
        "grid_rate": grid_lam * R,
        "grid": eng.evaluate(grid_B, grid_lam),
        "at_rates": eng.evaluate(eng.concurrency_at(lam, grid_B, grid_lam), lam),
        "capacity": (eng.mu * R)[:, 0],
        "devices": (R * eng.t * eng.p)[:, 0],
        "max_concurrency": eng.B_cap[:, 0],
        "prefix_cache_hit_rate": eng.prefix_hit_rate(),
        "mem": mem,
        "closed_loop": _closed_loop(eng, tr),
    }


def _closed_loop(eng: Engine, tr: Traffic) -> dict[str, np.ndarray]:
    """b requests sent at once (the traffic's mean lengths), spread over the replicas: the
    batch's prefill in token-budget chunks (the last first token is the batch's TTFT, as
    ``objectives.serving.batch_summary`` reports it), then decode steps of the batch. The first
    request reaches an idle engine alone and gets its first token from a step of its own prompt;
    the others, arriving while that step runs, are prefilled together in the steps after it (beside
    the first one's decode), and its decode waits for them (:func:`batch_figures`). vLLM's CPU engine
    read so at 192-512-token prompts: of 8 sent at once, one first token at 16-23 ms, the other seven
    together at 112-260 ms."""
    out: dict[str, np.ndarray] = {}
    chunk = np.where(eng.chunked, eng.mbt, np.maximum(np.floor(eng.mbt / eng.P_eff), 1.0) * eng.P_eff)
    zero = np.zeros_like(eng.mns)

    def prefill(tokens: np.ndarray, decoding: np.ndarray) -> np.ndarray:
        """Seconds of the steps that compute ``tokens`` prompt tokens in token-budget chunks beside
        ``decoding`` decoding sequences."""
        return eng.iteration(decoding, np.minimum(chunk, tokens)) * np.maximum(1.0, tokens / chunk)

    first = eng.api + prefill(eng.P_eff, zero)  # the request served first: its own prompt alone
    one = np.ones_like(eng.mns)
    for b in tr.batch_sweep:
        br = np.minimum(np.ceil(b / eng.r), eng.mns)
        t100 = eng.iteration(br, zero, eng.P + 50.0)
        rest = np.maximum(br - 1.0, 0.0) * eng.P_eff  # the others' prompts, in the steps after the first's
        ttft = np.where(br > 1.0, first + prefill(rest, one), first)
        batch_figures(out, b, ttft, t100, eng.iteration(br, zero), eng, first_ttft=first)
    return out
