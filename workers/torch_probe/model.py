"""A compact Llama decoder (RMSNorm, RoPE, GQA, SwiGLU, SDPA) written for parallelisation.

Why in-repo rather than transformers (see README): torchtitan's recipes (DTensor TP plans,
manual pipeline split, per-block FSDP/checkpoint/compile) need a model whose module names and
forward signatures are stable and simple — attention that infers the local head count from its
input (so Colwise-sharded q/k/v just work), layers in a ``ModuleDict`` keyed by global index (so a
pipeline stage keeps the FQNs of the whole model), optional embedding/norm/head (so a stage is
the same class), and a forward that takes tensors only. transformers' Llama carries caches,
masks, config objects and kwargs through every layer, changes across versions, and would make the
probe depend on a 100 MB package for ~150 lines of math.

``arch: gpt`` swaps RMSNorm→LayerNorm and SwiGLU→GeLU MLP (two matrices); RoPE is kept (the
position-embedding choice does not change the cost being measured).

Initialisation is decomposition-invariant: every parameter is drawn from a generator seeded by
its name, as a full tensor, and each rank keeps only its shard. So a tp2/pp2/FSDP run starts from
exactly the single-process weights and their losses can be compared, while at most one full
parameter (never the whole model) exists on a rank at a time.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .plan import ModelConfig

__all__ = ["Transformer", "init_weights", "synthetic_tokens", "clean_fqn"]

# Prefixes that wrappers add to parameter names (checkpoint_wrapper, torch.compile's
# OptimizedModule, DDP); the init seed must see the model's own name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_fqn(fqn: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


class Linear(nn.Linear):
    """nn.Linear without its own init: modules are built on the meta device and filled by
    ``init_weights`` (meta-device random init would also import torch._dynamo, ~1 s per rank)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its own init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight).type_as(x)


def _norm(cfg: ModelConfig) -> nn.Module:
    return (
        RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.hidden_size, cfg.norm_eps)
    )


