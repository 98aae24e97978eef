"""``autotune calibrate --serving SPEC --readings DIR`` (issue 46): the readings an earlier calibration
kept, refitted against the serving model as it is now, and what the refitted model then predicts
against what vLLM's CPU engine measured.

The fixtures are real: ``tests/fixtures/serving_calibration/vllm_cpu_*.jsonl`` hold the closed-loop
figures of ``autotune calibrate --serving`` runs of vLLM 0.32's CPU engine on a 2-core AMD EPYC VM
(2026-11-29; each line a probe's result, its per-request records left out), and
``host_epyc_2core.yaml`` the host profile those fits were against. The engine's own figures the
predictions are held to are from ``benchmarks/serving_cpu_study.py --model-check`` runs on the same VM
(benchmarks/README.md, "A serving model that measurement corrects").
"""

from __future__ import annotations

import json

import pytest
import yaml
from support import REPO, predicted_by_seqs_and_chunked
from typer.testing import CliRunner

from autotune.cli import app
from autotune.workers.hardware import load_profile

FIXTURES = REPO / "tests" / "fixtures" / "serving_calibration"
HOST = FIXTURES / "host_epyc_2core.yaml"
LONG_READINGS = FIXTURES / "vllm_cpu_long_prompts.jsonl"
SHORT_READINGS = FIXTURES / "vllm_cpu_short_prompts.jsonl"
# 2026-12-01, another 2-core AMD EPYC VM: three probes, their closed-loop requests kept (load runs left out)
PILED_READINGS = FIXTURES / "vllm_cpu_piled_up_batches.jsonl"


def _spec(write_spec, prompt_len, space: dict, name: str):
    data = yaml.safe_load((REPO / "search_spaces" / "tiny_llama_serve_cpu.yaml").read_text())
    data["backend"] = {"kind": "simulate"}  # a refit runs no engine
    data["cluster"]["profile"] = str(HOST)
    data["workload"]["traffic"]["prompt_len"] = prompt_len
    if prompt_len.get("high", 0) > 256:  # the long-prompt study: 6 s a rate (benchmarks/serving_cpu_study.py --close)
        data["workload"]["traffic"].update(rates=[2, 4, 8, 16], duration_s=6)
    data["space"] = {**data["space"], **space}
    return write_spec(yaml.safe_dump(data), name)


