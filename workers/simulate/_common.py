"""Shared pieces of the analytical model: the model shape, the hardware numbers, the roofline
GEMM, collectives and the rank layout. Everything works on numpy arrays of N configs.

Rank order (Megatron-LM's default): tp innermost, then cp, then dp, pp outermost. Rank
r = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)). A group therefore spans nodes when the
product of its own size and the sizes inside it exceeds devices_per_node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

GIB = float(1 << 30)


@dataclass(frozen=True)
class Shape:
    """The transformer's dimensions, from Hugging Face field names."""

    arch: str
    h: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: float
    ffn: float
    vocab: float
    tied: bool
    max_pos: float

    @classmethod
    def of(cls, model: Mapping[str, Any]) -> "Shape":
        arch = str(model.get("arch", "llama")).lower()
        if arch not in ("llama", "gpt"):
            raise ValueError(f"model arch must be llama or gpt, got {arch!r}")
        h = int(model["hidden_size"])
        heads = int(model["num_attention_heads"])
        kv = int(model.get("num_key_value_heads") or heads)
        return cls(
            arch,
            float(h),
            int(model["num_hidden_layers"]),
            heads,
            kv,
            h / heads,
            float(model["intermediate_size"]),
            float(model["vocab_size"]),
            bool(model.get("tie_word_embeddings", False)),
            float(model.get("max_position_embeddings") or 4096),
        )

    @property
    def qkv_out(self) -> float:
        """Output width of the fused QKV projection (GQA-aware)."""
        return self.h + 2.0 * self.kv_heads * self.head_dim

    @property
    def mlp_in_out(self) -> float:
        """Output width of the first MLP matmul: gate+up for SwiGLU, fc1 for GeLU."""
        return (2.0 if self.arch == "llama" else 1.0) * self.ffn

    def layer_params(self, tp: np.ndarray) -> np.ndarray:
        """Parameters of one layer held by one TP rank (matmul weights sharded, norms and the
        row-parallel biases replicated)."""
        h, f = self.h, self.ffn
        sharded = self.h * self.qkv_out + h * h + (3.0 if self.arch == "llama" else 2.0) * h * f
        if self.arch == "llama":
            return sharded / tp + 2.0 * h  # two RMSNorm weights
        # GPT: LayerNorm weight+bias x2, proj and fc2 biases replicated; qkv and fc1 biases sharded
        return (sharded + self.qkv_out + f) / tp + 6.0 * h


@dataclass(frozen=True)
class HW:
    """Hardware numbers in SI units (FLOP/s, bytes/s, s), from a profile dict."""

    accelerator: str
    mem_bytes: float
    peak: dict
    bw: float
    intra: float
    ar_eff: float
    ag_eff: float
    inter: float
    dpn: int
    alpha: float
    tp_alpha: float  # latency of a tensor-parallel collective in a layer step (calibrated), else alpha
    launch: float
    optimizer_tensor: float  # host seconds per parameter tensor of an optimizer step (calibrated), else 0
    gemm_eff: float
    half_dim: float
    fa_eff: float
    reserve: float
    hccl: bool
    comm_mib: float
    frag_default: float
    frag_expandable: float
    overlap_slowdown: float
    # a serving engine's steps as `autotune calibrate --serving` measured them on this host (the
    # profile's serving_steps): factors on the model's decode and prompt parts of a step, a fixed
    # cost per step, one per decoding sequence and one per token of its context, and a request's
    # latency outside the steps; (1, 1, 0, 0, 0, 0) where nothing was measured
    serve_decode: float = 1.0
    serve_prefill: float = 1.0
    serve_step: float = 0.0
    serve_seq: float = 0.0
    serve_ctx: float = 0.0
    serve_tok: float = 0.0  # a prompt token's cost in a step: a CPU's prefill is linear in its tokens
    serve_latency: float = 0.0  # a request's wait outside the engine's steps (TTFT only, no capacity)

    @property
    def serving_calibrated(self) -> bool:
        """Whether the engine's steps are corrected (the latency outside them is added where it applies)."""
        return (
            self.serve_decode,
            self.serve_prefill,
            self.serve_step,
            self.serve_seq,
            self.serve_ctx,
            self.serve_tok,
        ) != (1.0, 1.0, 0.0, 0.0, 0.0, 0.0)

    @classmethod
    def of(cls, hw: Mapping[str, Any], cluster: Mapping[str, Any]) -> "HW":
        """The figures a trial on ``cluster`` pays; across nodes, the link measured at its node count
        where ``autotune calibrate --nodes`` measured one (:func:`~autotune.workers.hardware.links_at`)."""
        from ..hardware import links_at

        peaks = {k: float(v) * 1e12 for k, v in hw["peak_tflops"].items()}
        inter = float(hw["inter_node_bandwidth_gbps"]) * 1e9 * float(hw["inter_node_efficiency"])
        alpha = float(hw["collective_latency_us"]) * 1e-6
        link = links_at(dict(hw), int(cluster.get("nodes") or 1))
        steps = hw.get("serving_steps") or {}
        if link is not None:  # measured end to end: the link's efficiency is in the figure
            inter = float(link[1]["bandwidth_gbps"]) * 1e9
            alpha = max(alpha, float(link[1]["latency_us"]) * 1e-6)
        return cls(
            accelerator=str(hw.get("accelerator", cluster.get("accelerator", "cuda"))),
            mem_bytes=float(hw["device_memory_gib"]) * GIB,
            peak=peaks,
            bw=float(hw["memory_bandwidth_gbps"]) * 1e9 * float(hw["memory_bandwidth_efficiency"]),
            intra=float(hw["intra_node_bandwidth_gbps"]) * 1e9,
            ar_eff=float(hw["allreduce_efficiency"]),
            ag_eff=float(hw["allgather_efficiency"]),
            inter=inter,
            dpn=int(cluster.get("devices_per_node") or hw["devices_per_node"]),
            alpha=alpha,
            tp_alpha=float(hw.get("tp_collective_latency_us", hw["collective_latency_us"])) * 1e-6,
            launch=float(hw["kernel_launch_us"]) * 1e-6,
            optimizer_tensor=float(hw.get("optimizer_us_per_tensor", 0.0)) * 1e-6,
            gemm_eff=float(hw["gemm_efficiency"]),
            half_dim=float(hw["gemm_half_dim"]),
            fa_eff=float(hw["flash_attention_efficiency"]),
            reserve=float(hw["runtime_reserve_gib"]) * GIB,
            hccl=hw.get("comm_buffer_model") == "hccl",
            comm_mib=float(hw.get("comm_buffer_mib_per_comm", 0.0)),
            frag_default=float(hw["fragmentation_default"]),
            frag_expandable=float(hw["fragmentation_expandable"]),
            overlap_slowdown=float(hw.get("comm_overlap_slowdown", 0.0)),
            serve_decode=float(steps.get("decode_scale", 1.0)),
            serve_prefill=float(steps.get("prefill_scale", 1.0)),
            serve_step=float(steps.get("step_overhead_us", 0.0)) * 1e-6,
            serve_seq=float(steps.get("sequence_overhead_us", 0.0)) * 1e-6,
            serve_ctx=float(steps.get("context_overhead_ns", 0.0)) * 1e-9,
            serve_tok=float(steps.get("prompt_token_overhead_ns", 0.0)) * 1e-9,
            serve_latency=float(steps.get("request_latency_us", 0.0)) * 1e-6,
        )

    def peak_of(self, precision_code: np.ndarray) -> np.ndarray:
        """Dense matmul peak (FLOP/s) for the precision codes 0 bf16, 1 fp16, 2 fp32."""
        table = np.array([self.peak["bf16"], self.peak["fp16"], self.peak["fp32"]])
        return table[precision_code.astype(np.int64)]


