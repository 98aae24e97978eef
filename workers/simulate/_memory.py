"""Training memory per device, for the most loaded pipeline stage (first or last).

Model states follow Megatron-LM / ZeRO (Rajbhandari et al. 2020); activations follow Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4),
generalised to Llama layers (SwiGLU, RMSNorm, GQA, RoPE) and flash attention. All byte counts are
per device and per micro-batch unless stated.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..parameters import stage_layers
from ._common import HW, Shape


# Bytes per parameter of the model states, by the stack that runs the config (``workload['memory_rule']``,
# set from the spec's target, or the torch probe's own rule for ``backend: torch``). Each rule gives
# (weights, gradients, optimizer) bytes unsharded and which ZeRO stage shards each of them.
MEMORY_RULES = ("megatron", "deepspeed", "fsdp2", "torch-probe", "mindspore")


def memory_rule_of(workload: Mapping[str, Any]) -> str:
    """The workload's memory rule (``megatron`` when none is set)."""
    rule = str(workload.get("memory_rule") or "megatron")
    if rule not in MEMORY_RULES:
        raise ValueError(f"unknown memory rule {rule!r}; expected one of {', '.join(MEMORY_RULES)}")
    return rule


def state_bytes_per_param(prec: np.ndarray, zero: np.ndarray, shard: np.ndarray, workload: Mapping[str, Any]):
    """Bytes per parameter of (weights, grads, optimizer states) on one device, and the unsharded
    weight and gradient dtypes (for gather buffers and gradient communication).

    ``prec``: 0 bf16, 1 fp16, 2 fp32. ``shard``: the dp x cp group ZeRO shards over. Rules:

    - ``megatron`` (Megatron-LM / MindSpeed; the distributed optimizer documentation): bf16 params
      with fp32 main grads (``accumulate_allreduce_grads_in_fp32`` is forced on for bf16) 18 bytes,
      6 + 12/d with the distributed optimizer; fp16 params and grads 20 bytes (the optimizer keeps
      fp32 main params *and* main grads), 4 + 16/d; fp32 16 bytes, 8 + 8/d. ZeRO-1 is the
      distributed optimizer; stages 2/3 do not exist there (kept ZeRO-shaped for ``target: none``).
    - ``deepspeed`` (ZeRO, Rajbhandari et al. 2020): 2 + 2 + 12 bytes in mixed precision (bf16 as
      fp16), 4 + 4 + 8 in fp32; stage 1 shards the optimizer, 2 also the gradients, 3 also the
      weights.
    - ``fsdp2`` (torchtitan; FSDP2 with param bf16 / reduce fp32): fp32 sharded weights, gradients
      and Adam moments, 16/d; the bf16 compute copy is the gather buffer (held whole after forward
      with ZeRO-2, per unit with ZeRO-3). Stage 0 is DDP in fp32: 16 bytes.
    - ``torch-probe`` (autotune's probe): fp32 weights and gradients with autocast, Adam moments
      8 bytes: 16 bytes; ZeRO-1 shards the moments (8 + 8/d); ZeRO-2/3 are FSDP2 as above. The
      autocast copy of the weights (2 bytes) lives through forward and backward.
    - ``mindspore`` (MindFormers): fp32 weights, fp32 gradients, Adam moments: 16 bytes; the
      parallel optimizer (ZeRO-1) shards the moments and the weights' optimizer copy (8 + 8/d).

    Without a rule the Megatron rule applies. ``workload['grad_dtype']`` ('fp32' | 'bf16' | 'fp16')
    overrides the gradient bytes.
    """
    rule = memory_rule_of(workload)
    fp32, fp16 = prec == 2, prec == 1
    if rule == "megatron":
        w = np.where(fp32, 4.0, 2.0)
        g = np.where(fp32 | ~fp16, 4.0, 2.0)  # fp32 main grads for bf16, fp16 grads for fp16
        o = np.where(fp32, 8.0, np.where(fp16, 16.0, 12.0))  # fp16: fp32 main params + main grads + Adam
    elif rule == "deepspeed":
        w = np.where(fp32, 4.0, 2.0)
        g = np.where(fp32, 4.0, 2.0)
        o = np.where(fp32, 8.0, 12.0)
    else:  # fsdp2, torch-probe, mindspore: fp32 parameters, the compute dtype is a copy or a cast
        w = np.full(prec.shape, 4.0)
        g = np.full(prec.shape, 4.0)
        o = np.full(prec.shape, 8.0)
    grad_dtype = workload.get("grad_dtype")
    if grad_dtype is not None:
        g = np.full(prec.shape, 4.0 if str(grad_dtype) == "fp32" else 2.0)
    w_b = np.where(zero >= 3, w / shard, w)
    g_b = np.where(zero >= 2, g / shard, g)
    o_b = np.where(zero >= 1, o / shard, o)
    if rule in ("fsdp2", "torch-probe"):  # FSDP2 shards weights and gradients for stages 2 and 3
        w_b = np.where(zero >= 2, w / shard, w_b)
    # the dtype the weights are gathered / gradients reduced in
    w_full = np.where(fp32, 4.0, 2.0)
    g_full = np.where(fp32 | ((prec == 0) & (zero < 3) & (rule == "megatron")), 4.0, 2.0)
    if rule in ("fsdp2", "torch-probe"):
        g_full = np.full(prec.shape, 4.0)  # reduce_dtype fp32
    return w_b, g_b, o_b, w_full, g_full


