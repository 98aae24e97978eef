"""The ``torch-probe`` memory rule (workers/simulate/_memory.state_bytes_per_param) against the
model-state bytes the torch probe itself holds (CPU, gloo, 2 real processes).

The probe counts, on every rank, the bytes of its weights, of its gradients as the first
optimizer step begins and of its optimizer states after it (local shards of DTensors), sums
them over ranks and divides by the parameters of one device's share: the quantity the rule
prices. With dp = 2 the rule's ZeRO sharding is exact (padding of the tiny model's shards aside),
so a wrong rule, or a probe that stops sharding what it claims to, is off by whole bytes."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from autotune.workers.simulate._memory import state_bytes_per_param  # noqa: E402

PRECISION_CODE = {"bf16": 0, "fp16": 1, "fp32": 2}


def _rule(precision: str, zero: int, dp: int) -> tuple[float, float, float]:
    w, g, o, _, _ = state_bytes_per_param(
        np.array([PRECISION_CODE[precision]]), np.array([zero]), np.array([dp]), {"memory_rule": "torch-probe"}
    )
    return float(w[0]), float(g[0]), float(o[0])


@pytest.mark.parametrize("precision,zero", [("fp32", 0), ("bf16", 1), ("bf16", 3)])
def test_rule_matches_the_probes_state_bytes(probe, precision, zero):
    run = probe({"dp": 2, "zero_stage": zero, "precision": precision}, world=2)
    assert run.returncode == 0, run.tail()
    m = run.metrics
    measured = (
        m["state_weight_bytes_per_param"],
        m["state_grad_bytes_per_param"],
        m["state_optimizer_bytes_per_param"],
    )
    for what, got, want in zip(("weights", "gradients", "optimizer states"), measured, _rule(precision, zero, 2)):
        assert got == pytest.approx(want, rel=0.02), f"{what}: probe holds {got:.3f} bytes/param, rule says {want}"


@pytest.mark.slow
@pytest.mark.parametrize("precision,zero", [("bf16", 0), ("fp32", 1), ("fp32", 2), ("bf16", 2), ("fp16", 0)])
def test_rule_matches_the_probes_state_bytes_more(probe, precision, zero):
    test_rule_matches_the_probes_state_bytes(probe, precision, zero)
