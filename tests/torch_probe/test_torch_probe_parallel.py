"""Every parallel mode trains and reproduces the single-process losses (CPU, gloo, real processes).

Tolerance: fp32, each step's loss within 1e-4 relative of the single-process run on the same
seed and data. The runs start from identical weights (name-seeded init, sliced per rank) and see
the same global batch, so the only legitimate difference is float32 summation order in sharded
matmuls and reductions — observed at ~1e-7. A wrong gradient (a missing all-reduce, a
micro-batch counted twice, a wrong shard) changes the direction of the AdamW update and moves
the step-2 and step-3 losses by ~1e-3 or more. (AdamW is nearly blind to a uniform gradient
*scale*, so scale errors are not what this test can see.)

The fast set covers the three mechanisms (DTensor TP + sequence parallel + loss parallel under
torchrun, the 1F1B pipeline under warm.py — ranks forked from a server with torch imported, the
default on a CPU node — and FSDP2 full sharding with a profiled step, under spawn.py); the rest
of the 2-rank modes and the 4-rank compositions are marked slow.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

RTOL = 1e-4


def assert_same_losses(run, reference):
    assert run.returncode == 0, run.tail()
    losses = run.losses
    assert len(losses) == len(reference), run.tail()
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert got == pytest.approx(want, rel=RTOL), f"step {step}: {got} != {want}\n{run.tail()}"
    metrics = run.metrics
    assert metrics["loss_finite"] == 1
    assert metrics["tokens_per_s"] > 0 and metrics["peak_memory_gib"] > 0
    assert metrics["step_time_p10_s"] <= metrics["step_time_s"] <= metrics["step_time_p90_s"]
    # on the cpu the peak is the process's RSS: everything it held, as a device-wide figure would be
    assert run.result["info"]["peak_memory_counts"] == "device"


def test_reference_loss_falls(reference_losses):
    assert len(reference_losses) == 3
    assert reference_losses[-1] < reference_losses[0]


def test_tp2_sequence_parallel_matches_single_process(probe, reference_losses):
    run = probe({"tp": 2, "sequence_parallel": True}, world=2, launcher="torchrun")
    assert_same_losses(run, reference_losses)
    assert "sequence parallel" in run.stderr and "loss parallel" in run.stderr


def test_pp2_1f1b_matches_single_process(probe, reference_losses):
    run = probe({"pp": 2, "micro_batch_size": 1}, world=2, launcher="warm")
    assert_same_losses(run, reference_losses)
    assert "1F1B" in run.stderr


def test_pp2_with_a_first_stage_of_its_own_size_matches_single_process(probe, reference_losses):
    """One layer on the first stage, three on the second (first_stage_layers): the same training."""
    run = probe({"pp": 2, "micro_batch_size": 1, "first_stage_layers": 1}, world=2, launcher="warm")
    assert_same_losses(run, reference_losses)
    assert "2 stages of layers 1,3" in run.stderr


def test_dp2_zero3_matches_and_profiles_comm(probe, reference_losses, tmp_path):
    art = tmp_path / "artifacts"
    run = probe(
        {"dp": 2, "zero_stage": 3}, world=2, workload={"profile_step": True}, env={"AUTOTUNE_ARTIFACT_DIR": str(art)}
    )
    assert_same_losses(run, reference_losses)
    metrics = run.metrics
    assert 0.0 < metrics["comm_fraction"] <= 1.0
    trace = json.loads((art / "trace_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("gloo" in n or "c10d" in n for n in names)
    assert "reshard_after_forward=True" in run.stderr


TWO_RANK_SLOW = [
    {"tp": 2},
    {"tp": 2, "recompute": "full"},
    {"pp": 2, "vpp": 2},
    {"pp": 2, "recompute": "selective", "micro_batch_size": 2, "grad_accum": 2},
    {"dp": 2, "zero_stage": 0},
    {"dp": 2, "zero_stage": 1},
    {"dp": 2, "zero_stage": 2},
    {"dp": 2, "zero_stage": 0, "recompute": "full", "recompute_layers": 2},
    {"cp": 2},
]


@pytest.mark.slow
@pytest.mark.parametrize("params", TWO_RANK_SLOW, ids=lambda p: json.dumps(p, sort_keys=True))
def test_two_rank_modes_match_single_process(probe, reference_losses, params):
    assert_same_losses(probe(params, world=2), reference_losses)


FOUR_RANK_SLOW = [
    {"tp": 2, "dp": 2, "zero_stage": 0},
    {"tp": 2, "dp": 2, "zero_stage": 1},
    {"tp": 2, "dp": 2, "zero_stage": 2, "sequence_parallel": True},
    {"tp": 2, "dp": 2, "zero_stage": 3},
    {"pp": 2, "dp": 2, "zero_stage": 0},
    {"pp": 2, "dp": 2, "zero_stage": 1},
    {"pp": 2, "dp": 2, "zero_stage": 3, "vpp": 2},
    {"tp": 2, "pp": 2, "sequence_parallel": True},
    {"tp": 2, "cp": 2},
    {"dp": 2, "cp": 2, "zero_stage": 2},
]


@pytest.mark.slow
@pytest.mark.parametrize("params", FOUR_RANK_SLOW, ids=lambda p: json.dumps(p, sort_keys=True))
def test_four_rank_compositions_match_single_process(probe, reference_losses, params):
    # 4 processes on 2 cores: slow but the only way to compose two parallel dimensions
    assert_same_losses(probe(params, world=4), reference_losses)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        {"tp": 2, "precision": "bf16", "sequence_parallel": True},
        {"pp": 2, "precision": "fp16"},
        {"dp": 2, "zero_stage": 2, "precision": "fp16"},
        {"dp": 2, "zero_stage": 0, "precision": "bf16"},
    ],
    ids=lambda p: json.dumps(p, sort_keys=True),
)
def test_mixed_precision_trains_close_to_fp32(probe, reference_losses, params):
    """bf16/fp16 (autocast, or FSDP's MixedPrecisionPolicy; fp16 with a loss scaler) follow the
    fp32 trajectory loosely: 1e-2 relative."""
    run = probe(params, world=2)
    assert run.returncode == 0, run.tail()
    for got, want in zip(run.losses, reference_losses):
        assert got == pytest.approx(want, rel=1e-2)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AUTOTUNE_SKIP_COMPILE") == "1", reason="compile disabled")
def test_compile_tp2_matches_single_process(probe, reference_losses):
    run = probe({"tp": 2, "compile": "default"}, world=2)
    assert_same_losses(run, reference_losses)
    assert "torch.compile" in run.stderr
