"""A synthetic "true world" for the search benchmark, and the launcher that measures in it.

A world is the analytical simulator with hidden perturbations drawn from a seed: hardware
efficiencies and bandwidths (GEMM, flash attention, memory bandwidth, all-reduce, all-gather,
inter-node, latencies), extra factors on single time components (recompute, pipeline bubble,
optimizer, TP/DP/PP communication), fragmentation, runtime reserve and activation memory,
per-value effects the model does not price at all (a micro-batch size whose kernels run
slower, an allocator setting), and measurement noise. The simulator the search uses knows none
of it: against the nominal model a world is off by 10-40 % in places, like a real machine.

    python benchmarks/true_world.py TRIAL_FILE      (with AUTOTUNE_BENCH_WORLD=world.json)

is a user's launcher for the ``command`` backend: it reads the trial file, "runs" the config in
the world, and prints the probe protocol's lines — a metrics line, or an OOM failure in the
words a real allocator uses (so autotune's classifier, not a shortcut, sees it).

    python benchmarks/true_world.py TRIAL_FILE --node-rank N

is the same launcher as one node of a multi-node trial (argv ``[..., "{trial_file}", "--node-rank",
"{node_rank}"]``, dispatched by autotune through Ray, one launcher per node: see
``local_ray_cluster.py``): every node "runs" the same config; node 0 prints the metrics line and the
other nodes print none and exit 0 (autotune's multi-node dispatch takes node 0's result); an OOM or
an invalid config fails on every node, in the same words. The trial's result is the one a
single-process launch gives.

Structure families (``STRUCTURE_FAMILIES``, ``--families`` of ``search_efficiency.py``) add memory
or time terms the simulator does not have. Issue #12's six and issue #35's ``family-slow`` are
hand-made; issue #35 (part 3) adds families taken from the stacks' own memory accounting and from
what their issue trackers report about real OOMs and slow steps, so the search is also tested on
worlds not designed around its model:

- ``megatron-theory``: memory as Megatron-LM's ``theoretical_memory_usage.py`` accounts it
  (Korthikanti et al.'s activations, per stage, the interleaved schedule's factor, the output
  layer and its logits on the last stage);
- ``caching-allocator``: the reserved-minus-allocated gap of torch's caching allocator (2 MiB /
  20 MiB segments, split blocks that are not returned), growing with the size of the live
  activation tensors, mostly removed by ``expandable_segments:True``; probes report
  ``max_memory_allocated``;
- ``tracker-ooms``: the first optimizer step's fp32 gradient-shard copy, the fp32 softmax
  gradient of the vocab-parallel loss, memory that grows after the first iteration, and two slow
  steps (full recompute with sequence parallel; the interleaved schedule with few micro-batches);
- ``mindspeed``: memory as MindSpeed's auto-parallel memory cost model accounts it (stage 0).

Every term scales with the model it is given: a memory profile probe (the same config with
``pp * vpp * k`` layers) gets per-layer terms for ``k`` layers per stage and the static terms whole;
terms that are not linear in the layers (a max over stages, a spike that reuses freed activation
memory, the late growth a two-step run sees only in part) make a profile's extrapolation err the
way a real one would.

The production path (issue 41; ``PATHS``, ``--path production`` of ``search_efficiency.py``). The
worlds above report what the torch probe reports on a device: the peak, the allocator's reserved
peak and the memory the allocator could have used (``usable_memory_gib``). The production path
(Megatron-LM / MindSpeed-LLM logs, torchtitan, DeepSpeed, a team's own launcher through the
``command`` backend) reports the step time and the peak only, and its usable memory sits a few
percent below the nominal device memory. A world on that path

- reports its peak only (``peak_only``): no ``usable_memory_gib``, no ``peak_reserved_gib``;
- has its usable memory ``usable_below`` (3-12 %, drawn per world) below the nominal: the device's
  total (what its allocator's message calls the total capacity) is the nominal less that share;
- prints its out-of-memory failure in one real format (``oom_format``, ``OOM_FORMATS``): torch's
  CUDA allocator, torch_npu's, MindSpore's, vLLM's engine start-up, or a plain "out of memory" with
  no numbers; with a format set, the allocator's numbers are a real allocator's: the request that
  failed is larger than what the device had free, so "in use + requested" (what autotune's parser
  reads as needed at least) lies above the device's total by less than the failed request (one
  tensor, 0.1-4 GiB) and at most at the config's need: the message says the config is over, not
  how far (the lab's messages request up to the whole remaining need).

``oom_format`` None (every world off the production path) keeps torch_npu's message with the numbers
the worlds always gave, so the figures taken before issue 41 stay comparable.
"""

from __future__ import annotations

import hashlib
import math
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.guide.memory_profile import PROFILE_MARK  # in a profile's workload: a launch of its own

HW_FACTORS = {  # multiplicative ranges on profile fields
    "gemm_efficiency": (0.75, 1.12),
    "flash_attention_efficiency": (0.6, 1.4),
    "memory_bandwidth_efficiency": (0.7, 1.3),
    "allreduce_efficiency": (0.5, 1.4),
    "allgather_efficiency": (0.5, 1.3),
    "inter_node_efficiency": (0.5, 1.2),
    "collective_latency_us": (0.5, 3.0),
    "kernel_launch_us": (0.5, 2.0),
}
HW_VALUES = {  # absolute ranges
    "comm_overlap_slowdown": (0.0, 0.3),
    "fragmentation_default": (0.05, 0.25),
    "fragmentation_expandable": (0.0, 0.08),
    "runtime_reserve_gib": (2.5, 6.0),
}
TIME_FACTORS = {
    "recompute": (0.7, 1.5),
    "pp_bubble": (0.8, 1.6),
    "optimizer": (0.5, 2.0),
    "tp_comm": (0.7, 1.6),
    "dp_comm": (0.7, 1.5),
    "pp_p2p": (0.5, 2.0),
    "zero3_comm": (0.7, 1.6),
}
MEM_FACTORS = {"activations": (0.9, 1.25), "comm_buffers": (0.5, 2.0), "logits": (0.9, 1.3)}
VALUE_EFFECTS = {"micro_batch_size": (0.92, 1.08), "env.PYTORCH_NPU_ALLOC_CONF": (0.97, 1.03), "vpp": (0.95, 1.05)}
STEP_NOISE_ENV = "AUTOTUNE_BENCH_STEP_NOISE"  # the launcher's copy of search_efficiency.py --step-noise
# relative sd of a measured step time (a median of steps, not one step)
NOISE = float(os.environ.get(STEP_NOISE_ENV) or 0.02)
# the heavy-tailed family (issue 44): a share of probes runs 20 % slow (a straggler, a busy link, a
# neighbour's job), on top of the normal noise
OUTLIERS_ENV = "AUTOTUNE_BENCH_OUTLIERS"  # the launcher's copy of search_efficiency.py --outliers
OUTLIER_SHARE = float(os.environ.get(OUTLIERS_ENV) or 0.0)
OUTLIER_SLOWDOWN = 1.2
# relative sd of one step's time within a run: NOISE is a whole probe's reading (its timed steps' median,
# the launch's noise), so a reading of fewer timed steps (a short re-measurement, autotune.guide.
# short_remeasure) adds what its few steps average out less: STEP_JITTER^2 (1/k - 1/K) of variance for k
# of the full probe's K. 2 %: on the H200 the torch probe's steps spread 0.45 % within a run
# (benchmarks/README.md, "Accelerator check"); Megatron-LM's per-iteration times on a busy cluster, 1-2 %
STEP_JITTER = 0.02
# a trial's launches (its memory profiles, then its full probe) and their noise: "trial" (the default,
# as every figure before 2026-12-05): one draw for all of them, the speed and the peak, so a profile
# and the full probe of one trial err alike (the same devices, back to back); "launch": each launch
# its own draw, as separate processes of different sizes would read. The guide's memory path learns
# how far its profiles extrapolate from their full probes (memory_profile.calibrate_estimate), and a
# shared draw makes that look better than a machine whose launches vary apart would
LAUNCH_NOISE_ENV = "AUTOTUNE_BENCH_LAUNCH_NOISE"  # the launcher's copy of search_efficiency.py --launch-noise
LAUNCH_NOISE = os.environ.get(LAUNCH_NOISE_ENV) or "trial"
LAUNCH_NOISES = ("trial", "launch")
FULL_STEPS_ENV = (
    "AUTOTUNE_BENCH_FULL_STEPS"  # the spec's workload's timed steps (a re-measurement's trial file has fewer)
)

