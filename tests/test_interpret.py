"""The study's reading of a probe result (autotune.study.interpret), on plain values: no Optuna, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

from autotune.study.interpret import interpret, settle_pruned
from autotune.spec.models import PRESETS
from autotune.workers.hardware import load_profile
from autotune.workers.protocol import ProbeResult

CONTEXT = SimpleNamespace(
    model={"arch": "llama", **PRESETS["tiny-llama"]},
    workload={"kind": "train", "seq_len": 128, "global_batch_size": 8},
    hardware=load_profile("cpu"),
    cluster={"accelerator": "cpu"},
)
CONFIG = {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 2, "precision": "bf16"}
OBJ = [("tokens_per_s_per_device", "maximize")]


def test_an_ok_measurement_is_told_its_values_with_derived_metrics_and_the_peak_of_every_step():
    result = ProbeResult(
        "ok", metrics={"step_time_s": 0.5, "peak_memory_gib": 1.0}, steps=[{"event": "step", "peak_memory_gib": 1.7}]
    )
    meaning = interpret(CONFIG, result, CONTEXT, OBJ, devices=2)
    assert meaning.status == "ok" and meaning.tell == "values"
    assert meaning.metrics["tokens_per_s_per_device"] == 8 * 128 / 0.5 / 2  # derived from the step time
    assert meaning.values == [meaning.metrics["tokens_per_s_per_device"]]
    assert meaning.metrics["peak_memory_gib"] == 1.7 and result.metrics["peak_memory_gib"] == 1.0  # result untouched


def test_an_impossible_measurement_is_a_crash_never_a_value():
    result = ProbeResult("ok", metrics={"step_time_s": -1.0, "tokens_per_s_per_device": 5.0})
    meaning = interpret(CONFIG, result, CONTEXT, OBJ, devices=2)
    assert meaning.status == "crash" and meaning.tell == "fail" and "implausible" in meaning.reason
    assert meaning.probe_status == "crash"  # what the result file records too


def test_a_missing_objective_is_a_crash_but_the_probe_file_keeps_its_status():
    meaning = interpret(CONFIG, ProbeResult("ok", metrics={"loss": 1.0}, source="simulated"), CONTEXT, OBJ, devices=2)
    assert meaning.status == "crash" and "no value for objective" in meaning.reason and meaning.probe_status == "ok"


def test_failures_tell_the_search_what_they_teach():
    told = {
        s: interpret(CONFIG, ProbeResult(s, reason=s), CONTEXT, OBJ, 2)
        for s in ("oom", "invalid", "nan", "pruned", "crash", "timeout", "infra")
    }
    assert {s for s, m in told.items() if m.tell == "infeasible"} == {"oom", "invalid", "nan"}
    assert told["oom"].values == [0.0]  # a penalty for a maximised objective, marked infeasible
    assert told["pruned"].tell == "pruned" and told["crash"].tell == told["timeout"].tell == "fail"
    assert told["infra"].tell == "fail" and told["infra"].retry == "infra"
    lost = interpret(CONFIG, ProbeResult("infra", info={"capacity_lost": ["10.0.0.2:4000"]}), CONTEXT, OBJ, 2)
    assert lost.retry == "capacity_lost" and lost.capacity_lost == ["10.0.0.2:4000"]


def test_a_pruned_trial_keeps_the_steps_that_streamed_and_why_it_was_stopped():
    result = ProbeResult("pruned", reason="cancelled by the driver")
    streamed = [
        {"event": "step", "phase": "warmup", "step_time_s": 9.0},
        {"event": "step", "phase": "measure", "step_time_s": 2.0},
        {"event": "step", "phase": "measure", "step_time_s": 4.0},
    ]
    settle_pruned(result, streamed, "stopped early after 2 measured steps")
    assert result.reason == "stopped early after 2 measured steps"
    assert result.metrics == {"step_time_s": 3.0, "measured_steps": 2.0}
