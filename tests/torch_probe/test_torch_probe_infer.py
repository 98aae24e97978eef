"""The inference probe: prefill + KV-cache decode, metrics present; tp and tied/gpt variants run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

INFER = dict(kind="infer", prompt_len=32, gen_len=8, batch_sizes=[1, 2], warmup_steps=1, measured_steps=2)


def test_infer_single_process_reports_latency_metrics(probe):
    run = probe({"batch_size": 2}, workload=INFER)
    assert run.returncode == 0, run.tail()
    m = run.metrics
    for key in ("ttft_ms", "decode_tokens_per_s", "time_for_100_tokens_s", "peak_memory_gib", "tokens_per_s"):
        assert m[key] > 0, key
    assert m["time_for_100_tokens_s"] > m["ttft_ms"] / 1e3
    assert len(run.steps) == 3 and run.steps[0]["phase"] == "warmup"


@pytest.mark.slow
def test_infer_tp2_bf16(probe):
    run = probe({"batch_size": 2, "tp": 2, "precision": "bf16"}, world=2, workload=INFER)
    assert run.returncode == 0, run.tail()
    assert run.metrics["decode_tokens_per_s"] > 0


@pytest.mark.slow
def test_infer_rejects_pipeline_parallel(probe):
    run = probe({"batch_size": 1, "pp": 2}, world=2, workload=INFER)
    assert run.failure()[0] == "invalid", run.tail()


@pytest.mark.slow
@pytest.mark.parametrize("model", [{"tie_word_embeddings": True}, {"arch": "gpt"}], ids=["tied", "gpt"])
def test_train_variants_run(probe, model):
    run = probe({"dp": 2, "zero_stage": 0}, world=2, model=model)
    assert run.returncode == 0, run.tail()
    assert run.losses[-1] < run.losses[0]
