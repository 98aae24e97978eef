"""A Llama decoder in MindSpore (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU),
built from the model spec's Hugging Face field names with random weights. Imports only
MindSpore and numpy (it runs in MindSpore's own environment)."""

from __future__ import annotations

import math

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), ms.float32), name="weight")
        self.eps = eps

    def construct(self, x):
        xf = x.astype(ms.float32)
        y = xf * ops.rsqrt(ops.mean(xf * xf, -1, True) + self.eps)
        return (y * self.weight).astype(x.dtype)


def _dense(n_in: int, n_out: int, std: float) -> nn.Dense:
    return nn.Dense(n_in, n_out, weight_init=Normal(std), has_bias=False)


class CoreAttention(nn.Cell):
    """softmax(q·kᵀ/√d + causal mask)·v: the part selective recompute recomputes (the largest
    activations for the least compute), as Megatron's selective recompute does."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)

    def construct(self, q, k, v, mask):
        scores = ops.matmul(q, k.swapaxes(-1, -2)).astype(ms.float32) * self.scale + mask
        probs = ops.softmax(scores, -1).astype(q.dtype)
        return ops.matmul(probs, v)


class Attention(nn.Cell):
    def __init__(self, h: int, heads: int, kv_heads: int, std: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, h // heads
        self.wq = _dense(h, heads * self.head_dim, std)
        self.wk = _dense(h, kv_heads * self.head_dim, std)
        self.wv = _dense(h, kv_heads * self.head_dim, std)
        self.wo = _dense(heads * self.head_dim, h, std)
        self.core = CoreAttention(self.head_dim)
        self.rep = heads // kv_heads

    def _rope(self, x, cos, sin):
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + ops.cat((-x2, x1), -1) * sin

    def construct(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.heads, self.head_dim).swapaxes(1, 2)
        k = self.wk(x).reshape(b, s, self.kv_heads, self.head_dim).swapaxes(1, 2)
        v = self.wv(x).reshape(b, s, self.kv_heads, self.head_dim).swapaxes(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.rep > 1:
            k = ops.repeat_interleave(k, self.rep, 1)
            v = ops.repeat_interleave(v, self.rep, 1)
        o = self.core(q, k, v, mask).swapaxes(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.wo(o)


class MLP(nn.Cell):
    def __init__(self, h: int, ffn: int, std: float):
        super().__init__()
        self.w1, self.w3, self.w2 = _dense(h, ffn, std), _dense(h, ffn, std), _dense(ffn, h, std)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: dict, std: float):
        super().__init__()
        h, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-5))
        heads = int(cfg["num_attention_heads"])
        self.attn_norm, self.mlp_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.attention = Attention(h, heads, int(cfg.get("num_key_value_heads") or heads), std)
        self.mlp = MLP(h, int(cfg["intermediate_size"]), std)

    def construct(self, x, cos, sin, mask):
        x = x + self.attention(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Cell):
    """Token ids (batch, seq) -> logits (batch·seq, vocab). The loss is computed outside, in
    float32: mixed precision (``auto_mixed_precision``) casts the whole cell, and MindSpore's
    cross-entropy takes no bf16."""

    def __init__(self, cfg: dict, seq_len: int, seed: int = 0):
        super().__init__()
        ms.set_seed(seed)
        h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        heads = int(cfg["num_attention_heads"])
        std = 0.02
        self.embed = nn.Embedding(vocab, h, embedding_table=Normal(std))
        self.layers = nn.CellList([DecoderLayer(cfg, std) for _ in range(int(cfg["num_hidden_layers"]))])
        self.norm = RMSNorm(h, float(cfg.get("rms_norm_eps", 1e-5)))
        self.head = _dense(h, vocab, std)
        self.vocab = vocab
        head_dim = h // heads
        theta = float(cfg.get("rope_theta", 10000.0))
        inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        freqs = np.outer(np.arange(seq_len, dtype=np.float32), inv)
        emb = np.concatenate([freqs, freqs], -1)
        self.cos = Tensor(np.cos(emb)[None, None], ms.float32)
        self.sin = Tensor(np.sin(emb)[None, None], ms.float32)
        mask = np.triu(np.full((seq_len, seq_len), -1e9, dtype=np.float32), 1)
        self.mask = Tensor(mask[None, None], ms.float32)

    def construct(self, tokens):
        x = self.embed(tokens)
        cos, sin = self.cos.astype(x.dtype), self.sin.astype(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, self.mask)
        return self.head(self.norm(x)).reshape(-1, self.vocab)


def apply_recompute(net: Llama, mode: str) -> str:
    """full: every decoder layer recomputes its forward in backward; selective: only the core
    attention (Cell.recompute, MindSpore's activation checkpointing)."""
    if mode == "full":
        for layer in net.layers:
            layer.recompute()
        return f"full recompute of {len(net.layers)} decoder layers"
    if mode == "selective":
        for layer in net.layers:
            layer.attention.core.recompute()
        return "selective recompute: core attention of every layer"
    return "no recompute"
