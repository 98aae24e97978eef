"""Model architectures: presets, Hugging Face ``config.json`` files and explicit fields.

A model is described with Hugging Face's field names plus ``arch`` (llama | gpt), so a
``config.json`` from the Hub drops in unchanged. Presets carry the published architectures of the
models teams tune most; ``tiny-llama`` is small enough for real CPU probes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ModelSpec", "PRESETS", "MODEL_ALIASES", "load_hf_config"]


class ModelSpec(BaseModel):
    """Decoder architecture, Hugging Face field names."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="label used in reports and the result cache")
    arch: Literal["llama", "gpt"] = Field(
        "llama", description="llama: SwiGLU, RMSNorm, RoPE, GQA; gpt: GeLU MLP, LayerNorm"
    )
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(None, gt=0, description="GQA groups; default = num_attention_heads")
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(4096, gt=0)
    tie_word_embeddings: bool = False
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base (Llama-3: 500000); exported as --rotary-base")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon; exported as --norm-epsilon")
    path: str | None = Field(
        None,
        description="the checkpoint folder a serving engine loads, as the serving nodes see it (vLLM serves it "
        "instead of dummy weights from this config; MindIE needs it)",
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelSpec":
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        return self

    def aliases(self) -> dict[str, int]:
        """Short names constraint expressions may use (docs/ARCHITECTURE.md, "Model fields")."""
        return {
            "layers": self.num_hidden_layers,
            "heads": self.num_attention_heads,
            "kv_heads": int(self.num_key_value_heads or self.num_attention_heads),
            "hidden": self.hidden_size,
            "ffn": self.intermediate_size,
            "vocab": self.vocab_size,
        }

    def num_parameters(self) -> int:
        """Parameter count (embeddings included), for summaries and FLOP estimates."""
        h, f, v, layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        kv = int(self.num_key_value_heads or self.num_attention_heads)
        head_dim = h // self.num_attention_heads
        attn = h * h * 2 + 2 * h * kv * head_dim
        mlp = 3 * h * f if self.arch == "llama" else 2 * h * f
        norms = 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return layers * (attn + mlp + norms) + embed + h


MODEL_ALIASES = ("layers", "heads", "kv_heads", "hidden", "ffn", "vocab")

# Published architectures (Hugging Face config.json of each model).
PRESETS: dict[str, dict] = {
    "llama2-7b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-13b": dict(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        intermediate_size=13824,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama2-70b": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "llama3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # Small enough to train for real on two CPU processes in seconds.
    "tiny-llama": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=1024,
    ),
}

_HF_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
)


def load_hf_config(path: Path) -> dict:
    """The fields autotune needs from a Hugging Face ``config.json`` (other fields are ignored:
    the file belongs to the model, not to the spec)."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    model_type = str(data.get("model_type", "llama")).lower()
    fields = {k: data[k] for k in _HF_FIELDS if data.get(k) is not None}
    if "n_embd" in data:  # GPT-2 style names
        fields.setdefault("hidden_size", data["n_embd"])
        fields.setdefault("num_hidden_layers", data.get("n_layer"))
        fields.setdefault("num_attention_heads", data.get("n_head"))
        fields.setdefault("intermediate_size", data.get("n_inner") or 4 * data["n_embd"])
        fields.setdefault("max_position_embeddings", data.get("n_positions", 1024))
    fields["arch"] = "llama" if model_type in ("llama", "mistral", "qwen2", "internlm2", "baichuan") else "gpt"
    fields["name"] = str(data.get("_name_or_path") or path.parent.name or "hf-model")
    return fields
