"""Training time of one optimizer step.

Per layer and micro-batch: GEMMs from the per-device shapes through the roofline of
``_common.gemm_time`` (forward, then dgrad and wgrad in backward), attention (flash: executed
causal FLOPs at the flash-attention efficiency, backward 2.5x forward; otherwise Megatron's
batched QK^T / AV GEMMs over the full s x s plus memory-bound softmax and dropout), memory-bound
elementwise work, recomputation, and the tensor-parallel collectives on the critical path.
The pipeline runs m micro-batches at the pace of its slowest stage, plus the 1F1B bubble
(pp-1)/vpp stage-times, point-to-point transfers, the exposed part of the data-parallel gradient
reduction, ZeRO-3 gathers and the optimizer step.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ._common import HW, Shape, allgather, allreduce, gemm_time, group_bandwidth
from ..parameters import reference_dp, stage_layers
from ._memory import has_dropout, state_bytes_per_param

# Fraction of a collective that hides behind compute when the framework overlaps them (bucketed
# gradient reduction, FSDP prefetch): the last bucket and the first gather are always exposed,
# and overlapped communication competes with compute for memory bandwidth.
OVERLAP = 0.85
# Kernels of one layer's forward when run eagerly (4 GEMMs, attention, ~10 elementwise); the
# backward launches about twice as many. Launches overlap device work, so they cost time only
# where the host issues them slower than the device runs them (small layers, eager NPU dispatch).
FWD_KERNELS = 15
# the step-time terms that are communication (exposed: what overlap did not hide)
COMM_TERMS = ("tp_comm", "cp_comm", "pp_p2p", "dp_comm", "zero3_comm")


def _elementwise_scale(c: dict) -> np.ndarray:
    """torch.compile fuses elementwise chains (norm, activation, residual): about 25 % less
    traffic in default mode, 35 % with max-autotune; MindSpore graph-kernel fusion about 20 %.
    Small, documented effects; the GEMMs are unchanged."""
    scale = np.where(c["compile"] >= 2, 0.65, np.where(c["compile"] >= 1, 0.75, 1.0))
    return scale * np.where(c["graph_kernel"], 0.8, 1.0)


def train_time(
    s: Shape, hw: HW, c: dict, workload: Mapping[str, Any], params_stage: np.ndarray
) -> dict[str, np.ndarray]:
    seq = float(workload["seq_len"])
    flash = bool(workload.get("flash_attention", True))
    t, p, v, m, cp = c["tp"], c["pp"], c["vpp"], c["grad_accum"], c["cp"]
    d, b, sp, prec = c["dp"], c["micro_batch_size"], c["sp"], c["precision"]
    e = np.where(prec == 2, 4.0, 2.0)
    peak = hw.peak_of(prec)
    tok = b * seq / cp  # GEMM rows of one micro-batch on one device (after the SP all-gather)
    sq = seq / cp  # query length per device
    layers = s.layers / p  # the mean over the stages (the data-parallel overlap's window)

    # --- GEMMs of one layer: (K, N) of the forward, M = tok -------------------------------------
    shapes = ((s.h, s.qkv_out / t), (s.h / t, s.h), (s.h, s.mlp_in_out / t), (s.ffn / t, s.h))
    g_fwd = sum(gemm_time(hw, peak, tok, k, n, e) for k, n in shapes)
    g_bwd = sum(gemm_time(hw, peak, tok, n, k, e) + gemm_time(hw, peak, k, tok, n, e) for k, n in shapes)

    # --- attention core ---------------------------------------------------------------------------
    if flash:
        # Executed FLOPs of causal flash attention: QK^T and AV over the lower triangle.
        f_fwd = 4.0 * tok * seq * s.h / t * 0.5
        a_fwd = f_fwd / (peak * hw.fa_eff)
        a_bwd = 2.5 * f_fwd / (peak * hw.fa_eff)  # 5 matmuls against 2
        sm_fwd = np.zeros_like(tok)
    else:
        batch = b * s.heads / t
        hd = s.head_dim
        a_fwd = gemm_time(hw, peak, sq, hd, seq, e, batch=batch) + gemm_time(hw, peak, sq, seq, hd, e, batch=batch)
        a_bwd = (
            gemm_time(hw, peak, sq, seq, hd, e, batch=batch)
            + gemm_time(hw, peak, seq, sq, hd, e, batch=batch)
            + gemm_time(hw, peak, sq, hd, seq, e, batch=batch)
            + gemm_time(hw, peak, seq, sq, hd, e, batch=batch)
        )
        # Fused scale-mask-softmax reads and writes the scores; GPT adds dropout (read, write, mask).
        sm_elems = (4.5 if has_dropout(s, workload) else 2.0) * b * s.heads / t * sq * seq
        sm_fwd = sm_elems * e / hw.bw

    # --- elementwise (memory-bound) ---------------------------------------------------------------
    rep = np.where(sp, tok / t, tok)  # width of the non-TP-sharded part
    if s.arch == "llama":
        # 2 RMSNorms (read+write), 2 residual adds (2 reads, 1 write), RoPE on q and k, SwiGLU.
        elems = 10.0 * s.h * rep + 2.0 * (s.h + s.kv_heads * s.head_dim) * tok / t + 3.0 * s.ffn * tok / t
    else:
        # 2 LayerNorms, 2 bias-dropout-adds (3 tensors + a 1-byte mask), bias-GeLU.
        elems = (11.0 if has_dropout(s, workload) else 10.0) * s.h * rep + 2.0 * s.ffn * tok / t
    scale = _elementwise_scale(c)
    ew_fwd = (elems * e / hw.bw) * scale + sm_fwd
    ew_bwd = 2.0 * ew_fwd
    host_scale = np.where(c["compile"] >= 1, 0.3, 1.0) * np.where(c["graph_kernel"], 0.3, 1.0)
    host_fwd = FWD_KERNELS * hw.launch * host_scale
    launch_fwd = np.maximum(host_fwd - (g_fwd + a_fwd + ew_fwd), 0.0)
    launch_bwd = np.maximum(2.0 * host_fwd - (g_bwd + a_bwd + ew_bwd), 0.0)

    # --- tensor-parallel collectives (not overlapped: Megatron's default) -------------------------
    act = tok * s.h * e  # one micro-batch's hidden states, gathered
    bw_ar = group_bandwidth(hw, t, np.ones_like(t), hw.ar_eff)
    bw_ag = group_bandwidth(hw, t, np.ones_like(t), hw.ag_eff)
    # Latency in a layer step (tp_alpha): calibrated hosts measure dispatch and rank skew there.
    ag, rs, ar = (
        allgather(act, t, bw_ag, hw.tp_alpha),
        allgather(act, t, bw_ar, hw.tp_alpha),
        allreduce(act, t, bw_ar, hw.tp_alpha),
    )
    # Sequence parallel: AG before and RS after each of the two blocks, in both directions
    # (the backward re-gather of the input for wgrad overlaps the dgrad GEMM and is not counted).
    tp_fwd = np.where(sp, 2.0 * (ag + rs), 2.0 * ar)
    tp_bwd = tp_fwd

    # --- context parallel: ring exchange of K,V chunks, hidden behind the attention -----------------
    kv_chunk = 2.0 * tok * s.kv_heads * s.head_dim / t * e
    bw_cp = group_bandwidth(hw, cp, t, hw.ag_eff)
    ring = (cp - 1.0) * (kv_chunk / bw_cp + hw.alpha)
    cp_fwd = np.where(cp > 1, np.maximum(ring - a_fwd, 0.0), 0.0)
    cp_bwd = np.where(cp > 1, np.maximum(2.0 * ring - a_bwd, 0.0), 0.0)

    # --- recomputation ----------------------------------------------------------------------------
    rc = c["recompute"]
    selective = a_fwd + sm_fwd  # the core attention again (flash: its forward kernel)

    # --- stage boundaries: embedding (first), final norm + output layer + loss (last) --------------
    bnd_tp = np.where(sp, rs + ag, ar)  # one collective forward, its mirror in backward
    emb_ew = 3.0 * tok * s.h * e / hw.bw  # lookup write, scatter-add of the gradient
    out_gemm = (
        gemm_time(hw, peak, tok, s.h, s.vocab / t, e)
        + gemm_time(hw, peak, tok, s.vocab / t, s.h, e)
        + gemm_time(hw, peak, s.h, tok, s.vocab / t, e)
    )
    # Vocab-parallel cross entropy: fp32 copy, max, exp, sum, normalise; backward one pass.
    logits = tok * s.vocab / t
    ce_ew = logits * (2.0 * e + 32.0) / hw.bw + 6.0 * s.h * rep * e / hw.bw
    ce_tp = 3.0 * allreduce(tok * 4.0, t, bw_ar, hw.tp_alpha)

    one = p == 1

    def stage(n: np.ndarray) -> dict[str, np.ndarray]:
        """The layers' part of a stage of ``n`` layers. Full recompute re-runs the layer's forward, its
        collectives included: those are priced as tensor/context-parallel communication (so a refit
        corrects them with the other collectives), the rest as recompute."""
        rl = np.where(c["recompute_layers"] < 0, n, np.minimum(c["recompute_layers"], n))
        full_share = np.where(rc == 2, rl / np.maximum(n, 1e-9), 0.0)
        rc_layer = np.where(
            rc == 2, (g_fwd + a_fwd + ew_fwd + launch_fwd) * full_share, np.where(rc == 1, selective, 0.0)
        )
        per_layer = {
            "gemm": g_fwd + g_bwd,
            "attention": a_fwd + a_bwd,
            "elementwise": ew_fwd + ew_bwd,
            "recompute": rc_layer,
            "tp_comm": tp_fwd * (1.0 + full_share) + tp_bwd,
            "cp_comm": cp_fwd * (1.0 + full_share) + cp_bwd,
            "launch": launch_fwd + launch_bwd,
        }
        return {k: n * x for k, x in per_layer.items()}

    # the first stage may hold fewer layers than the others (first_stage_layers); a stage between the
    # first and the last has the last's layers without its output layer: never the slower of the two
    first_layers, other_layers = stage_layers(s.layers, p, c["first_stage_layers"])
    first = stage(first_layers)
    last = stage(other_layers)
    first["elementwise"] = first["elementwise"] + emb_ew + np.where(one, ce_ew, 0.0)
    first["gemm"] = first["gemm"] + np.where(one, out_gemm, 0.0)
    first["tp_comm"] = first["tp_comm"] + bnd_tp + np.where(one, bnd_tp + ce_tp, 0.0)
    last["elementwise"] = last["elementwise"] + ce_ew + np.where(one, emb_ew, 0.0)
    last["gemm"] = last["gemm"] + out_gemm
    last["tp_comm"] = last["tp_comm"] + bnd_tp + ce_tp + np.where(one, bnd_tp, 0.0)
    t_first = sum(first.values())
    t_last = sum(last.values())
    use_last = t_last > t_first
    stage = {k: np.where(use_last, last[k], first[k]) for k in first}
    t_mb = np.maximum(t_first, t_last)

    # --- pipeline ---------------------------------------------------------------------------------
    bubble = (p - 1.0) / v * t_mb
    world = c["world"]
    msg = tok * s.h * e / t  # Megatron sends 1/t of the hidden states (scatter-gather / SP)
    p2p_bw = np.where(world > hw.dpn, hw.inter, hw.intra * hw.ag_eff)
    p2p = np.where(p > 1, 2.0 * (v * m + p - 1.0) * (msg / p2p_bw + hw.alpha), 0.0)

    # --- data parallel: gradient reduction over dp x cp, rank stride tp -----------------------------
    zero = c["zero_stage"]
    group = d * cp
    _, _, _, w_b, g_b = state_bytes_per_param(prec, zero, group, workload)  # unsharded dtypes
    dbw_ar = group_bandwidth(hw, group, t, hw.ar_eff)
    dbw_ag = group_bandwidth(hw, group, t, hw.ag_eff)
    grads = params_stage * g_b
    scatter_gather = allgather(grads, group, dbw_ar, hw.alpha) + allgather(params_stage * w_b, group, dbw_ag, hw.alpha)
    reduce = np.where(zero >= 1, scatter_gather, allreduce(grads, group, dbw_ar, hw.alpha))
    reduce = np.where(zero >= 3, 0.0, reduce)
    window = layers * (g_bwd + a_bwd + ew_bwd + launch_bwd + tp_bwd)  # backward of the last micro-batch
    if bool(workload.get("overlap_grad_reduce", True)):
        dp_exposed = np.maximum(reduce - OVERLAP * window, (1.0 - OVERLAP) * reduce)
    else:
        dp_exposed = reduce
    # The hidden part still costs: collectives share the device (SMs / memory bandwidth).
    dp_exposed = dp_exposed + hw.overlap_slowdown * (reduce - dp_exposed)
    # Tied embeddings with pp > 1: the first and last stage all-reduce the embedding gradient.
    if s.tied:
        emb_bw = np.where(world > hw.dpn, hw.inter, hw.intra * hw.ar_eff)
        dp_exposed = dp_exposed + np.where(p > 1, allreduce(s.vocab * s.h / t * g_b, 2.0, emb_bw, hw.alpha), 0.0)

    # ZeRO-3: per micro-batch all-gather of the weights in forward and in backward, reduce-scatter
    # of the gradients, prefetched behind the compute of the same micro-batch.
    z3_mb = 2.0 * allgather(params_stage * w_b, group, dbw_ag, hw.alpha) + allgather(
        params_stage * g_b, group, dbw_ar, hw.alpha
    )
    z3_exposed = np.maximum(z3_mb - OVERLAP * t_mb, (1.0 - OVERLAP) * z3_mb)
    z3_exposed = z3_exposed + hw.overlap_slowdown * (z3_mb - z3_exposed)
    z3 = np.where(zero >= 3, m * z3_exposed, 0.0)

    # --- optimizer: passes over memory per parameter (Megatron / apex multi-tensor kernels):
    # gradient norm for clipping (read g), the fp16 inf/nan check (read g), fused Adam on the
    # local shard (read g; read+write fp32 master, m, v: 24 B), the copy of the master weights
    # into the compute-dtype weights (read 4, write w), and zeroing the gradient buffer (write g).
    local = params_stage / np.where(zero >= 1, group, 1.0)
    inf_check = np.where(prec == 1, g_b, 0.0)
    opt = (local * (2.0 * g_b + inf_check + 24.0 + 4.0 + w_b) + params_stage * g_b) / hw.bw
    # Plus the host's fixed cost per parameter tensor (Python, the foreach kernels' dispatch; zero
    # by default, measured by `autotune calibrate`): the step's overhead that no byte count has.
    tensors = layers * (9.0 if s.arch == "llama" else 12.0) + 3.0  # norms + projections; embedding, norm, head
    opt = opt + tensors * hw.optimizer_tensor

    out = {k: m * x for k, x in stage.items()}
    out.update(pp_bubble=bubble, pp_p2p=p2p, dp_comm=dp_exposed, zero3_comm=z3, optimizer=opt)
    return out


def reference_columns(c: dict, hw: HW) -> dict:
    """The configs ``c`` at the size their scaling efficiency is read against, each rank doing
    the same work (weak scaling: tp, pp, cp, micro-batch and grad-accum kept):
    :data:`~autotune.workers.parameters.REFERENCE_DP_RULE`."""
    dp = reference_dp(c["tp"], c["pp"], c["cp"], c["dp"], float(hw.dpn))
    return {**c, "dp": dp, "world": c["tp"] * c["pp"] * c["cp"] * dp}