def layer_activation_bytes(s: Shape, c: dict, seq: float, flash: bool, workload: Mapping[str, Any]):
    """(stored bytes of one layer without recompute, bytes of one checkpointed layer, bytes of
    the core-attention part that selective recompute drops) for one micro-batch.

    Korthikanti eq. 1-2 for GPT: s*b*h*(10 + 24/t + 5*a*s/(h*t)) without sequence parallelism,
    s*b*h/t*(34 + 5*a*s/h) with it. The 10 replicated s*b*h bytes are the two LayerNorm inputs,
    the QKV and fc1 inputs (2 B each) and two dropout masks (1 B); the sharded 24 are Q, K, V, the
    projection input and the GeLU input and output. Llama layers store two RMSNorm inputs, the
    QKV and MLP inputs (replicated part 8*s*b*h), Q, K, V (GQA width), the attention output, the
    SwiGLU input (gate and up, 4*s*b*f) and the down-projection input (2*s*b*f), sharded by t.
    Flash attention stores no s^2 tensor, only the fp32 log-sum-exp.
    Without dropout (``workload['dropout']`` false, the default for llama) the masks go: a GPT
    layer then stores 32*s*b*h/t with SP + selective recompute.
    """
    t, sp, prec = c["tp"], c["sp"], c["precision"]
    e = np.where(prec == 2, 4.0, 2.0)
    tok = seq / c["cp"] * c["micro_batch_size"]  # tokens of one micro-batch on this device
    rep = np.where(sp, tok / t, tok)  # replicated width unless sequence parallel
    kvw = 2.0 * s.kv_heads * s.head_dim
    if s.arch == "llama" and memory_rule_of(workload) == "torch-probe":
        return _torch_probe_layer_bytes(s, prec, tok, rep, t, kvw)
    dropout = has_dropout(s, workload)
    if s.arch == "llama":
        rep_b = 4.0 * s.h * rep * e
        shard_b = (2.0 * s.h + kvw + 3.0 * s.ffn) * tok / t * e
    else:
        rep_b = 4.0 * s.h * rep * e
        shard_b = (2.0 * s.h + kvw + 2.0 * s.ffn) * tok / t * e
    rep_b = rep_b + (2.0 * s.h * rep if dropout else 0.0)  # two 1-byte residual dropout masks
    # softmax output; with attention dropout also its output and 1-byte mask
    s2_elem = 2.0 * e + 1.0 if dropout else 1.0 * e
    if flash:  # fp32 log-sum-exp per query and head instead of the s x s scores
        s2 = np.zeros_like(tok)
        lse = 4.0 * s.heads * tok / t
    else:
        s2 = s2_elem * s.heads * seq * tok / t
        lse = np.zeros_like(tok)
    full = rep_b + shard_b + lse + s2
    ckpt = s.h * rep * e  # full recompute keeps only the layer input
    return full, ckpt, s2


