"""Metric definitions and derivations, checked against hand computations and published MFUs."""

from __future__ import annotations

import dataclasses

import pytest
from autotune.objectives import METRICS, Metric, derive_metrics, flops_per_token, get_metric

GPT22B = dict(
    arch="gpt",
    hidden_size=6144,
    num_hidden_layers=48,
    num_attention_heads=64,
    num_key_value_heads=64,
    intermediate_size=4 * 6144,
    vocab_size=51200,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
MPT7B = dict(
    arch="gpt",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=16384,
    vocab_size=50432,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
LLAMA3_8B = dict(
    arch="llama",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=8192,
)
A100 = {"device_memory_gib": 80.0, "peak_tflops": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}}


def test_metric_table():
    for name in (
        "tokens_per_s_per_device",
        "tokens_per_s",
        "samples_per_s",
        "step_time_s",
        "mfu",
        "peak_memory_gib",
        "memory_headroom_gib",
        "ttft_ms",
        "decode_tokens_per_s",
        "time_for_100_tokens_s",
    ):
        assert METRICS[name].name == name
    assert get_metric("memory_headroom") is get_metric("memory_headroom_gib")
    assert get_metric("step_time_s").direction == "minimize"
    assert get_metric("mfu").direction == "maximize"
    assert get_metric("ttft_ms").workload == "infer"
    with pytest.raises(dataclasses.FrozenInstanceError):
        METRICS["mfu"].unit = "%"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Metric("x", "s", "up", "train", "")


def test_unknown_metric_lists_known():
    with pytest.raises(ValueError) as exc:
        get_metric("tokens")
    assert "tokens_per_s_per_device" in str(exc.value) and "ttft_ms" in str(exc.value)


def test_megatron_formula_for_gpt():
    """Narayanan et al. 2021: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*h*l)) per batch of B sequences."""
    h, layers, v, s = 6144, 48, 51200, 2048
    megatron = 72 * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    assert flops_per_token(GPT22B, s) == pytest.approx(megatron, rel=1e-12)
    assert flops_per_token(GPT22B, s, training=False) == pytest.approx(megatron / 3, rel=1e-12)


def test_llama_gqa_by_hand():
    h, kv_dim, f, layers, v, s = 4096, 8 * 128, 14336, 32, 128256, 8192
    per_layer = h * (h + 2 * kv_dim) + h * h + 3 * h * f
    expected = 3 * (2 * (layers * per_layer + v * h) + 4 * layers * h * s)
    assert flops_per_token(LLAMA3_8B, s) == pytest.approx(expected, rel=1e-12)


def test_published_mfu_reproduced():
    """llm-foundry's MPT-7B row: 4641 tokens/s/GPU on A100 is MFU 0.6423 with the same accounting."""
    out = derive_metrics(
        {"step_time_s": 96 * 2048 / (8 * 4641)},
        MPT7B,
        {"kind": "train", "seq_len": 2048, "global_batch_size": 96},
        A100,
        8,
        "bf16",
    )
    assert out["tokens_per_s_per_device"] == pytest.approx(4641, rel=1e-9)
    assert out["mfu"] == pytest.approx(0.6423, abs=0.003)


def test_derive_metrics_train():
    workload = {"kind": "train", "seq_len": 1024, "global_batch_size": 32}
    out = derive_metrics({"step_time_s": 2.0, "peak_memory_gib": 50.0}, MPT7B, workload, A100, 8, "bf16")
    assert out["tokens_per_s"] == pytest.approx(32 * 1024 / 2.0)
    assert out["tokens_per_s_per_device"] == pytest.approx(32 * 1024 / 2.0 / 8)
    assert out["samples_per_s"] == pytest.approx(16.0)
    assert out["memory_headroom_gib"] == pytest.approx(30.0)
    expected_mfu = flops_per_token(MPT7B, 1024) * out["tokens_per_s_per_device"] / 312e12
    assert out["mfu"] == pytest.approx(expected_mfu)


def test_derive_metrics_keeps_reported_values():
    workload = {"kind": "train", "seq_len": 1024, "global_batch_size": 32}
    raw = {"step_time_s": 2.0, "tokens_per_s": 1.0, "mfu": 0.5}
    out = derive_metrics(raw, MPT7B, workload, A100, 8, "bf16")
    assert out["tokens_per_s"] == 1.0 and out["mfu"] == 0.5
    assert "samples_per_s" in out and raw == {"step_time_s": 2.0, "tokens_per_s": 1.0, "mfu": 0.5}


def test_derive_metrics_from_throughput_only():
    workload = {"kind": "train", "seq_len": 1024, "global_batch_size": 32}
    out = derive_metrics({"tokens_per_s": 16384.0}, MPT7B, workload, A100, 8, "bf16")
    assert out["step_time_s"] == pytest.approx(2.0)
    assert out["tokens_per_s_per_device"] == pytest.approx(2048.0)


def test_derive_metrics_infer():
    workload = {"kind": "infer", "prompt_len": 128, "gen_len": 128}
    out = derive_metrics(
        {"ttft_ms": 50.0, "decode_tokens_per_s": 400.0, "batch_size": 4, "peak_memory_gib": 20.0},
        MPT7B,
        workload,
        A100,
        1,
        "bf16",
    )
    assert out["time_for_100_tokens_s"] == pytest.approx(0.05 + 100 * 4 / 400.0)
    assert out["memory_headroom_gib"] == pytest.approx(60.0)
    assert "mfu" not in out
