"""Physically impossible metrics (autotune/sanity.py) are a crash with the reason, never the best."""

from __future__ import annotations

import math

from autotune.dispatch.backends import BackendChoice
from autotune.spec.resolve import probe_context
from autotune.dispatch.dispatcher import InProcessDispatcher
from autotune.objectives import flops_per_token
from autotune.sanity import implausible_metrics
from autotune.study.records import trial_records
from autotune.cli.assembly import study_runner
from autotune.spec.load import load_spec
from autotune.workers.protocol import ProbeResult
from support import TINY_TRAIN


def _context(write_spec):
    spec = load_spec(write_spec(TINY_TRAIN))
    return spec, probe_context(spec)


def test_possible_metrics_pass(write_spec):
    _, c = _context(write_spec)
    ok = {"step_time_s": 0.5, "tokens_per_s_per_device": 512.0, "peak_memory_gib": 1.2, "loss": 6.9}
    assert implausible_metrics(ok, c.model, c.workload, c.hardware, "bf16") == []


def test_a_peak_a_little_above_the_profiles_capacity_is_a_measurement(write_spec):
    """A config that ran at 32.04 GiB on a "32 GiB" profile is the config near the limit the
    search is after (the profile understates the device a little): it must not be discarded."""
    _, c = _context(write_spec)
    near = {
        "step_time_s": 0.5,
        "tokens_per_s_per_device": 512.0,
        "peak_memory_gib": 32.04,
        "memory_headroom_gib": -0.04,
    }
    assert implausible_metrics(near, c.model, c.workload, c.hardware, "bf16") == []
    assert implausible_metrics({**near, "peak_memory_gib": -1.0}, c.model, c.workload, c.hardware, "bf16")


def test_negative_non_finite_zero_and_faster_than_the_hardware(write_spec):
    _, c = _context(write_spec)
    problems = implausible_metrics(
        {"step_time_s": -1.0, "peak_memory_gib": math.nan, "ttft_ms": -3}, c.model, c.workload, c.hardware, "bf16"
    )
    assert any("step_time_s = -1 is negative" in p for p in problems)
    assert any("peak_memory_gib = nan" in p for p in problems)
    assert any("ttft_ms = -3" in p for p in problems)
    assert implausible_metrics({"step_time_s": 0.0}, c.model, c.workload, c.hardware, "bf16")
    fast = implausible_metrics({"tokens_per_s_per_device": 1e12}, c.model, c.workload, c.hardware, "bf16")
    assert fast and "MFU" in fast[0] and "TFLOPS bf16" in fast[0]
    assert "MFU" in implausible_metrics({"mfu": 1.7}, c.model, c.workload, c.hardware, "fp32")[0]


def test_a_calibrated_profiles_plateau_is_no_bound_but_a_unit_slip_still_is(write_spec):
    """A calibrated profile's peak is the matmul plateau measured on the host (53 GFLOPS fp32 here,
    with the host busy at calibration time), which a real probe can beat: a 1-node slice probe of the
    tiny Llama ran at 103 % of it and was thrown away as a crash. Beating the plateau is a
    measurement; a thousandfold figure is still a slip."""
    _, c = _context(write_spec)
    calibrated = {**c.hardware, "peak_tflops": {"fp32": 0.0529708}, "calibrated_at": "2026-11-29T23:53:03+00:00"}
    flops = flops_per_token(c.model, int(c.workload["seq_len"]), True)
    at = {m: m * 0.0529708e12 / flops for m in (1.03, 3.0, 1000.0)}  # tokens/s/device at that MFU
    for mfu in (1.03, 3.0):
        assert implausible_metrics({"tokens_per_s_per_device": at[mfu]}, c.model, c.workload, calibrated, "fp32") == []
    slip = implausible_metrics({"tokens_per_s_per_device": at[1000.0]}, c.model, c.workload, calibrated, "fp32")
    assert slip and "the matmul plateau `autotune calibrate` measured" in slip[0]
    datasheet = {k: v for k, v in calibrated.items() if k != "calibrated_at"}
    assert implausible_metrics({"tokens_per_s_per_device": at[1.03]}, c.model, c.workload, datasheet, "fp32")


def test_an_impossible_measurement_is_a_crash_and_never_wins(write_spec, tmp_path):
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 4, seed: 1, sampler: random}")
        )
    )

    calls = []

    def probe(request):
        calls.append(request.number)
        if len(calls) == 2:  # a probe that read its clock backwards and made up a rate
            return ProbeResult("ok", metrics={"step_time_s": -1.0, "tokens_per_s_per_device": 1e12})
        return ProbeResult("ok", metrics={"step_time_s": 1.0, "tokens_per_s_per_device": 100.0 + len(calls)})

    runner = study_runner(
        spec, tmp_path / "run", BackendChoice("command", "test"), dispatcher=InProcessDispatcher(probe)
    )
    outcome = runner.run()
    runner.close()
    bad = next(r for r in trial_records(outcome.study) if r.number == calls[1])
    assert bad.status == "crash" and bad.state == "FAIL"
    assert "implausible metrics" in bad.reason and "negative" in bad.reason and "MFU" in bad.reason
    assert bad.metrics["tokens_per_s_per_device"] == 1e12  # kept: nothing measured is lost
    assert outcome.best and outcome.best[0].number != calls[1]
    assert outcome.best[0].metrics["tokens_per_s_per_device"] < 1000


def test_a_run_that_used_a_little_more_than_the_profile_stays_measured(write_spec, tmp_path):
    """The study keeps a config whose measured peak is a hair above the profile's capacity (it ran:
    the profile is what understates the device) as an ordinary measurement that may win; the
    recommendation, not the sanity check, is where tight headroom is weighed."""
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 3, seed: 1, sampler: random}")
        )
    )
    capacity = float(probe_context(spec).hardware["device_memory_gib"])

    def probe(request):
        return ProbeResult(
            "ok",
            metrics={
                "step_time_s": 1.0,
                "tokens_per_s_per_device": 100.0 + request.number,
                "peak_memory_gib": capacity * 1.003,
            },
        )

    runner = study_runner(
        spec, tmp_path / "run", BackendChoice("command", "test"), dispatcher=InProcessDispatcher(probe)
    )
    outcome = runner.run()
    runner.close()
    records = [r for r in trial_records(outcome.study) if r.probed]
    assert records and all(r.status == "ok" for r in records)
    assert all(r.metrics["memory_headroom_gib"] < 0 for r in records)
    assert outcome.best and outcome.best[0].status == "ok"