def _torch_probe_layer_bytes(s: Shape, prec: np.ndarray, tok, rep, t, kvw: float):
    """``layer_activation_bytes`` of autotune's own torch probe (``workers/torch_probe/model.py``),
    counted, not derived: autograd's saved tensors of one Llama layer under autocast (each storage
    once, ``torch.autograd.graph.saved_tensors_hooks``) at eight shapes, per token, fit exactly by

    - bf16 / fp16: 34 h + 8 f + 8 head_dim + 4 heads bytes; selective recompute 30 h + 2 kvw + 8 f
      + 8 head_dim;
    - fp32: 40 h + 16 f + 8 head_dim + 4 heads; selective 32 h + 4 kvw + 16 f + 8 head_dim.

    Twice Korthikanti's Megatron count, because the probe's residual stream and RMSNorm run in fp32
    (each norm keeps its fp32 input and output and the linear its low-precision cast: 10 h), its
    SwiGLU keeps both branches and their product apart (8 f), and GQA's K and V are expanded to
    every head for attention. Checked on one NVIDIA H200 (benchmarks/README.md, "Accelerator
    check"): the allocated peak per extra sample of a 1B and a 3B Llama within 1 %, with the
    logits' 12 bytes (``_torch_probe_logits_bytes``). The two norms (20 h, 24 h in fp32) are the
    replicated part under tensor parallelism; the rest is sharded by tp."""
    fp32 = prec == 2
    norms = np.where(fp32, 24.0, 20.0) * s.h
    rest = np.where(fp32, 16.0 * s.h + 16.0 * s.ffn, 14.0 * s.h + 8.0 * s.ffn) + 4.0 * s.heads
    full = norms * rep + rest * tok / t + 8.0 * s.head_dim * tok
    # what selective recompute (RoPE and attention redone) does not keep, per token
    dropped = (np.where(fp32, 8.0, 4.0) * s.h - np.where(fp32, 4.0, 2.0) * kvw + 4.0 * s.heads) * tok / t
    ckpt = 4.0 * s.h * rep  # full recompute keeps the layer's input: the fp32 residual stream
    return full, ckpt, dropped


def has_dropout(s: Shape, workload: Mapping[str, Any]) -> bool:
    """Dropout in the layers: Megatron's GPT default (hidden and attention dropout 0.1); Llama
    recipes train without. ``workload['dropout']`` overrides."""
    value = workload.get("dropout")
    return (s.arch == "gpt") if value is None else bool(value)


def inflight(c: dict, first: bool, rank: Any = None) -> np.ndarray:
    """Micro-batch x layer units of activations a stage holds at its peak, in units of its
    layers for one micro-batch. 1F1B: rank r holds min(pp - r, m) micro-batches. Interleaved
    (Megatron's schedule): rank r warms up 2*(pp - r - 1) + (vpp - 1)*pp chunk-micro-batches,
    each 1/vpp of its layers; for the first stage this is Korthikanti's pp*(1 + (pp-1)/(pp*vpp)).
    ``rank`` (a stage between the first and the last) overrides ``first``.
    """
    p, v, m = c["pp"], c["vpp"], c["grad_accum"]
    r = (0.0 if first else p - 1.0) if rank is None else rank
    plain = np.minimum(p - r, m)
    inter = np.minimum(2.0 * (p - r - 1.0) + (v - 1.0) * p + 1.0, m * v) / v
    return np.where(v > 1, inter, plain)


