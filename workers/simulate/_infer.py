"""Inference: prefill is compute-bound (the whole prompt batch through the GEMMs), decode is
memory-bound (every step streams the weights and the KV cache once), both with the
tensor-parallel all-reduces; the layers of a pipeline run one after another for one batch.

Weights: compute dtype, int8 / w8a8 1 B, int4 0.5 B plus fp16 group scales (group 128); the
embedding and the output layer stay in the compute dtype. w8a8 runs its GEMMs at the int8 peak;
weight-only schemes dequantise to the compute dtype and run at its peak.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from autotune.objectives import infer_headline

from ._common import GIB, HW, Shape, allreduce, gemm_time, group_bandwidth
from ._memory import fragmentation_fraction


def infer_points(s: Shape, hw: HW, c: dict, workload: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every config at each of the workload's batch sizes (measurement points, not a knob): the
    per-batch figures, the headline ones (:func:`autotune.objectives.infer_headline`: latency at the
    smallest batch, per-instance and per-device throughput at the largest) and the memory and time
    breakdowns of the largest batch, the peak. A config that names its own ``batch_size`` (a column
    above 0) is priced at that batch alone, as before the points."""
    if np.any(c["batch_size"] > 0):
        out = infer(s, hw, c, workload)
        out["decode_tokens_per_s_per_device"] = out["decode_tokens_per_s"] / np.maximum(c["tp"] * c["pp"], 1.0)
        return out
    sizes = sorted({int(b) for b in workload.get("batch_sizes") or [1]})
    per = {b: infer(s, hw, {**c, "batch_size": np.full(c["tp"].shape, float(b))}, workload) for b in sizes}
    out = dict(per[sizes[-1]])
    out.update(infer_headline(per, np.maximum(c["tp"] * c["pp"], 1.0), workload))
    return out


# Kernels per layer and decode step (norms, rope, attention, GEMMs, activation, residuals).
DECODE_OPS = 14


def infer(s: Shape, hw: HW, c: dict, workload: Mapping[str, Any]) -> dict[str, np.ndarray]:
    prompt = float(workload["prompt_len"])
    gen = float(workload.get("gen_len", 128))
    t, p, prec = c["tp"], c["pp"], c["precision"]
    batch = np.maximum(c["batch_size"], 1.0)
    e = np.where(prec == 2, 4.0, 2.0)
    q = c["quantization"]
    wq = np.select([q == 1, q == 2, q == 3], [1.0, 1.0, 0.5 + 2.0 / 128.0], default=e)
    peak = np.where(q == 2, hw.peak.get("int8", 2.0 * hw.peak["bf16"]), hw.peak_of(prec))
    layers = s.layers / p
    kv_dev = np.maximum(s.kv_heads / t, 1.0)  # K/V heads on one rank (replicated when tp > kv)
    kv_tok = 2.0 * layers * kv_dev * s.head_dim * c["kv_cache_bytes"]  # bytes per token per device

    # --- memory (the first stage holds the embedding; with pp = 1 it is also the last) -----------
    mm = s.h * s.qkv_out + s.h * s.h + (3.0 if s.arch == "llama" else 2.0) * s.h * s.ffn
    embed = s.vocab * s.h / t
    out_layer = 0.0 if s.tied else embed
    weights = layers * mm / t * wq + (embed + np.where(p == 1, out_layer, 0.0)) * e
    tokens = batch * (prompt + gen)
    kv_cache = tokens * kv_tok
    # Prefill working set of one layer: hidden states, QKV and the MLP intermediate.
    acts = batch * prompt * (2.0 * s.h + s.qkv_out / t + s.mlp_in_out / t) * e
    logits = batch * s.vocab / t * 4.0  # last position only, fp32
    n_comm = (t > 1) * 1.0 + (p > 1) + (c["world"] > 1)
    per_comm = 2.0 * c["hccl_buffsize_mb"] * 2.0**20 if hw.hccl else hw.comm_mib * 2.0**20
    comm = n_comm * per_comm
    frag = (acts + kv_cache + logits) * fragmentation_fraction(hw, c)
    mem = {
        "weights": weights,
        "kv_cache": kv_cache,
        "activations": acts,
        "logits": logits,
        "comm_buffers": comm * np.ones_like(t),
        "runtime_reserve": np.full_like(t, hw.reserve),
        "fragmentation": frag,
    }

    # --- prefill ----------------------------------------------------------------------------------
    rows = batch * prompt
    shapes = ((s.h, s.qkv_out / t), (s.h / t, s.h), (s.h, s.mlp_in_out / t), (s.ffn / t, s.h))
    pre_gemm = sum(gemm_time(hw, peak, rows, k, n, e, wq) for k, n in shapes)
    pre_attn = 4.0 * rows * prompt * s.h / t * 0.5 / (hw.peak_of(prec) * hw.fa_eff)
    pre_ew = (12.0 * s.h + 3.0 * s.ffn / t) * rows * e / hw.bw
    act = rows * s.h * e
    bw_ar = group_bandwidth(hw, t, np.ones_like(t), hw.ar_eff)
    pre_tp = 2.0 * allreduce(act, t, bw_ar, hw.tp_alpha)
    p2p_bw = np.where(c["world"] > hw.dpn, hw.inter, hw.intra * hw.ag_eff)
    pre_p2p = (p - 1.0) * (act / p2p_bw + hw.alpha)
    head = gemm_time(hw, hw.peak_of(prec), batch, s.h, s.vocab / t, e)
    prefill = s.layers * (pre_gemm + pre_attn + pre_ew + pre_tp) + pre_p2p + head

    # --- decode step (all pipeline stages in sequence for one batch) --------------------------------
    host_scale = np.where(c["compile"] >= 1, 0.25, 1.0)  # graph capture removes most launches

    def step(ctx: float) -> tuple[np.ndarray, ...]:
        g = sum(gemm_time(hw, peak, batch, k, n, e, wq) for k, n in shapes)
        attn = batch * ctx * kv_tok / layers / hw.bw
        ew = (12.0 * s.h + 3.0 * s.ffn / t) * batch * e / hw.bw
        tp = 2.0 * allreduce(batch * s.h * e, t, bw_ar, hw.tp_alpha)
        device = g + attn + ew
        host = DECODE_OPS * hw.launch * host_scale
        per_layer = np.maximum(device, host) + tp
        total = s.layers * per_layer + (p - 1.0) * (batch * s.h * e / p2p_bw + hw.alpha) + head
        return total, s.layers * g, s.layers * attn, s.layers * tp

    dec, dec_gemm, dec_attn, dec_tp = step(prompt + gen / 2.0)
    first100 = step(prompt + 50.0)[0]
    out = {f"mem_{k}": v / GIB for k, v in mem.items()}
    out.update(
        ttft_ms=prefill * 1e3,
        decode_tokens_per_s=batch / dec,
        time_for_100_tokens_s=prefill + 100.0 * first100,
        time_prefill=prefill,
        time_decode_step=dec,
        time_decode_gemm=dec_gemm,
        time_decode_attention=dec_attn,
        time_decode_tp_comm=dec_tp,
    )
    out["peak_memory_gib"] = sum(mem.values()) / GIB
    return out