def _refit(spec_path, readings, out):
    result = CliRunner().invoke(
        app, ["calibrate", "--serving", str(spec_path), "--readings", str(readings), "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_long_prompt_readings_refit_to_the_engines_capacity(write_spec, tmp_path):
    """Prompts of 256-512 tokens: vLLM's CPU engine completed 2.30-2.34 requests/s (max_num_seqs 4) and
    2.38-2.49 (8) when offered 4. Fitted to the closed-loop batches priced as the last request's own
    figure, the model's ceiling was 1.42-1.44 (its decode step 3-4x the engine's); priced as the probe
    reads them (the first request's stall counted) it is within 1.5x."""
    spec_path = _spec(
        write_spec,
        {"low": 256, "high": 512},
        {"max_num_seqs": [4, 8], "enable_chunked_prefill": [True, False]},
        "l.yaml",
    )
    said = _refit(spec_path, LONG_READINGS, tmp_path / "long.yaml")
    steps = said["serving_steps"]
    assert len(steps["points"]) == 24 and steps["rms_error"] < 0.12
    profile = load_profile(str(tmp_path / "long.yaml"))
    engine = {4: (2.30, 2.34), 8: (2.38, 2.49)}  # completions/s at 4 offered (chunked on, off)
    for (mns, chunked), figures in predicted_by_seqs_and_chunked(spec_path, profile).items():
        measured = engine[mns][0 if chunked else 1]
        assert measured / 1.5 < figures["capacity_rps"] < measured * 1.5, (mns, chunked, figures["capacity_rps"])
    text = (tmp_path / "long.yaml").read_text()
    assert f"--readings {LONG_READINGS}" in text and "refitted from the readings" in text


def test_the_short_prompt_readings_refit_to_the_engines_slo_rates(write_spec, tmp_path):
    """Prompts of 64-192 tokens, the repository's CPU study: the largest rate meeting p99 TTFT 400 ms /
    TPOT 25 ms was 2.38 requests/s (max_num_seqs 8, chunked off), 2.71 (chunked on) and 2.09 (32,
    chunked on); with 1 or 2 sequences no rate of the ladder (2 and up) met it. Before any trial of
    the study, after calibrate: issue 46 asks within 1.5x, which held (2.05-2.06) while the prompt
    stage's TTFT tail was priced at 0.45-0.7x of what vLLM's scheduler does with the same steps. Priced
    as the scheduler queues (benchmarks/serving_queue_vs_scheduler.py), 1.48: within 1.83x, TTFT-bound.
    A replay of the scheduler on these fitted steps meets neither target at 2.38 either (TPOT p99 32 ms
    in a median 8 s window, TTFT p99 328 ms): the closed-loop fit prices the open loop's prompt steps
    slower than the engine ran them (benchmarks/README.md)."""
    spec_path = _spec(write_spec, {"low": 64, "high": 192}, {}, "s.yaml")
    said = _refit(spec_path, SHORT_READINGS, tmp_path / "short.yaml")
    assert said["serving_steps"]["rms_error"] < 0.2
    predicted = predicted_by_seqs_and_chunked(spec_path, load_profile(str(tmp_path / "short.yaml")))
    for (mns, chunked), measured in (((8, False), 2.38), ((8, True), 2.71), ((32, True), 2.09)):
        rate = predicted[(mns, chunked)]["max_rate_rps_model"]
        assert measured / 2.0 < rate < measured * 1.5, (mns, chunked, rate)
    for mns in (1, 2):
        for chunked in (True, False):
            assert predicted[(mns, chunked)]["max_rate_rps_model"] < 2.0


def test_readings_of_several_rounds_or_runs_put_together_refit_at_each_figures_median(write_spec, tmp_path):
    """The long-prompt readings three times in one file, the last copy's figures 40 % slower (a run on a
    busy afternoon): the refit pools them per prompt length, each figure the median, so it reads what
    the two alike say, and each point says it rests on three readings 40 % apart."""
    spec_path = _spec(
        write_spec,
        {"low": 256, "high": 512},
        {"max_num_seqs": [4, 8], "enable_chunked_prefill": [True, False]},
        "r.yaml",
    )
    once = _refit(spec_path, LONG_READINGS, tmp_path / "once.yaml")["serving_steps"]
    lines = [json.loads(line) for line in LONG_READINGS.read_text().splitlines() if line.strip()]
    slow = [
        {
            **line,
            "metrics": {k: v * 1.4 if k.endswith(("_ttft_ms", "_tokens_s")) else v for k, v in line["metrics"].items()},
        }
        for line in lines
    ]
    rounds = tmp_path / "rounds.jsonl"
    rounds.write_text("".join(json.dumps(line) + "\n" for line in lines + lines + slow))
    pooled = _refit(spec_path, rounds, tmp_path / "rounds.yaml")["serving_steps"]
    assert len(pooled["points"]) == len(once["points"]) and pooled["repeats"] == 3
    assert {p["readings"] for p in pooled["points"]} == {3}
    assert all(p["spread"] == pytest.approx(0.4, rel=1e-3) for p in pooled["points"])
    for key in ("decode_scale", "prefill_scale", "step_overhead_us", "request_latency_us"):
        assert pooled[key] == pytest.approx(once[key], rel=1e-4, abs=1e-6), key
    slow_only = tmp_path / "slow.jsonl"  # the slow copy fitted alone reads another engine
    slow_only.write_text("".join(json.dumps(line) + "\n" for line in slow))
    alone = _refit(spec_path, slow_only, tmp_path / "slow.yaml")["serving_steps"]
    assert alone["decode_scale"] > 1.2 * once["decode_scale"]


def test_batches_whose_tokens_arrived_piled_up_are_left_out_of_the_refit(write_spec, tmp_path):
    """The first probe of a calibration on 2026-12-01: its batch of 1 arrived whole (32 tokens in one
    read, 98 ms after sending: TPOT 0), and one request of each of its batches of 2 and 4 had 45 % and
    13 % of its tokens arrive apart. Fitted as engine steps, those readings put the fit at 37 % rms
    and a step's cost at 1.3 ms, where the other calibration of that host read 3.2 ms; left out, the
    same readings fit within 12 % and read 3.1 ms."""
    spec_path = _spec(write_spec, {"low": 64, "high": 192}, {}, "p.yaml")
    said = _refit(spec_path, PILED_READINGS, tmp_path / "piled.yaml")
    steps = said["serving_steps"]
    assert [(p["prompt_len"], p["batch"]) for p in steps["left_out"]] == [(64, 1), (64, 2), (64, 4)]
    assert len(steps["points"]) == 2 * (15 - 3) and steps["rms_error"] < 0.15
    assert 2800 < steps["step_overhead_us"] < 3500
    # the same readings without their requests: nothing tells the piled-up batches apart
    blind = tmp_path / "blind.jsonl"
    lines = [json.loads(line) for line in PILED_READINGS.read_text().splitlines()]
    blind.write_text("".join(json.dumps({**line, "info": {}}) + "\n" for line in lines))
    as_read = _refit(spec_path, blind, tmp_path / "blind.yaml")["serving_steps"]
    assert as_read["left_out"] == [] and as_read["rms_error"] > 0.25 and as_read["step_overhead_us"] < 2000


@pytest.mark.parametrize(
    "content,words",
    [
        (None, "cannot read the calibration readings"),
        ("", "no readings in it"),
        ('{"prompt_len": 64, "config": {}, "status": "ok", "metrics": {}}\n{not json\n', "readings.jsonl:2"),
        ('{"prompt_len": 64, "status": "ok"}\n', "with prompt_len, config, status and metrics"),
        (
            '{"prompt_len": 64, "config": {"max_num_seqs": 4}, "status": "ok", "metrics": {}}\n'
            '{"prompt_len": 128, "config": {"max_num_seqs": 8}, "status": "ok", "metrics": {}}\n',
            "a reading of another config",
        ),
        (
            '{"prompt_len": 64, "output_len": 64, "config": {}, "status": "ok", "metrics": {}}\n',
            "measured with outputs of 64 tokens, the spec's traffic has 32",
        ),
    ],
)
def test_readings_that_cannot_be_refitted_are_refused_naming_the_file(write_spec, tmp_path, content, words):
    spec_path = _spec(write_spec, {"low": 64, "high": 192}, {}, "s.yaml")
    kept = tmp_path / "host.serving-calibration"
    kept.mkdir()
    if content is not None:
        (kept / "readings.jsonl").write_text(content)
    result = CliRunner().invoke(
        app, ["calibrate", "--serving", str(spec_path), "--readings", str(kept), "--out", str(tmp_path / "x.yaml")]
    )
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and words in flat and "readings.jsonl" in flat, result.output
    assert not (tmp_path / "x.yaml").exists()


def test_readings_need_a_serving_spec():
    result = CliRunner().invoke(app, ["calibrate", "--out", "x.yaml", "--readings", str(LONG_READINGS)])
    assert result.exit_code == 2 and "give the serving spec with --serving" in result.output