def rope_tables(head_dim: int, length: int, theta: float, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout
    return angles.cos(), angles.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA attention. Head counts are inferred from the projections' outputs, so the module works
    unchanged when tensor parallelism gives each rank a slice of the heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.wq = Linear(h, cfg.num_attention_heads * hd, bias=False)
        self.wk = Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.wv = Linear(h, cfg.num_key_value_heads * hd, bias=False)
        self.wo = Linear(cfg.num_attention_heads * hd, h, bias=False)
        self.recompute_core = False  # selective recompute (parallelize.apply_recompute)
        self.cp_group: Any = None  # context parallel (parallelize.apply_cp)
        self.cache: tuple[torch.Tensor, torch.Tensor] | None = None  # inference KV cache

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos0: int = 0) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, cos, sin, pos0, use_reentrant=False)
        else:
            out = self._core(q, k, v, cos, sin, pos0)
        return self.wo(out.reshape(b, s, -1))

    def _core(self, q, k, v, cos, sin, pos0: int) -> torch.Tensor:
        """RoPE + scaled-dot-product attention: the part Megatron's "selective" recompute redoes."""
        s = q.shape[1]
        q = _rope(q, cos[pos0 : pos0 + s], sin[pos0 : pos0 + s]).transpose(1, 2)
        k = _rope(k, cos[pos0 : pos0 + s], sin[pos0 : pos0 + s]).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.cache is not None:
            k_cache, v_cache = self.cache
            k_cache[:, :, pos0 : pos0 + s] = k
            v_cache[:, :, pos0 : pos0 + s] = v
            k, v = k_cache[:, :, : pos0 + s], v_cache[:, :, : pos0 + s]
        if self.cp_group is not None:
            # Context parallel, all-gather flavour (as in Llama 3 training): every rank keeps its
            # queries and sees the whole sequence's keys/values; gradients flow back through the
            # gather as a reduce-scatter.
            from torch.distributed._functional_collectives import all_gather_tensor_autograd

            k = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=self.cp_group)
            v = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=self.cp_group)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        kv_len = k.shape[2]
        if s == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        elif kv_len == s and pos0 == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # queries start at absolute position pos0, keys at 0
            qpos = torch.arange(pos0, pos0 + s, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= qpos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.arch == "llama"
        self.w1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        if self.gated:
            self.w3 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = _norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = _norm(cfg)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos0: int = 0) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, pos0)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. A pipeline stage is the same class with some of ``tok_embeddings``, ``norm``,
    ``output`` set to None and only its layers left in ``layers`` (keys are global indices)."""

    def __init__(self, cfg: ModelConfig, rope_len: int | None = None, tie: bool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope_len = max(cfg.max_position_embeddings, rope_len or 0)
        self.tok_embeddings: nn.Module | None = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.num_hidden_layers)})
        self.norm: nn.Module | None = _norm(cfg)
        self.output: nn.Module | None = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tied = cfg.tie_word_embeddings if tie is None else tie
        if self.tied:
            self.output.weight = self.tok_embeddings.weight
        # Filled by init_weights (built on meta, the tables would be garbage after to_empty anyway).
        self.register_buffer("rope_cos", torch.empty(self.rope_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.rope_len, cfg.head_dim), persistent=False)
        self.pos_offset = 0  # first position of this rank's tokens (context parallel)
        self.clone_embedding = False  # see parallelize.apply_compile

    def forward(self, tokens: torch.Tensor, pos0: int | None = None) -> torch.Tensor:
        pos0 = self.pos_offset if pos0 is None else pos0
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.clone_embedding and self.tok_embeddings is not None:
            h = h.clone()
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin, pos0)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def set_kv_cache(self, batch: int | None, max_len: int = 0, dtype: Any = None) -> None:
        """Allocate (or, with ``batch=None``, drop) a static KV cache in every attention module,
        sized by the module's local (tensor-parallel) kv heads."""
        for layer in self.layers.values():
            attn = layer.attention
            if batch is None:
                attn.cache = None
                continue
            weight = attn.wk.weight
            local_out = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
            shape = (batch, local_out // attn.head_dim, max_len, attn.head_dim)
            dev = self.rope_cos.device
            attn.cache = (torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))


def _std_for(fqn: str, cfg: ModelConfig) -> float | None:
    """None: a norm (weight 1, bias 0). Output projections of each residual branch get the
    GPT-2 / Megatron scaled init 0.02/sqrt(2·layers)."""
    if "norm" in fqn:
        return None
    if fqn.endswith("wo.weight") or fqn.endswith("w2.weight"):
        return 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    return 0.02


def _local_slices(param: torch.Tensor, shape: torch.Size) -> tuple[slice, ...] | None:
    """This rank's slice of the global tensor for a DTensor parameter (None: not sharded)."""
    if not hasattr(param, "device_mesh"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Fill every (materialised, possibly sharded) parameter from its name-seeded full tensor and
    recompute the RoPE tables (buffers come out of ``to_empty`` uninitialised)."""
    for fqn, param in model.named_parameters():
        name = clean_fqn(fqn)
        local = param.to_local() if hasattr(param, "to_local") else param
        std = _std_for(name, cfg)
        if std is None:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        gen = torch.Generator(device=local.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        full.normal_(0.0, std, generator=gen)
        slices = _local_slices(param, param.shape)
        local.copy_(full[slices] if slices is not None else full)
        del full
    for module in model.modules():
        if isinstance(module, Transformer):
            cos, sin = rope_tables(module.cfg.head_dim, module.rope_len, module.cfg.rope_theta, module.rope_cos.device)
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)


def synthetic_tokens(step: int, batch: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``(batch, seq_len + 1)`` token ids for one step of the *global* batch, the same on every
    rank and for every parallel decomposition (each rank slices its share).

    Each sequence is an arithmetic progression modulo the vocabulary (random start and stride), so
    next-token prediction is learnable from context and the loss visibly falls in a few steps.
    """
    gen = torch.Generator().manual_seed(seed * 7919 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 17, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len + 1)[None, :]) % vocab