# Memory that behaves unlike the simulator's structure, not only with other coefficients (issue #12):
# each family adds a term the analytical model does not have, with a strength drawn per world.
STRUCTURE_FAMILIES = {
    # a second, unsharded fp32 gradient buffer (DDP-style buckets) whenever gradients are not sharded
    "fp32-grads": (0.6, 1.0),
    # fragmentation that depends on the allocator setting *and* grows with the micro-batch (larger
    # blocks fragment more), as a share of the dynamic memory
    "alloc-frag": (0.10, 0.22),
    # usable HBM below nominal (runtime, HCCL): a constant GiB off the capacity, plus a buffer per
    # communicator the rank belongs to
    "usable-below": (3.0, 7.0),
    # the first pipeline stage keeps fp32 copies of the embedding and its gradient unsharded
    "stage-imbalance": (1.0, 2.0),
    # an activation term not reduced by tensor or sequence parallelism (masks, rotary caches, the
    # recomputation's own buffers): bytes per token per layer, times the micro-batches in flight
    "act-extra": (6.0, 14.0),
    # the probe reports what torch's caching allocator saw (max_memory_allocated, as Megatron-LM's
    # and DeepSpeed's logs and autotune's own probes on a device do): its peak leaves out the
    # allocator's fragmentation, the runtime's context and the communication buffers, which the
    # device still holds; the memory itself is the simulator's (strength: unused)
    "allocator-peak": (1.0, 1.0),
    # not memory: a family of layouts runs this much slower than its components say, every config
    # of it alike (a stack whose pipeline schedule or unsharded-optimizer step overlaps worse than
    # the model assumes: issue #35's world where the pipelined ZeRO-1 configs ran 1.35x slower than
    # predicted and ZeRO-3 with full recompute won); which family, from the seed (SLOW_GROUPS)
    "family-slow": (1.25, 1.5),
    # issue #35 part 3 (module docstring; MEGATRON_THEORY, CACHING_ALLOCATOR, TRACKER_OOMS, MINDSPEED
    # below say what each models and where it comes from). Strengths: megatron-theory and mindspeed,
    # the factor of measured over accounted activations (Megatron's own file allows 5 % in one
    # branch; runs above the estimate are reported, e.g. NVIDIA/Megatron-LM issue #525);
    # caching-allocator, the split-block share of the activation memory at large tensors;
    # tracker-ooms, a common scale of its terms (each term's own coefficient is drawn from the seed)
    "megatron-theory": (1.0, 1.2),
    "caching-allocator": (0.10, 0.30),
    "tracker-ooms": (0.5, 1.0),
    "mindspeed": (0.95, 1.2),
}
# the layout families "family-slow" may slow down: pipelined with unsharded optimizer states, any
# unsharded optimizer, any pipeline
SLOW_GROUPS = {
    "pp>1,zero<=1": lambda c: int(c.get("pp") or 1) > 1 and int(c.get("zero_stage") or 0) <= 1,
    "zero<=1": lambda c: int(c.get("zero_stage") or 0) <= 1,
    "pp>1": lambda c: int(c.get("pp") or 1) > 1,
}

GIB = 2.0**30
MIB = 2.0**20
_RECOMPUTE = {"none": 0, "selective": 1, "full": 2}

# --- megatron-theory -------------------------------------------------------------------------------
# Megatron-LM's megatron/training/theoretical_memory_usage.py at NVIDIA/Megatron-LM commit
# d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22): weights + gradients + optimizer 18 bytes per
# parameter without the distributed optimizer, 6 + 12/dp with it (ZeRO-1 here; its ZeRO-2/3 do not
# exist there and keep the simulator's ZeRO shapes); activations per Korthikanti et al. (2205.05198,
# Table 2) as the file computes them, for the first stage: s*b*h*(18 + 4*ffn/h)/tp per layer with
# sequence parallel *and* selective recompute, s*b*h*(10 + 24/tp) per layer otherwise (times the
# file's 1.05 allowance), the first stage holding pp micro-batches of its L/pp layers (times
# min(1, m/pp) without interleaving), the interleaved schedule's 1 + (pp-1)/(pp*vpp) on all of it
# (whatever the micro-batch count), the embedding's input (8 B/token) and dropout mask (1 B) per
# micro-batch in flight, and the output layer's input and logits (fp32 with SP+selective, bf16
# otherwise) only where pp = 1. Where the file is silent the world keeps the same conventions: the
# last stage (output layer weights, one micro-batch of its layers in flight with 1F1B, the
# interleaved last rank's warm-up otherwise, and the output layer's logits, which the file never
# counts for pp > 1) is evaluated too and the peak is the larger stage; full recompute (the file
# has no branch for it) keeps Korthikanti's 2*s*b*h (/tp with SP) per layer plus one layer's
# working set. Structurally unlike the simulator: SP only pays with selective recompute, the
# logits add to the activations at pp = 1 (the simulator takes the larger of the two), the
# interleaved factor ignores the micro-batch count, and the last stage's peak includes its logits.
MEGATRON_THEORY_SOURCE = (
    "NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553:megatron/training/theoretical_memory_usage.py"
)

# --- caching-allocator ------------------------------------------------------------------------------
# torch's caching allocator, pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp, and torch_npu's copy
# (Ascend/pytorch torch_npu/csrc/core/npu/NPUCachingAllocator.cpp, the same constants): requests
# <= 1 MiB come from 2 MiB small-pool segments; 1-10 MiB requests split 20 MiB segments
# (kLargeBuffer); larger ones are rounded up to 2 MiB (kRoundLarge) and get their own segment;
# a freed block stays reserved, is split for later requests and is not merged across segments, so
# blocks freed in the backward strand memory the next larger request cannot use, the more so the
# larger the tensors. expandable_segments:True maps pages into one growing segment instead
# (PyTorch's CUDA memory-management notes: it is meant for this fragmentation). Here: the
# reserved-minus-allocated gap is the per-tensor rounding of every live activation tensor plus a
# split-block share of the activation memory that grows with the tensors' size, S / (S + 64 MiB)
# for the largest per-layer tensor S (x 0.15 with expandable segments); it replaces the
# simulator's flat fragmentation share. An OOM happens on reserved memory; a probe reports
# max_memory_allocated (the gap, the runtime and the communication buffers left out), as in
# "allocator-peak".
ALLOC_SMALL, ALLOC_SEGMENT, ALLOC_MIN_LARGE, ALLOC_ROUND = 1 * MIB, 20 * MIB, 10 * MIB, 2 * MIB
ALLOC_SPLIT_SCALE = 64 * MIB  # the tensor size at which half the strength's share strands
ALLOC_EXPANDABLE = 0.15  # share of the split-block gap left with expandable_segments:True