def train_memory(s: Shape, hw: HW, c: dict, workload: Mapping[str, Any], first: bool, second: bool = False):
    """(parameters held, memory components in bytes) of the first (``first``) or last pipeline
    stage of one device, or (``second``) of the stage after the first when it is not the last: with
    fewer layers on the first stage (``first_stage_layers``) the second holds one micro-batch less
    of more layers, and may be the fuller."""
    seq = float(workload["seq_len"])
    flash = bool(workload.get("flash_attention", True))
    t, p, prec, zero = c["tp"], c["pp"], c["precision"], c["zero_stage"]
    e = np.where(prec == 2, 4.0, 2.0)
    first_layers, other_layers = stage_layers(s.layers, p, c["first_stage_layers"])
    layers = first_layers if first and not second else other_layers
    shard = c["dp"] * c["cp"]

    # --- parameters of this stage -------------------------------------------------------------
    per_layer = s.layer_params(t)
    embed = s.vocab * s.h / t  # vocab-parallel embedding
    one_stage = p == 1
    has_first = np.full(p.shape, not second) if first else one_stage
    has_last = one_stage if first else np.full(p.shape, True)
    # The output layer is its own matrix unless tied; with pp > 1 a tied output layer is a copy
    # on the last stage (Megatron keeps both and all-reduces their gradients).
    out_layer = embed if not s.tied else np.where(one_stage, 0.0, embed)
    final_norm = s.h * (2.0 if s.arch == "gpt" else 1.0)
    positions = s.max_pos * s.h if s.arch == "gpt" else 0.0  # learned absolute positions
    extra = has_first * (embed + positions) + has_last * (out_layer + final_norm)
    params = layers * per_layer + extra
    w_b, g_b, o_b, w_full, g_full = state_bytes_per_param(prec, zero, shard, workload)

    # --- activations ---------------------------------------------------------------------------
    full, ckpt, s2 = layer_activation_bytes(s, c, seq, flash, workload)
    rc = c["recompute"]
    rl = np.where(c["recompute_layers"] < 0, layers, np.minimum(c["recompute_layers"], layers))
    per_layer_act = np.where(rc == 1, full - s2, full)
    stage_act = np.where(rc == 2, (layers - rl) * per_layer_act + rl * ckpt, layers * per_layer_act)
    held = inflight(c, first, 1.0 if second else None) * stage_act
    # Working set of the layer in backward: its (recomputed) activations and their gradients.
    transient = full
    tok = seq / c["cp"] * c["micro_batch_size"]
    rep = np.where(c["sp"], tok / t, tok)
    # First stage: GPT's embedding dropout mask for each micro-batch in flight. Last stage: the
    # output layer of the one micro-batch whose loss is being computed.
    boundary = has_first * (1.0 if has_dropout(s, workload) else 0.0) * s.h * rep * inflight(c, True)
    rule = memory_rule_of(workload)
    if rule == "torch-probe":
        logits = has_last * _torch_probe_logits_bytes(s, tok, t, rep)
    else:
        logits = has_last * _logits_bytes(s, tok, t, e, rep)
    # The loss (logits peak) and the first layer's backward working set do not coexist: the
    # larger of the two is counted.
    loss_peak = logits > transient
    transient = np.where(loss_peak, 0.0, transient)
    logits = np.where(loss_peak, logits, 0.0)

    # --- ZeRO-3 gather buffers: the unit in use, the prefetched one, one unsharded gradient, and
    # the root unit (embedding / output layer) that FSDP keeps gathered through the step.
    root = embed * (1.0 if s.tied else 2.0)
    gather = np.where(zero >= 3, per_layer * (2.0 * w_full + g_full) + root * w_full, 0.0)
    if rule in ("fsdp2", "torch-probe"):
        # FSDP2 without resharding after forward (ZeRO-2) keeps the whole stage's compute copy
        gather = np.where(zero == 2, params * w_full, gather)
    if rule == "torch-probe":
        # autocast's cast cache: a bf16/fp16 copy of the weights from the first use to the end of backward
        gather = gather + np.where((zero < 2) & (prec != 2), params * 2.0, 0.0)

    # --- communication buffers: every communicator of more than one rank that the rank uses.
    d, cp = c["dp"], c["cp"]
    n_comm = (
        (t > 1) * 1.0
        + (d > 1)
        + (cp > 1)
        + ((cp > 1) & (d > 1))
        + (p > 1) * 2.0
        + ((p > 1) & (t > 1))
        + (c["world"] > 1)
    )
    per_comm = 2.0 * c["hccl_buffsize_mb"] * 2.0**20 if hw.hccl else np.full_like(tok, hw.comm_mib * 2.0**20)
    comm = n_comm * per_comm

    dynamic = held + transient + boundary + logits + gather
    frag = dynamic * fragmentation_fraction(hw, c)
    grads = params * g_b
    if rule == "torch-probe":
        # The probe sets its gradients to None after each step. With one micro-batch on one stage
        # and no data parallelism they are made during backward as the activations go, so the peak
        # holds the larger of the two, not both (one H200: a 1B Llama's allocated peak 23.30 GiB,
        # 27.8 with its 4.6 GiB of gradients counted); with accumulation they live through the
        # next micro-batch's forward (a 3B at 8 micro-batches: every byte of them in the peak).
        one_pass = (c["grad_accum"] <= 1) & (p == 1) & (d == 1)
        grads = np.where(one_pass, np.maximum(0.0, grads - (held + transient + boundary + logits)), grads)
    return params, {
        "weights": params * w_b,
        "grads": grads,
        "optimizer": params * o_b,
        "activations": held + transient + boundary,
        "logits": logits,
        "zero3_gather": gather,
        "comm_buffers": comm,
        "runtime_reserve": np.full_like(tok, hw.reserve),
        "fragmentation": frag,
    }


