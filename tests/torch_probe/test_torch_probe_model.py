"""The model in one process: KV-cache decode equals the full forward, the init does not depend on
how the model is cut, recompute lowers activation memory, synthetic data is reproducible."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from autotune.workers.torch_probe.measure import peak_allocated_bytes  # noqa: E402
from autotune.workers.torch_probe.model import Transformer, init_weights, synthetic_tokens  # noqa: E402
from autotune.workers.torch_probe.parallelize import (  # noqa: E402
    ParallelModel,
    apply_recompute,
    pipeline_split,
    stage_bounds,
)
from autotune.workers.torch_probe.plan import ModelConfig, Plan  # noqa: E402

TINY = ModelConfig(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=128,
)


def build(cfg=TINY, seed=1, rope_len=None):
    model = Transformer(cfg, rope_len=rope_len)
    init_weights(model, cfg, seed)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_kv_cache_decode_matches_full_forward(arch):
    cfg = ModelConfig(**{**TINY.__dict__, "arch": arch})
    model = build(cfg).eval()
    tokens = synthetic_tokens(0, 2, 23, cfg.vocab_size, seed=3)  # (2, 24)
    with torch.no_grad():
        full = model(tokens)
        model.set_kv_cache(2, 24, torch.float32)
        prefill = model(tokens[:, :16], pos0=0)
        steps = [model(tokens[:, i : i + 1], pos0=i) for i in range(16, 24)]
        model.set_kv_cache(None)
    torch.testing.assert_close(prefill, full[:, :16], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 16:], rtol=1e-4, atol=1e-5)


def test_init_is_the_same_whatever_the_pipeline_split():
    whole = build()
    with torch.device("meta"):
        meta = Transformer(TINY)
    pm = ParallelModel(parts=[], stage_ids=[0], num_stages=1)
    plan = Plan(kind="train", world_size=2, pp=2, vpp=2)
    part = pipeline_split(meta, plan, pp_rank=1, pm=pm)[1]  # stage 3: layer 3, norm, output
    assert pm.stage_ids == [1, 3] and list(part.layers.keys()) == ["3"]
    assert part.tok_embeddings is None and part.output is not None
    part.to_empty(device="cpu")
    init_weights(part, TINY, seed=1)
    ref = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=0)


def test_a_first_stage_of_its_own_size_takes_its_layers_and_the_rest_split_evenly():
    """first_stage_layers (Megatron-LM's --decoder-first-pipeline-num-layers): stage 0 holds that many
    layers and the embedding, the other stages the rest in equal parts."""
    assert stage_bounds(80, 4, 17) == [0, 17, 38, 59, 80] and stage_bounds(4, 2, None) == [0, 2, 4]
    with torch.device("meta"):
        meta = Transformer(TINY)
    plan = Plan(kind="train", world_size=2, pp=2, first_stage_layers=1)
    first = pipeline_split(meta, plan, pp_rank=0, pm=ParallelModel(parts=[], stage_ids=[0], num_stages=1))[0]
    pm = ParallelModel(parts=[], stage_ids=[0], num_stages=1)
    last = pipeline_split(meta, plan, pp_rank=1, pm=pm)[0]
    assert list(first.layers.keys()) == ["0"] and first.tok_embeddings is not None and first.output is None
    assert list(last.layers.keys()) == ["1", "2", "3"] and last.output is not None
    assert "layers 1,3" in " ".join(pm.applied)


def test_tied_embeddings_share_one_tensor():
    cfg = ModelConfig(**{**TINY.__dict__, "tie_word_embeddings": True})
    model = build(cfg)
    assert model.output.weight is model.tok_embeddings.weight


def test_synthetic_tokens_are_reproducible_and_learnable():
    a = synthetic_tokens(5, 4, 32, 1000, seed=7)
    assert torch.equal(a, synthetic_tokens(5, 4, 32, 1000, seed=7))
    assert not torch.equal(a, synthetic_tokens(6, 4, 32, 1000, seed=7))
    assert a.shape == (4, 33)
    stride = (a[:, 1] - a[:, 0]) % 1000
    assert torch.equal((a[:, 2] - a[:, 1]) % 1000, stride)  # arithmetic progressions


def test_recompute_lowers_peak_activation_memory():
    """Peak bytes held by the allocator during one forward+backward, replayed from the profiler's
    allocation records: deterministic, unlike RSS (the same run gives the same bytes). The model
    is big enough (hidden 256, seq 512) that activations dominate the gradients it allocates.
    ``full`` keeps only block inputs; ``selective`` drops the attention core's tensors (RoPE'd
    q/k, repeated k/v, SDPA output) and keeps the projections' and MLP's."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=1024,
        max_position_embeddings=512,
    )
    tokens = synthetic_tokens(0, 2, 511, cfg.vocab_size, seed=1)
    peaks = {}
    for mode in ("none", "selective", "full"):
        model = build(cfg)
        if mode != "none":
            apply_recompute(model, Plan(kind="train", world_size=1, recompute=mode))

        def fwd_bwd():
            model(tokens).float().mean().backward()

        fwd_bwd()  # gradients exist from here on: the measured step allocates activations only
        peaks[mode] = peak_allocated_bytes(fwd_bwd)
    assert peaks["full"] < 0.6 * peaks["none"], peaks
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def test_recompute_full_respects_recompute_layers():
    model = build()
    apply_recompute(model, Plan(kind="train", world_size=1, recompute="full", recompute_layers=1))
    wrapped = [type(block).__name__ for block in model.layers.values()]
    assert wrapped == ["CheckpointWrapper", "TransformerBlock", "TransformerBlock", "TransformerBlock"]