# --- tracker-ooms -----------------------------------------------------------------------------------
# Terms from what the stacks' issue trackers report about real OOMs and slow steps. The family's
# strength scales all of them; each term's coefficient is drawn from the seed (TRACKER_TERMS).
# - step_spike / spike_reuse: the first optimizer step materialises an fp32 copy of the gradients
#   of the whole shard at once (DeepSpeed ZeRO-1/2 casts the flat gradient partition to fp32 in
#   step(); deepspeedai/DeepSpeed issue #1535, an OOM in `fp32_param.grad = fp16_param.grad.to(...)`,
#   and issue #3114, bf16/fp16 optimizers OOM at step() where fp32 does not; Megatron's distributed
#   optimizer built its param buffer through a transient copy, NVIDIA/Megatron-LM PR #644). At the
#   step the activations are freed, but the allocator can give a single large block only part of
#   their cached memory (spike_reuse): the rest of the spike is new reserved memory.
# - ce_fp32: the vocab-parallel cross entropy holds the logits in fp32 and a separate fp32
#   softmax gradient beyond what the simulator prices (ISEEKYAN/Megatron-LM PR #132: "the complete
#   FP32 softmax working set", 4.6 GiB at 8192 tokens x 152k vocab; NVIDIA-NeMo/Automodel issue
#   #3907: full [B, S, V] logits OOMing): 4 B per logit of the last stage's micro-batch, a peak
#   only where it lifts the last stage above the first.
# - late_growth: memory at steps 2-3 above step 1 (NVIDIA/Megatron-LM issue #640: the last pipeline
#   stage 7 GB higher from the second global batch on; NVIDIA-NeMo/Megatron-Bridge issue #3164: log
#   memory "at least including the second iteration"): the optimizer states, created at the first
#   step, land in new segments beside the first step's cached activation blocks; up to the smaller
#   of the two, x 0.3 with expandable segments. A run of one step sees none of it, of two steps
#   part (0.5), of three or more all: a memory profile (one warm-up + one measured step) sees half.
# - rc_sp_regather (time): full recompute with sequence parallel replays the layer's SP all-gathers
#   and gathers the same input again for the weight gradient (NVIDIA/Megatron-LM PR #7423), which
#   the simulator counts as hidden: + a share of the step's TP communication.
# - interleave_few (time): the interleaved schedule with few micro-batches per pipeline rank runs
#   mostly warm-up and cool-down, its extra p2p exposed (NVIDIA/Megatron-LM issue #1829: micro-batch
#   groups smaller than pp leave many bubbles; NVIDIA-NeMo issue #14288: fewer than pp refused):
#   + (pp / m) x the pipeline's bubble and p2p time.
TRACKER_TERMS = {
    "step_spike": (0.7, 1.0),  # share of the 4 B/param fp32 gradient-shard copy live at once
    "spike_reuse": (0.5, 0.9),  # share of the freed activation memory the spike can reuse
    "ce_fp32": (0.5, 1.0),  # x 4 B per logit
    "late_growth": (0.3, 0.7),  # share of min(optimizer states, activation memory)
    "rc_sp_regather": (0.6, 1.0),  # x 1/3 of the step's TP communication
    "interleave_few": (0.3, 0.8),  # x (pp / m) x (bubble + p2p)
}

# --- mindspeed --------------------------------------------------------------------------------------
# MindSpeed's auto-parallel memory cost model, mindspeed/core/auto_parallel/search/memory_model.py at
# Ascend/MindSpeed commit 46a2ae030eea905b6bbf422ed014cc9924c5e5c9 (MemoryCostModel.get_peak_memory,
# white box): stage 0 only (embedding; the output layer only at pp = 1, untied); bf16 with the
# distributed optimizer 2 + 4 + 4 + 8/dp bytes per parameter (its fp32 main params unsharded),
# 18 without (ZeRO-2/3 keep the simulator's shapes); activations per layer from its module shapes
# (two norms and the projection and down-projection outputs at seq/tp, QKV and the core attention
# at the full sequence, the SwiGLU input and its activation), times pp micro-batches of L/pp
# layers, or L/(pp*vpp) layers times pp*vpp + pp - 1 interleaved (no discount for few
# micro-batches), plus a constant 4.5 GiB of CANN memory (replacing the runtime reserve). The
# model's shapes assume sequence parallel; without it the world keeps the full sequence there. Its
# full recompute counts no activations at all; the world keeps the layer inputs (2*s*b*h, /tp with
# SP) and one layer's working set. Logits, ZeRO-3 buffers, communication buffers and fragmentation
# stay the simulator's.
MINDSPEED_SOURCE = (
    "Ascend/MindSpeed@46a2ae030eea905b6bbf422ed014cc9924c5e5c9:mindspeed/core/auto_parallel/search/memory_model.py"
)
MINDSPEED_CANN_GIB = 4.5


# --- the production path (issue 41) ---------------------------------------------------------------
# The out-of-memory formats a world can print (``oom_lines``). cuda: torch >= 2.1's CUDA caching
# allocator (c10/cuda/CUDACachingAllocator.cpp); npu: torch_npu's (MindSpeed-LLM on Ascend);
# mindspore: MindSpore's Ascend memory adapter ("Out of Memory!!! Request memory size: ...B, Memory
# Statistic:", mindspore/ccsrc .../ascend_memory_adapter.cc, as MindSpore's docs quote it); vllm:
# vLLM's engine start-up when no memory is left for the KV cache (vllm/v1/core/kv_cache_utils.py;
# a serving engine's words: a training world prints them only where asked, to see what the generic
# parser makes of them); plain: the CUDA runtime's "CUDA error: out of memory" with no numbers.
OOM_FORMATS = ("cuda", "npu", "mindspore", "vllm", "plain")
# ``--oom-format mixed``: the formats autotune's generic parser (workers/protocol.py
# classify_failure) classifies as ``oom`` today; each world one of them
MIXED_OOM_FORMATS = ("cuda", "npu", "mindspore", "plain")
USABLE_BELOW = (0.03, 0.12)  # the usable memory's share below the nominal on the production path
# the size of the request that fails, GiB (log-uniform: an activation, a logits or a gradient buffer);
# the lab's worlds instead request up to the whole remaining need, which tells how far over it is
OOM_REQUEST_GIB = (0.1, 4.0)


@dataclass(frozen=True)
class PathOptions:
    """What a world's probes report, and how much of its nominal memory is usable."""

    peak_only: bool = False  # report the step time and the peak only (no usable memory, no reserved peak)
    usable_below: tuple[float, float] | None = None  # (low, high) share of the nominal not usable, per world
    oom_format: str | None = None  # OOM_FORMATS, or "mixed" (one of MIXED_OOM_FORMATS per world); None: lab


PATHS = {
    "lab": PathOptions(),  # the torch probe on a device (every world before issue 41)
    "production": PathOptions(peak_only=True, usable_below=USABLE_BELOW, oom_format="mixed"),
}


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


def _layout(model: dict, workload: dict, configs: list[dict[str, Any]]) -> dict[str, Any]:
    """The configs' columns and the model's shape, for the families' own accounting (the model as
    given: a memory profile's fewer layers included)."""

    def col(key: str, default: float) -> np.ndarray:
        return np.array([float(c[key]) if c.get(key) is not None else default for c in configs], dtype=float)

    tp, pp, vpp, cp = col("tp", 1), col("pp", 1), col("vpp", 1), col("cp", 1)
    dp, mbs, zero = col("dp", 1), col("micro_batch_size", 1), col("zero_stage", 0)
    gbs = float(workload["global_batch_size"])
    m = col("grad_accum", 0)
    m = np.where(m > 0, m, gbs / np.maximum(dp * mbs, 1.0))
    alloc = [str(c.get("env.PYTORCH_NPU_ALLOC_CONF", "")) for c in configs]
    heads = float(model["num_attention_heads"])
    h = float(model["hidden_size"])
    seq = float(workload["seq_len"])
    return {
        "tp": tp,
        "pp": pp,
        "vpp": vpp,
        "cp": cp,
        "dp": dp,
        "mbs": mbs,
        "zero": zero,
        "m": m,
        "sp": np.array([_truthy(c.get("sequence_parallel", False)) for c in configs], dtype=bool),
        "rc": np.array([_RECOMPUTE.get(str(c.get("recompute") or "none").lower(), 0) for c in configs]),
        "expandable": np.array(["expandable_segments:true" in a.lower() for a in alloc], dtype=bool),
        "h": h,
        "kv": float(model.get("num_key_value_heads") or heads),
        "hd": h / heads,
        "f": float(model["intermediate_size"]),
        "vocab": float(model["vocab_size"]),
        "gated": str(model.get("arch", "llama")).lower() != "gpt",
        "tied": bool(model.get("tie_word_embeddings", False)),
        "stage_layers": float(model["num_hidden_layers"]) / pp,
        "seq": seq / cp,  # this rank's sequence
        "tok": seq / cp * mbs,  # tokens of one micro-batch on this rank
        "shard": dp * cp,  # the group the distributed optimizer / ZeRO shards over
    }