def _logits_bytes(s: Shape, tok, t, e, rep):
    """Peak of the output layer of one micro-batch: the logits in the compute dtype and the fp32
    copy Megatron's vocab-parallel cross entropy works on in place (softmax kept for backward),
    plus the final-norm and output-layer inputs. Unfused losses that keep a separate fp32
    log-softmax need 4 B more per logit; fused ones (flash-attn's) less."""
    return tok * s.vocab / t * (e + 4.0) + 2.0 * s.h * rep * e


def _torch_probe_logits_bytes(s: Shape, tok, t, rep):
    """The torch probe's loss peak: 12 bytes per logit whatever the precision (bf16: the logits, their
    fp32 copy, the log-softmax kept for backward and its gradient; fp32 likewise without the cast),
    read off one NVIDIA H200's allocated peaks (1B and 3B Llamas, vocabulary 128,256: 12.0 and
    12.1 bytes per logit once the layers are counted), plus the final norm's fp32 input and
    output."""
    return 12.0 * tok * s.vocab / t + 8.0 * s.h * rep


def fragmentation_fraction(hw: HW, c: dict) -> np.ndarray:
    """Reserved-but-unusable memory of the caching allocator, as a fraction of the dynamic
    memory. expandable_segments maps pages on demand (little fragmentation); max_split_size_mb
    stops large cached blocks being split (about 40 % less); garbage_collection_threshold frees
    cached blocks before the limit (about 20 % less). On Ascend, MULTI_STREAM_MEMORY_REUSE=0 keeps
    blocks used by the communication stream until it synchronises (+5 % of the dynamic memory),
    2 reuses them more aggressively than the default 1 (-2 %). Heuristics, documented as such.
    """
    base = np.where(c["alloc_expandable_segments"], hw.frag_expandable, hw.frag_default)
    base = base * np.where(c["alloc_max_split_size_mb"] > 0, 0.6, 1.0)
    base = base * np.where(c["alloc_gc_threshold"] > 0, 0.8, 1.0)
    if hw.accelerator == "npu":
        reuse = c["multi_stream_memory_reuse"]
        base = base + np.where(reuse == 0, 0.05, np.where(reuse >= 2, -0.02, 0.0))
    return np.maximum(base, 0.0)