def gemm_time(hw: HW, peak: np.ndarray, m, k, n, elem_bytes, weight_bytes=None, batch=1.0) -> np.ndarray:
    """Seconds for ``batch`` GEMMs of (m x k) @ (k x n): a roofline with a size-dependent
    efficiency. Compute runs at peak * gemm_efficiency * prod(d / (d + half_dim)) - the
    under-filled tiles and partial waves of thin shapes; memory time moves the operands once
    (``weight_bytes`` per element of the k x n operand, for quantised weights). The slower of the
    two wins. Device time only: the callers account kernel launches per layer.
    """
    hd = hw.half_dim
    util = (m / (m + hd)) * (k / (k + hd)) * (n / (n + hd))
    flops = 2.0 * m * k * n * batch
    t_compute = flops / (peak * hw.gemm_eff * util)
    wb = elem_bytes if weight_bytes is None else weight_bytes
    moved = batch * (elem_bytes * (m * k + m * n) + wb * k * n)
    return np.maximum(t_compute, moved / hw.bw)


def group_bandwidth(hw: HW, size: np.ndarray, inner: np.ndarray, eff: float) -> np.ndarray:
    """Bus bandwidth (bytes/s) of a collective over ``size`` ranks placed with stride ``inner``.

    Inside a node: the intra-node link times the collective's measured efficiency. Across nodes
    (size * inner > devices_per_node): each node takes part with dpn/inner of the group's ranks,
    each driving its own NIC, so the inter-node share is that many NICs (hierarchical rings,
    as NCCL and HCCL build them), never more than the intra-node figure.
    """
    intra = hw.intra * eff
    spans = size * inner > hw.dpn
    local = np.clip(hw.dpn / np.maximum(inner, 1.0), 1.0, size)
    return np.where(spans, np.minimum(intra, local * hw.inter), intra)


def allreduce(nbytes, size, bw, alpha):
    """Ring all-reduce: 2(g-1)/g of the buffer through the bus, plus start-up latency."""
    return np.where(size > 1, 2.0 * (size - 1) / size * nbytes / bw + 2.0 * alpha, 0.0)


def allgather(nbytes, size, bw, alpha):
    """All-gather or reduce-scatter of a buffer of ``nbytes`` (the full, gathered size)."""
    return np.where(size > 1, (size - 1) / size * nbytes / bw + alpha, 0.0)


def quant_weight_bytes(quant: np.ndarray, elem_bytes: np.ndarray) -> np.ndarray:
    """Bytes per matmul weight by quantization code (0 none, 1 int8, 2 w8a8, 3 int4): the
    compute dtype, 1 B for the int8 schemes, 0.5 B plus one fp16 scale per group of 128 for int4
    (GPTQ / AWQ layout). The embedding and the output layer stay in the compute dtype."""
    return np.select([quant == 1, quant == 2, quant == 3], [1.0, 1.0, 0.5 + 2.0 / 128.0], default=elem_bytes)


def quant_peak(hw: HW, quant: np.ndarray, precision: np.ndarray) -> np.ndarray:
    """Matmul peak of a quantization scheme: w8a8 runs its GEMMs at the int8 peak; weight-only
    schemes dequantise to the compute dtype and run at its peak."""
    return np.where(quant == 2, hw.peak.get("int8", 2.0 * hw.peak["bf16"]), hw.peak_of(precision))