def _stage_params(lay: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Parameters on one rank of the first and of the last pipeline stage: L/pp layers (matmuls
    sharded by tp, two norms replicated), the vocab-parallel embedding on the first, the output
    layer (a copy when tied and pp > 1) and the final norm on the last."""
    h, t = lay["h"], lay["tp"]
    attn = h * (h + 2.0 * lay["kv"] * lay["hd"]) + h * h
    mlp = (3.0 if lay["gated"] else 2.0) * h * lay["f"]
    per_layer = (attn + mlp) / t + 2.0 * h
    embed = lay["vocab"] * h / t
    one = lay["pp"] <= 1
    out = np.where(one & lay["tied"], 0.0, embed)
    body = lay["stage_layers"] * per_layer
    first = body + embed + np.where(one, out + h, 0.0)
    last = body + out + h + np.where(one, embed, 0.0)
    return first, last


def _zero_shaped_bytes(lay: dict[str, Any]) -> np.ndarray:
    """Bytes per parameter of ZeRO-2 / ZeRO-3 as the simulator's Megatron rule shapes them (no
    stack's own accounting has them): bf16 weights, fp32 gradients, 12 B of optimizer states."""
    d = lay["shard"]
    return np.where(lay["zero"] >= 3, 18.0 / d, 2.0 + 16.0 / d)


def _megatron_theory(lay: dict[str, Any], act_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(first stage, last stage) bytes of weights + gradients + optimizer + activations (logits
    included) as Megatron-LM's theoretical_memory_usage.py accounts them (MEGATRON_THEORY_SOURCE),
    with the last stage and full recompute in its conventions; activations x ``act_scale``."""
    d, z = lay["shard"], lay["zero"]
    per_param = np.where(z <= 0, 18.0, np.where(z == 1, 6.0 + 12.0 / d, _zero_shaped_bytes(lay)))
    p_first, p_last = _stage_params(lay)
    t, pp, vpp, m = lay["tp"], lay["pp"], lay["vpp"], lay["m"]
    s, b, h, sp, rc = lay["seq"], lay["mbs"], lay["h"], lay["sp"], lay["rc"]
    sbh = s * b * h
    sel_sp = sp & (rc == 1)  # the file's compute_activation_memory branch; else ..._without_sp
    layer = np.where(sel_sp, sbh * (18.0 + 4.0 * lay["f"] / h) / t, sbh * (10.0 + 24.0 / t))
    full = rc == 2
    kept = np.where(full, 2.0 * sbh / np.where(sp, t, 1.0), layer)  # Korthikanti Table 2, full recompute
    working = np.where(full, layer, 0.0)  # the recomputed layer's own activations in its backward
    norm = np.where(sel_sp, 1.0 / t, 1.0)  # the SP branch divides its whole total by tp
    allowance = np.where(sel_sp, 1.0, 1.05)  # the other branch's 5 % overhead factor
    embed_in = (8.0 * s * b + sbh) * norm  # input ids and the embedding dropout mask, per micro-batch
    out = np.where(sel_sp, 4.0 * sbh * (1.0 + lay["vocab"] / h) / t, 2.0 * (s * b * lay["vocab"] / t + sbh))
    interleaved = (vpp > 1) & (pp > 1)
    first = kept * lay["stage_layers"] * pp + embed_in * pp
    first = first * np.where(interleaved, 1.0 + (pp - 1.0) / (pp * vpp), np.where(pp > 1, np.minimum(1.0, m / pp), 1.0))
    first = (first + np.where(pp <= 1, out, 0.0) + working) * allowance
    # the last stage: one micro-batch of its layers in flight with 1F1B; the interleaved last rank's
    # warm-up ((vpp-1)*pp + 1 chunk-micro-batches of L/(pp*vpp) layers); the output layer and loss
    inflight_last = np.where(interleaved, np.minimum((vpp - 1.0) * pp + 1.0, m * vpp) / vpp, 1.0)
    last = (kept * lay["stage_layers"] * inflight_last + out + working) * allowance
    last = np.where(pp <= 1, first, last)
    return p_first * per_param + act_scale * first, p_last * per_param + act_scale * last


def _mindspeed_memory(lay: dict[str, Any], act_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(weights + gradients + optimizer bytes, activation bytes) of stage 0 as MindSpeed's memory
    cost model accounts them (MINDSPEED_SOURCE), activations x ``act_scale``."""
    d, z = lay["shard"], lay["zero"]
    per_param = np.where(z <= 0, 18.0, np.where(z == 1, 10.0 + 8.0 / d, _zero_shaped_bytes(lay)))
    p_first, _ = _stage_params(lay)
    t, pp, vpp, s, b, h, sp = lay["tp"], lay["pp"], lay["vpp"], lay["seq"], lay["mbs"], lay["h"], lay["sp"]
    s_sp = np.where(sp, s / t, s)
    ffn = lay["f"] * (2.0 if lay["gated"] else 1.0)
    linear1 = 2.0 * s * b * ffn / t
    layer = (
        2.0 * (2.0 * s_sp * b * h)  # input and pre-MLP norms
        + 2.0 * s * b * (h + 2.0 * lay["kv"] * lay["hd"]) / t  # linear_qkv
        + 2.0 * s * b * h / t  # core attention (q)
        + 2.0 * s_sp * b * h  # linear_proj
        + linear1
        + linear1 * (0.5 if lay["gated"] else 1.0)  # the activation function
        + 2.0 * s_sp * b * h  # linear_fc2
    )
    full = lay["rc"] == 2
    kept = np.where(full, 2.0 * s_sp * b * h, layer)
    inflight = np.where((vpp > 1) & (pp > 1), (pp * vpp + pp - 1.0) / vpp, pp)
    act = kept * lay["stage_layers"] * inflight + np.where(full, layer, 0.0)
    return p_first * per_param, act_scale * act


def _alloc_waste(size: np.ndarray) -> np.ndarray:
    """Bytes the caching allocator reserves beyond one live tensor of ``size`` bytes: 1-10 MiB
    requests share 20 MiB segments (the remainder split among them), larger ones round up to
    2 MiB; the small pool's 2 MiB blocks are left out."""
    size = np.maximum(size, 1.0)
    per_segment = np.maximum(np.floor(ALLOC_SEGMENT / size), 1.0)
    medium = (ALLOC_SEGMENT - per_segment * size) / per_segment
    large = np.ceil(size / ALLOC_ROUND) * ALLOC_ROUND - size
    return np.where(size <= ALLOC_SMALL, 0.0, np.where(size < ALLOC_MIN_LARGE, medium, large))


def _inflight_first(lay: dict[str, Any]) -> np.ndarray:
    """Micro-batches of its layers the first stage holds (1F1B: min(pp, m); interleaved:
    pp + (pp-1)/vpp), in units of the stage's layers for one micro-batch."""
    pp, vpp, m = lay["pp"], lay["vpp"], lay["m"]
    return np.where((vpp > 1) & (pp > 1), pp + (pp - 1.0) / vpp, np.minimum(pp, m))


def _allocator_gap(lay: dict[str, Any], dynamic: np.ndarray, strength: float) -> np.ndarray:
    """Reserved minus allocated bytes of the caching allocator (CACHING_ALLOCATOR): rounding of
    every live activation tensor plus a split-block share of the dynamic memory ``dynamic``."""
    t, tok, h, sp = lay["tp"], lay["tok"], lay["h"], lay["sp"]
    rep = 2.0 * tok * h / np.where(sp, t, 1.0)  # norm inputs, QKV and MLP inputs
    hid = 2.0 * tok * h / t  # q, the attention output
    kvs = 2.0 * tok * lay["kv"] * lay["hd"] / t  # k, v
    ffn = 2.0 * tok * lay["f"] / t  # gate, up, activation / fc1, GeLU
    n_ffn = 3.0 if lay["gated"] else 2.0
    per_layer = 4.0 * _alloc_waste(rep) + 2.0 * _alloc_waste(hid) + 2.0 * _alloc_waste(kvs) + n_ffn * _alloc_waste(ffn)
    units = lay["stage_layers"] * _inflight_first(lay)
    full = lay["rc"] == 2
    rounding = np.where(full, units * _alloc_waste(rep) + per_layer, units * per_layer)
    split = strength * dynamic * ffn / (ffn + ALLOC_SPLIT_SCALE)
    return rounding + split * np.where(lay["expandable"], ALLOC_EXPANDABLE, 1.0)


def _steps_run(workload: dict) -> float:
    return float(workload.get("warmup_steps", 2) or 0) + float(workload.get("measured_steps", 5) or 0)


@dataclass
class World:
    seed: int
    hardware: dict[str, Any]
    time_factors: dict[str, float]
    mem_factors: dict[str, float]
    value_effects: dict[str, dict[str, float]] = field(default_factory=dict)
    structure: dict[str, float] = field(default_factory=dict)  # family -> strength (STRUCTURE_FAMILIES)
    # the production path (PathOptions): the probe reports its peak only; the share of the nominal
    # memory that is not usable; the words of its out-of-memory failure (None: the lab's)
    peak_only: bool = False
    usable_below: float = 0.0
    oom_format: str | None = None

    @classmethod
    def draw(
        cls, seed: int, hardware: dict[str, Any], space: dict[str, list[Any]], families: tuple[str, ...] = ()
    ) -> "World":
        """A world; ``families`` adds memory terms of those structural families (strength drawn
        from the seed), on top of the coefficient perturbations every world has."""
        world = cls._draw(seed, hardware, space)
        rng = np.random.default_rng([seed, 7])
        world.structure = {f: float(rng.uniform(*STRUCTURE_FAMILIES[f])) for f in families}
        return world

    def on_path(self, options: PathOptions, oom_format: str | None = None) -> "World":
        """This world on a path (``PathOptions``): its usable share below the nominal drawn from the
        seed (a stream of its own: the other draws stay as they were); ``oom_format`` the format of
        this world where the options say "mixed" (the caller spreads them over its worlds)."""
        rng = np.random.default_rng([self.seed, 41])
        self.peak_only = options.peak_only
        self.usable_below = float(rng.uniform(*options.usable_below)) if options.usable_below else 0.0
        fmt = oom_format if options.oom_format == "mixed" else options.oom_format
        if options.oom_format == "mixed" and fmt is None:
            fmt = MIXED_OOM_FORMATS[int(rng.integers(len(MIXED_OOM_FORMATS)))]
        if fmt is not None and fmt not in OOM_FORMATS:
            raise ValueError(f"unknown OOM format {fmt!r}: one of {', '.join(OOM_FORMATS)}")
        self.oom_format = fmt
        return self

    @classmethod
    def _draw(cls, seed: int, hardware: dict[str, Any], space: dict[str, list[Any]]) -> "World":
        rng = np.random.default_rng(seed)
        hw = dict(hardware)
        for key, (lo, hi) in HW_FACTORS.items():
            if key in hw:
                hw[key] = float(hw[key]) * float(rng.uniform(lo, hi))
        for key, (lo, hi) in HW_VALUES.items():
            if key in hw:
                hw[key] = float(rng.uniform(lo, hi))
        effects = {
            name: {repr(v): float(rng.uniform(*VALUE_EFFECTS[name])) for v in space[name]}
            for name in VALUE_EFFECTS
            if name in space
        }
        return cls(
            seed,
            hw,
            {k: float(rng.uniform(*r)) for k, r in TIME_FACTORS.items()},
            {k: float(rng.uniform(*r)) for k, r in MEM_FACTORS.items()},
            effects,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "hardware": self.hardware,
            "time_factors": self.time_factors,
            "mem_factors": self.mem_factors,
            "value_effects": self.value_effects,
            "structure": self.structure,
            "peak_only": self.peak_only,
            "usable_below": self.usable_below,
            "oom_format": self.oom_format,
        }

    def structural_memory(
        self, model: dict, workload: dict, configs: list[dict[str, Any]], p: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(extra GiB per config, usable capacity lost in GiB per config) of the world's structural
        families; zeros without any."""
        n = len(configs)
        extra, lost = np.zeros(n), np.zeros(n)
        col = {
            k: np.array([c.get(k, d) for c in configs])
            for k, d in (("zero_stage", 0), ("micro_batch_size", 1), ("tp", 1), ("pp", 1), ("dp", 1), ("cp", 1))
        }
        mem = lambda k: np.nan_to_num(np.asarray(p[f"mem_{k}"], dtype=float))  # noqa: E731
        for family, strength in self.structure.items():
            if family == "fp32-grads":
                # an unsharded fp32 copy of the gradients: grads of a bf16/fp16 Megatron-style model are
                # priced at 4 (or 2) bytes; the copy is 4 bytes per parameter
                extra += np.where(col["zero_stage"] < 2, strength * mem("weights") * 2.0, 0.0)
            elif family == "alloc-frag":
                alloc = np.array([str(c.get("env.PYTORCH_NPU_ALLOC_CONF", "")) for c in configs])
                base = np.where(
                    np.char.find(alloc, "expandable_segments:True") >= 0,
                    0.25,
                    np.where(np.char.find(alloc, "max_split") >= 0, 0.6, 1.0),
                )
                dynamic = mem("activations") + mem("logits") + mem("zero3_gather")
                extra += strength * base * np.log2(2.0 * col["micro_batch_size"]) * dynamic
            elif family == "usable-below":
                groups = ((col["tp"] > 1) + (col["dp"] > 1) + 2 * (col["pp"] > 1) + (col["cp"] > 1)).astype(float)
                buf = np.array([float(c.get("env.HCCL_BUFFSIZE", 200)) for c in configs]) / 1024.0
                lost += strength + groups * 2.0 * buf
            elif family == "stage-imbalance":
                embed = float(model["vocab_size"]) * float(model["hidden_size"]) / col["tp"]
                extra += np.where(col["pp"] > 1, strength * embed * 8.0 / 2**30, 0.0)
            elif family == "act-extra":
                layers = float(model["num_hidden_layers"]) / col["pp"]
                tokens = float(workload["seq_len"]) / col["cp"] * col["micro_batch_size"]
                inflight = np.minimum(col["pp"], 4)  # micro-batches a first stage holds, roughly
                extra += strength * float(model["hidden_size"]) * tokens * layers * inflight / 2**30
        return extra, lost

    def tracker_terms(self) -> dict[str, float]:
        """The coefficients of "tracker-ooms"' terms (TRACKER_TERMS), drawn from the seed, each times
        the family's strength; empty without the family."""
        if "tracker-ooms" not in self.structure:
            return {}
        rng = np.random.default_rng([self.seed, 35])
        scale = self.structure["tracker-ooms"]
        return {
            k: float(rng.uniform(lo, hi)) * (scale if k != "spike_reuse" else 1.0)
            for k, (lo, hi) in TRACKER_TERMS.items()
        }

    def source_terms(
        self,
        model: dict,
        workload: dict,
        configs: list[dict[str, Any]],
        p: dict[str, np.ndarray],
        part: dict[str, np.ndarray],
    ) -> dict[str, np.ndarray]:
        """The issue #35 (part 3) families' terms: ``extra`` GiB on the peak, ``gap`` GiB the caching
        allocator reserves beyond its allocations (part of the peak), ``time`` seconds added to the
        step; zeros without them. ``part``: the simulator's memory components (GiB) with the world's
        factors, as ``truth`` sums them."""
        n = len(configs)
        out = {"extra": np.zeros(n), "gap": np.zeros(n), "time": np.zeros(n)}
        families = {"megatron-theory", "caching-allocator", "tracker-ooms", "mindspeed"} & set(self.structure)
        if not n or not families:
            return out
        lay = _layout(model, workload, configs)
        dynamic = part["activations"] + part["logits"] + part["zero3_gather"]  # GiB
        with np.errstate(divide="ignore", invalid="ignore"):
            if "megatron-theory" in families:
                first, last = _megatron_theory(lay, self.structure["megatron-theory"])
                replaced = sum(part[k] for k in ("weights", "grads", "optimizer", "activations", "logits"))
                out["extra"] += np.maximum(first, last) / GIB - replaced
            if "mindspeed" in families:
                states, act = _mindspeed_memory(lay, self.structure["mindspeed"])
                replaced = sum(part[k] for k in ("weights", "grads", "optimizer", "activations", "runtime_reserve"))
                out["extra"] += (states + act) / GIB + MINDSPEED_CANN_GIB - replaced
            if "caching-allocator" in families:
                gap = _allocator_gap(lay, dynamic * GIB, self.structure["caching-allocator"]) / GIB
                out["gap"] += gap
                out["extra"] += gap - part["fragmentation"]  # the allocator's gap replaces the flat share
            if "tracker-ooms" in families:
                k = self.tracker_terms()
                p_first, p_last = _stage_params(lay)
                shard = np.where(lay["zero"] >= 1, lay["shard"], 1.0)
                spike = k["step_spike"] * 4.0 * np.maximum(p_first, p_last) / shard / GIB
                spike = np.maximum(0.0, spike - k["spike_reuse"] * dynamic)
                # the fp32 softmax gradient on the last stage lifts the peak by what exceeds the first
                # stage's surplus over the last (the stage balance of the Megatron accounting)
                first, last = _megatron_theory(lay)
                surplus = np.where(lay["pp"] > 1, np.maximum(first - last, 0.0), 0.0) / GIB
                ce = k["ce_fp32"] * 4.0 * lay["tok"] * lay["vocab"] / lay["tp"] / GIB
                ce = np.maximum(0.0, ce - surplus)
                seen = float(np.clip((_steps_run(workload) - 1.0) / 2.0, 0.0, 1.0))
                growth = k["late_growth"] * np.minimum(part["optimizer"], dynamic) * seen
                growth = growth * np.where(lay["expandable"], 0.3, 1.0)
                out["extra"] += growth + np.maximum(spike, ce)
                rc_sp = (lay["rc"] == 2) & lay["sp"] & (lay["tp"] > 1)
                out["time"] += np.where(rc_sp, k["rc_sp_regather"] * part["time_tp_comm"] / 3.0, 0.0)
                few = (lay["vpp"] > 1) & (lay["pp"] > 1)
                pipe = part["time_pp_bubble"] + part["time_pp_p2p"]
                out["time"] += np.where(few, k["interleave_few"] * lay["pp"] / lay["m"] * pipe, 0.0)
        for key in out:
            out[key] = np.nan_to_num(out[key])
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "World":
        return cls(**data)

    def truth(self, model: dict, workload: dict, cluster: dict, configs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        """Noise-free step time, peak memory and whether it fits, for many configs at once."""
        from autotune.workers.simulate import (
            TRAIN_MEM_COMPONENTS,
            TRAIN_TIME_COMPONENTS,
            columns_from_params,
            simulate_configs,
        )

        p = simulate_configs(model, workload, self.hardware, cluster, columns_from_params(configs))
        times = {k: np.nan_to_num(p[f"time_{k}"]) * self.time_factors.get(k, 1.0) for k in TRAIN_TIME_COMPONENTS}
        step = sum(times.values())
        part = {k: np.nan_to_num(p[f"mem_{k}"]) * self.mem_factors.get(k, 1.0) for k in TRAIN_MEM_COMPONENTS}
        source = self.source_terms(model, workload, configs, p, {**part, **{f"time_{k}": v for k, v in times.items()}})
        step = step + source["time"]
        for name, effects in self.value_effects.items():
            step = step * np.array([effects.get(repr(c.get(name)), 1.0) for c in configs])
        if "family-slow" in self.structure:
            group = SLOW_GROUPS[sorted(SLOW_GROUPS)[self.seed % len(SLOW_GROUPS)]]
            step = step * np.array([self.structure["family-slow"] if group(c) else 1.0 for c in configs])
        mem = sum(part.values())
        outside = part["fragmentation"] + part["comm_buffers"] + part["runtime_reserve"]
        extra, lost = self.structural_memory(model, workload, configs, p)
        mem = mem + extra + source["extra"]
        # what a probe reporting max_memory_allocated leaves out: the device's memory outside the
        # allocator, and what the allocator reserves beyond its allocations
        hidden = outside
        if "caching-allocator" in self.structure:
            hidden = part["comm_buffers"] + part["runtime_reserve"] + source["gap"]
        valid = np.asarray(p["valid"], dtype=bool)
        # the device's total: the nominal less what is not usable on this path (0 off the production path)
        capacity = np.asarray(p["memory_limit_gib"], dtype=float) * (1.0 - self.usable_below)
        limit = capacity - lost
        world = np.asarray(p["tokens_per_s"] / p["tokens_per_s_per_device"], dtype=float)
        tokens = float(workload["global_batch_size"]) * float(workload["seq_len"])
        return {
            "step_time_s": np.where(valid, step, np.nan),
            "peak_memory_gib": np.where(valid, mem, np.nan),
            "fits": valid & (mem <= limit),
            "valid": valid,
            "devices": world,
            "tokens_per_s_per_device": np.where(valid, tokens / step / world, np.nan),
            "limit": limit,
            "capacity": capacity,
            "nominal": np.asarray(p["memory_limit_gib"], dtype=float),
            "outside_allocator_gib": np.where(valid, outside, np.nan),
            "unallocated_gib": np.where(valid, hidden, np.nan),
            "allocator_gap_gib": np.where(valid, source["gap"], np.nan),
            # what the runtime and the communicators hold outside the framework's allocator
            "held_outside_gib": np.where(valid, part["comm_buffers"] + part["runtime_reserve"], np.nan),
            # ... of which the runtime's own context, there before any communicator exists
            "runtime_reserve_gib": np.where(valid, part["runtime_reserve"], np.nan),
        }

    def measure(
        self,
        model: dict,
        workload: dict,
        cluster: dict,
        config: dict[str, Any],
        run: int = 0,
        full_steps: int | None = None,
    ) -> dict[str, Any]:
        """One probe: the truth plus noise. The noise is fixed by world, config and ``run`` (the
        trial number): a repeated benchmark sees the same numbers, a re-measurement new noise.
        ``full_steps``: the full probe's timed steps, where the workload times fewer (a short
        re-measurement), whose reading then carries its steps' own spread (``STEP_JITTER``)."""
        t = self.truth(model, workload, cluster, [config])
        if not t["valid"][0]:
            return {"failure": "invalid"}
        if not t["fits"][0]:
            # an allocation partway through the step fails: in use + requested lies between the usable
            # limit and the whole need (a lower bound of it, as in a real allocator message)
            rng = np.random.default_rng([self.seed, run, 99])
            need, usable, capacity = float(t["peak_memory_gib"][0]), float(t["limit"][0]), float(t["capacity"][0])
            if self.oom_format is not None:
                return self._device_oom(t, need, usable, capacity, rng)
            in_use = usable - float(rng.uniform(0.1, 0.6))
            requested = max(0.05, float(rng.uniform(0.3, 1.0)) * (need - in_use))
            # the allocator's own counts leave out what is outside it; "free" is the device's
            outside = float(t["unallocated_gib"][0]) if self.reports_allocated() else 0.0
            if "caching-allocator" in self.structure:  # the allocator's gap so far, not the whole step's
                gap = float(t["allocator_gap_gib"][0])
                outside -= gap * (1.0 - min(1.0, max(0.0, in_use) / need))
            return {
                "failure": "oom",
                "need": need,
                "limit": usable,
                "capacity": capacity,
                "in_use": in_use,
                "requested": requested,
                "allocated": in_use - outside,
            }
        key = json.dumps(config, sort_keys=True, default=str)
        # one draw per trial, or per launch (LAUNCH_NOISE): a profile's launch by its layers per stage
        launch = [int(workload.get(PROFILE_MARK) or 0) + 1] if LAUNCH_NOISE == "launch" else []
        rng = np.random.default_rng([self.seed, int(hashlib.sha256(key.encode()).hexdigest()[:8], 16), run] + launch)
        noise = float(np.clip(rng.normal(1.0, NOISE), 0.9, 1.1))
        if OUTLIER_SHARE and rng.random() < OUTLIER_SHARE:
            noise *= OUTLIER_SLOWDOWN
        steps = int(workload.get("measured_steps") or 1)
        if full_steps and steps < full_steps:  # fewer timed steps average out less of the steps' spread
            jitter = STEP_JITTER * math.sqrt(1.0 / steps - 1.0 / full_steps)
            noise *= 1.0 + jitter * float(np.random.default_rng([self.seed, run, 7] + launch).normal())
        step = float(t["step_time_s"][0]) * noise
        tps_dev = float(t["tokens_per_s_per_device"][0]) / noise
        peak = float(t["peak_memory_gib"][0]) * float(rng.uniform(0.99, 1.01))
        out: dict[str, Any] = {
            "metrics": {
                "step_time_s": step,
                "tokens_per_s_per_device": tps_dev,
                "tokens_per_s": tps_dev * float(t["devices"][0]),
                "peak_memory_gib": peak,
            }
        }
        if self.peak_only:  # the production path: the step time and the peak, nothing else
            if self.reports_allocated():  # the stack's log says which counter it printed
                out["metrics"]["peak_memory_gib"] = peak - float(t["unallocated_gib"][0])
                out["info"] = {"peak_memory_counts": "allocated"}
            return out
        # what a probe on a device reports its allocator could have used (its reserve plus the device's
        # free memory, autotune's USABLE_KEY): the usable memory less what is held outside the allocator
        usable = (float(t["limit"][0]) - float(t["held_outside_gib"][0])) * float(rng.uniform(0.998, 1.002))
        out["info"] = {"usable_memory_gib": usable}
        # ... and the allocator's reserved peak (max_memory_reserved): the device's peak less the same
        out["metrics"]["peak_reserved_gib"] = peak - float(t["held_outside_gib"][0])
        if self.reports_allocated():
            out["metrics"]["peak_memory_gib"] = peak - float(t["unallocated_gib"][0])
            out["info"]["peak_memory_counts"] = "allocated"
        return out

    def _device_oom(
        self, t: dict[str, np.ndarray], need: float, usable: float, capacity: float, rng: np.random.Generator
    ) -> dict[str, Any]:
        """An out-of-memory failure with a real allocator's numbers (``oom_format`` set). Memory grows
        by tensors; the first request larger than what the device still had free fails, so the
        request is one tensor's size (``OOM_REQUEST_GIB``, log-uniform), what was free is less than
        it, and in use (the device's, what it holds outside the usable memory included) + requested
        lies above the device's total by less than the request and, on the scale of the config's
        peak, at most at its need: the message says the config is over, hardly how far."""
        requested = float(np.exp(rng.uniform(*np.log(OOM_REQUEST_GIB))))
        free = float(rng.uniform(max(0.0, requested - (need - usable)), requested))
        in_use = usable - free  # on the scale of the peak: the usable memory less what was still free
        device_in_use = capacity - free  # ... and the device's: what is not usable is in use too
        unallocated = float(t["unallocated_gib"][0])
        if "caching-allocator" in self.structure:  # the allocator's gap so far, not the whole step's
            unallocated -= float(t["allocator_gap_gib"][0]) * (1.0 - min(1.0, max(0.0, in_use) / need))
        allocated = in_use - unallocated
        reserved = max(allocated, in_use - float(t["held_outside_gib"][0]))
        return {
            "failure": "oom",
            "format": self.oom_format,
            "need": need,
            "limit": usable,
            "capacity": capacity,
            "in_use": device_in_use,
            "free": free,
            "requested": requested,
            "allocated": allocated,
            "reserved": reserved,
        }

    def reports_allocated(self) -> bool:
        """Whether a probe reports the allocator's peak (max_memory_allocated), not the device's."""
        return "allocator-peak" in self.structure or "caching-allocator" in self.structure


# The probe's wall time in the benchmark (the in-process worlds take none): a full probe of the spec's
# model 100 s, of which PROBE_STARTUP_SHARE is start-up (process, runtime, communicators, model build:
# what a run of any size pays) and the rest its steps; a memory profile runs 2 steps where the full
# probe runs 6, with its share of the layers; a full probe that runs out of memory, its start-up and its
# steps up to the one that fails (oom_wall_s). The 15 % start-up is an assumption for an NPU cluster,
# stated in benchmarks/README.md; a study measures the real walls (autotune.guide.memory_profile).
FULL_PROBE_WALL_S = 100.0
PROBE_STARTUP_SHARE = 0.15
PROFILE_STEPS_SHARE = 2 / 6
WALL_SCALE_ENV = "AUTOTUNE_BENCH_WALL_SCALE"  # the launcher sleeps this many seconds per modelled 100 s
FULL_LAYERS_ENV = "AUTOTUNE_BENCH_FULL_LAYERS"  # the spec's model's layers (a profile's trial file has fewer)


def probe_wall_s(layers: int, full_layers: int, profiled: bool, steps_share: float = 1.0) -> float:
    """The modelled wall of a probe of ``layers`` layers of a ``full_layers`` model (``steps_share``:
    the share of the full probe's steps a full-size run makes, less than 1 for a short re-measurement)."""
    steps = PROFILE_STEPS_SHARE if profiled else steps_share
    return FULL_PROBE_WALL_S * (PROBE_STARTUP_SHARE + (1 - PROBE_STARTUP_SHARE) * steps * layers / full_layers)


def steps_share(workload: dict, full_measured: int) -> float:
    """The share of a full probe's steps (warm-up and timed) a run of ``workload`` makes, where the
    full probe times ``full_measured`` steps."""
    warmup = float(workload.get("warmup_steps", 2) or 0)
    return (warmup + float(workload.get("measured_steps", 5) or 0)) / (warmup + full_measured)


def oom_wall_s(world: "World", model: dict, workload: dict, cluster: dict, config: dict[str, Any]) -> float:
    """The modelled wall of a full probe that runs out of memory: its start-up and its steps up to the
    one that fails, counted whole (the first whose peak passes the limit: step 1 for most, later where
    memory grows after the first step, ``late_growth``); the launcher exits on the error (autotune stops
    one that does not, ``autotune.workers.command.OOM_EXIT_GRACE_S``)."""
    steps = int(_steps_run(workload))
    failed = steps
    for k in range(1, steps + 1):
        t = world.truth(model, {**workload, "warmup_steps": 0, "measured_steps": k}, cluster, [config])
        if not t["fits"][0]:
            failed = k
            break
    return FULL_PROBE_WALL_S * (PROBE_STARTUP_SHARE + (1 - PROBE_STARTUP_SHARE) * failed / steps)


def oom_message(out: dict[str, Any]) -> str:
    """The words and byte counts of a failed allocation: in the world's format (``OOM_FORMATS``)
    where it has one, else torch_npu's with the lab worlds' numbers."""
    if out.get("format"):
        return "\n".join(oom_lines(out))
    free = max(0.0, out["capacity"] - out["in_use"])
    allocated = out.get("allocated", out["in_use"])
    return (
        f"RuntimeError: NPU out of memory. Tried to allocate {out['requested']:.2f} GiB (NPU 0; "
        f"{out['capacity']:.2f} GiB total capacity; {allocated:.2f} GiB already allocated; "
        f"{allocated:.2f} GiB current active; {free:.2f} GiB free; {allocated:.2f} GiB reserved in "
        f"total by PyTorch)"
    )


def oom_lines(out: dict[str, Any]) -> list[str]:
    """The lines a launcher prints for an out-of-memory failure in ``out["format"]``: each as the
    framework words it (the allocator's GiB with two decimals, MindSpore's MiB and bytes)."""
    fmt = out["format"]
    req, cap, free = out["requested"], out["capacity"], out["free"]
    in_use, alloc, res = out["in_use"], out["allocated"], out["reserved"]
    if fmt == "cuda":
        return [
            "Traceback (most recent call last):",
            '  File "pretrain_gpt.py", line 281, in <module>',
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req:.2f} GiB. GPU 0 has a total "
            f"capacity of {cap:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, this "
            f"process has {in_use:.2f} GiB memory in use. Of the allocated memory {alloc:.2f} GiB is allocated "
            f"by PyTorch, and {res - alloc:.2f} GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        ]
    if fmt == "npu":
        return [
            f"RuntimeError: NPU out of memory. Tried to allocate {req:.2f} GiB (NPU 0; {cap:.2f} GiB total "
            f"capacity; {alloc:.2f} GiB already allocated; {alloc:.2f} GiB current active; {free:.2f} GiB free; "
            f"{res:.2f} GiB reserved in total by PyTorch)"
        ]
    if fmt == "mindspore":
        # MindSpore's pool ("Used": what it holds of the device; the runtime's and the communicators'
        # memory is outside it): in use of it the allocator's reserved share, the request larger than
        # the rest. The split of what is in use into static and dynamic is not modelled: a third static
        mib = lambda gib: int(round(gib * 1024))  # noqa: E731
        static = res / 3
        return [
            "Traceback (most recent call last):",
            "RuntimeError: ",
            "----------------------------------------------------",
            "- Framework Error Message:",
            "----------------------------------------------------",
            f"Out of Memory!!! Request memory size: {int(req * GIB)}B, Memory Statistic:",
            f"Device HBM memory size: {mib(cap)}M",
            f"MindSpore Used memory size: {mib(res + free)}M",
            "MindSpore memory base address: 0x124140000000",
            f"Total Static Memory size: {mib(static)}M",
            f"Total Dynamic memory size: {mib(res - static)}M",
            f"Dynamic memory size of this graph: {mib(res - static)}M",
            "",
            "Please try to reduce 'batch_size' or check whether exists extra large shape. For more details, "
            "please refer to 'Out of Memory' at https://www.mindspore.cn .",
        ]
    if fmt == "vllm":
        return [
            "ERROR 11-26 10:00:00 [core.py:708] EngineCore failed to start.",
            "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    if fmt == "plain":
        return [
            "RuntimeError: CUDA error: out of memory",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
            "below might be incorrect.",
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
        ]
    raise ValueError(f"unknown OOM format {fmt!r}")


def probe_output(out: dict[str, Any]) -> tuple[int, list[str]]:
    """(exit status, output lines) of the launcher for a probe's outcome ``out`` (``World.measure``):
    what it prints, a metrics line or a failure in the framework's words."""
    if out.get("failure") == "oom":
        return 1, oom_message(out).splitlines()
    if out.get("failure"):
        return 2, [json.dumps({"event": "failure", "status": "invalid", "reason": "not a valid config"})]
    return 0, [json.dumps(out)]


def _process_age_s() -> float:
    """Seconds since this process started (Linux: /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


_IMPORTED_AT = time.monotonic()


def main(argv: list[str]) -> int:
    """``TRIAL_FILE [--num-layers N] [--measured-steps N] [--node-rank N]``: one probe in the world
    (``AUTOTUNE_BENCH_WORLD``). With
    ``--node-rank`` the launcher is one node of a multi-node trial: each node runs the same config;
    an OOM or an invalid config fails on every node in the same words; otherwise node 0 prints
    the metrics line and the others print none and exit 0 (the dispatch takes node 0's result)."""
    args = list(argv)
    node_rank = 0
    if "--node-rank" in args:
        i = args.index("--node-rank")
        node_rank = int(args[i + 1])
        del args[i : i + 2]
    steps = None
    if "--measured-steps" in args:  # autotune's {measured_steps}: the timed steps (fewer in a re-measurement)
        i = args.index("--measured-steps")
        steps = int(args[i + 1])
        del args[i : i + 2]
    layers = None
    if "--num-layers" in args:  # autotune's {num_layers}: the model's layers (fewer in a memory profile)
        i = args.index("--num-layers")
        layers = int(args[i + 1])
        del args[i : i + 2]
    trial = json.loads(open(args[0]).read())
    if layers is not None and layers != int(trial["model"]["num_hidden_layers"]):
        print(f"--num-layers {layers} disagrees with the trial file's model", file=sys.stderr, flush=True)
        return 2
    if steps is not None and steps != int(trial["workload"].get("measured_steps") or 0):
        print(f"--measured-steps {steps} disagrees with the trial file's workload", file=sys.stderr, flush=True)
        return 2
    world = World.from_json(json.loads(open(os.environ["AUTOTUNE_BENCH_WORLD"]).read()))
    full_steps = int(os.environ.get(FULL_STEPS_ENV) or trial["workload"].get("measured_steps") or 1)
    out = world.measure(
        trial["model"], trial["workload"], trial["cluster"], trial["params"], int(trial.get("number", 0)), full_steps
    )
    scale = float(os.environ.get(WALL_SCALE_ENV) or 0)
    if scale > 0:  # as long as the modelled probe, scaled: a study's walls (its profiles' cost) stay in proportion
        layers = int(trial["model"]["num_hidden_layers"])
        full = int(os.environ.get(FULL_LAYERS_ENV) or layers)
        profiled = PROFILE_MARK in trial["workload"]
        wall = probe_wall_s(layers, full, profiled, steps_share(trial["workload"], full_steps))
        if out.get("failure") == "oom" and not profiled:  # it ends at the step that fails
            wall = oom_wall_s(world, trial["model"], trial["workload"], trial["cluster"], trial["params"])
        # the process's own start-up (interpreter, imports) is part of the wall: sleep only the rest
        time.sleep(max(0.0, scale * wall / FULL_PROBE_WALL_S - _process_age_s()))
    rc, lines = probe_output(out)
    if rc == 0 and node_rank != 0:
        print(f"node {node_rank}: step done", file=sys.stderr, flush=True)
        return 0
    for line in lines:
        print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
