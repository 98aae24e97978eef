"""A serving study's noise between runs before its own repeats: measured on the host by
``autotune calibrate --serving``'s repeated probes (issue 44, "noise measured, per study"), carried by
the profile, taken by the guide and the report alike, and named where it is used."""

from __future__ import annotations

import math

import numpy as np
import pytest

from autotune.objectives.intervals import (
    NoisePrior,
    between_runs_interval,
    between_runs_words,
    noise_belief,
    noise_of_repeats,
)
from autotune.study.records import ASSUMED_NOISE, best_certificate, certificate_sentence, noise_prior_dof
from autotune.workers.calibrate_serving import ServingRun, repeat_noise
from support import measured_record

GOODPUT = [("goodput_rps_per_device", "maximize")]
HOST = NoisePrior(0.15, 6, "autotune calibrate --serving's repeated probes on this host")


def test_noise_of_repeats_is_the_pooled_relative_spread_with_its_degrees_of_freedom():
    rng = np.random.default_rng(1)
    groups = [list(v * (1.0 + 0.1 * rng.standard_normal(3))) for v in rng.uniform(5.0, 100.0, 400)]
    noise, dof = noise_of_repeats(groups + [[7.0]])  # a single reading adds nothing
    assert dof == 800 and noise == pytest.approx(0.1, rel=0.08)
    assert noise_of_repeats([[1.0], [2.0]]) is None


def test_a_measured_prior_weighs_as_its_repeats_and_counts_among_the_degrees_of_freedom():
    """Without the prior's dof the floor is one assumed pair and no dof (nothing certified, no
    interval between runs); with them it is a measurement: the study's own repeats pool with it."""
    assert noise_belief([[10.0], [20.0]], 0.15) == (pytest.approx(0.15), 0)
    assert noise_belief([[10.0], [20.0]], 0.15, 6) == (pytest.approx(0.15), 6)
    # one repeat that read 2 % apart moves a measured prior of 6 dof little, an assumed one a lot
    pair = [[100.0, 102.0]]
    squares = 2 * (1.0 / 101.0) ** 2
    assert noise_belief(pair, 0.15, 6)[0] == pytest.approx(math.sqrt((0.15**2 * 6 + squares) / 7))
    assert noise_belief(pair, 0.15, 6)[1] == 7
    assert noise_belief(pair, 0.15)[0] == pytest.approx(math.sqrt((0.15**2 + squares) / 2))
    # an interval between runs exists on the measured prior, none on the assumed one
    assert between_runs_interval([20.0], 0.15, 0) is None
    low, high = between_runs_interval([20.0], 0.15, 6)
    assert low < 20.0 * (1 - 0.15 * 2) and high > 20.0 * (1 + 0.15 * 2)  # Student's t at 7 dof: wider than 2 sd


def test_a_recorded_prior_is_read_back_and_a_missing_or_broken_one_is_the_assumption():
    assert NoisePrior.from_json(HOST.to_json(), ASSUMED_NOISE) == NoisePrior(0.15, 6, HOST.source)
    for broken in (None, {}, {"noise": 0}, {"noise": "x"}, {"noise": -0.1, "dof": 3}):
        assert NoisePrior.from_json(broken, ASSUMED_NOISE) is ASSUMED_NOISE
    assert not ASSUMED_NOISE.measured and ASSUMED_NOISE.noise == pytest.approx(0.03)
    # the prior's dof count only where the floor is the prior's noise (no reading's steps gave another)
    assert noise_prior_dof(0.15, HOST) == 6 and noise_prior_dof(0.004, HOST) == 0
    assert noise_prior_dof(0.03, ASSUMED_NOISE) == 0 and noise_prior_dof(0.15, None) == 0


def _runs(speeds: list[float], prompts=(64, 128), batches=(1, 4)) -> list[ServingRun]:
    """Calibration probes: each repeat one draw of the host's speed (``speeds``, one per repeat),
    every figure of the probe slowed by it alike."""
    runs = []
    for prompt in prompts:
        for speed in speeds:
            measured = {}
            for b in batches:
                measured[f"batch{b}_ttft_ms"] = 10.0 * b * prompt / 64 / speed
                measured[f"batch{b}_time_for_100_tokens_s"] = 0.3 * (1 + b / 8) / speed
                measured[f"batch{b}_tokens_apart_share"] = 1.0
            runs.append(ServingRun(prompt, {"batch_sweep": list(batches)}, measured))
    return runs


def test_calibrations_repeat_noise_is_the_hosts_spread_between_probes_counted_by_probe():
    speeds = [1.0, 0.8, 1.2]
    noise, dof = repeat_noise(_runs(speeds))
    ratios = np.array([1 / s for s in speeds]) / np.mean([1 / s for s in speeds])
    assert noise == pytest.approx(float(np.sqrt(np.sum((ratios - 1) ** 2) / 2)), rel=1e-6)
    assert dof == 4  # two prompt lengths, three probes each: a probe is one draw of the host, not its figures
    assert repeat_noise(_runs([1.0])) is None  # one round: nothing measured twice
    # a repeat whose stream piled up is not counted, as the fit leaves it out
    runs = _runs([1.0, 0.8, 1.2])
    for r in runs:
        if r.measured["batch1_ttft_ms"] == pytest.approx(10.0 * r.prompt_len / 64 / 1.2):
            for b in (1, 4):
                r.measured[f"batch{b}_tokens_apart_share"] = 0.1
    noise, dof = repeat_noise(runs)
    assert dof == 2 and noise == pytest.approx(float(np.std([1.0, 1.25], ddof=1) / np.mean([1.0, 1.25])), rel=1e-6)


def test_the_guide_takes_a_serving_profiles_measured_noise_and_a_training_spec_does_not(tmp_path, monkeypatch):
    from autotune.guide.spec_settings import guide_settings, measured_noise
    from autotune.spec.context import ProbeContext

    steps = {"repeat_noise": 0.172, "repeat_noise_dof": 6.0}
    assert measured_noise({"serving_steps": steps}) == NoisePrior(0.172, 6, HOST.source)
    for missing in ({}, {"serving_steps": {}}, {"serving_steps": {"repeat_noise": 0.1, "repeat_noise_dof": 0}}):
        assert measured_noise(missing) is None

    from autotune.spec.load import load_spec
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    serve = load_spec(repo / "search_spaces" / "tiny_llama_serve_cpu.yaml")
    train = load_spec(repo / "search_spaces" / "llama2_7b_8npu.yaml")
    for spec, taken in ((serve, True), (train, False)):
        context = ProbeContext({}, {}, {"hardware": {"serving_steps": steps}})
        settings = guide_settings(spec, context)
        if taken:
            assert (settings.noise, settings.noise_dof) == (0.172, 6) and "calibrate --serving" in settings.noise_from
        else:
            assert settings.noise == pytest.approx(0.03) and settings.noise_dof == 0
    plain = guide_settings(serve, ProbeContext({}, {}, {"hardware": {}}))
    assert plain.noise == pytest.approx(0.03) and plain.noise_dof == 0


def _serving(number: int, seqs: int, goodput: float):
    return measured_record(number, {"max_num_seqs": seqs}, {"goodput_rps_per_device": goodput})


def test_one_reading_each_gets_an_interval_between_runs_at_the_hosts_noise_and_the_words_name_it():
    """Four configs read once each (a budget of 3-4 on a 2-core VM): on the assumed 3 % the study
    claimed nothing between runs; on the host's measured 15 % it gives the best's interval, wide, and
    says what measured the noise."""
    from autotune.study.result import _between_runs, _floor_from

    rs = [_serving(0, 2, 12.3), _serving(1, 4, 19.0), _serving(2, 8, 26.9), _serving(3, 16, 34.2)]
    cert, readings = best_certificate(rs, [rs[3]], GOODPUT, 0.02, 0.95)
    assert not cert.noise_measured and _between_runs(GOODPUT[0][0], readings.groups[cert.leader], cert) is None
    assert _floor_from(readings.floor, readings.prior) == "assumed"

    cert, readings = best_certificate(rs, [rs[3]], GOODPUT, 0.02, 0.95, noise_prior=HOST)
    assert cert.noise_measured and cert.noise_dof == 6 and cert.noise == pytest.approx(0.15)
    assert _floor_from(readings.floor, readings.prior) == "host"
    between = _between_runs(GOODPUT[0][0], readings.groups[cert.leader], cert, HOST)
    assert between["low"] < 34.2 * 0.7 and between["high"] > 34.2 * 1.3 and between["readings"] == 1
    words = between_runs_words(between)
    assert "one reading" in words and "calibrate --serving" in words and "6 degrees of freedom" in words
    sentence = certificate_sentence(cert, readings.numbers, 0, 1, readings.floor, readings.prior)
    assert "measured by autotune calibrate --serving" in sentence and "assumed" not in sentence
    # the best read 27 % above the second: at 15 % a reading, not a separation worth a certificate
    assert not cert.certified

    # a repeat of the best pools with the host's probes, and the words say both
    again = rs + [_serving(4, 16, 30.8)]
    cert, readings = best_certificate(again, [again[4]], GOODPUT, 0.02, 0.95, noise_prior=HOST)
    assert cert.noise_dof == 7
    between = _between_runs(GOODPUT[0][0], readings.groups[cert.leader], cert, HOST)
    assert between["readings"] == 2 and "and its repeats (1)" in between_runs_words(between)


@pytest.mark.timeout(600)
def test_a_serving_study_on_a_calibrated_profile_records_the_hosts_noise_and_reports_the_interval(write_spec, tmp_path):
    """The whole path, against the fake engine in vLLM's place: a profile that ``calibrate --serving``
    wrote with its repeat noise; the study keeps it (its attribute), says so on stderr, and the
    report's certificate gives the best's interval between runs on it, named, where the study
    measured no config twice."""
    import json
    import sys

    import yaml
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from support import FAKE_SERVE_WORKLOAD, REPO, fake_vllm

    profile = yaml.safe_load((REPO / "workers" / "hardware" / "cpu.yaml").read_text())
    profile["serving_steps"] = {
        "engine": "fake",
        "decode_scale": 1.0,
        "prefill_scale": 1.0,
        "step_overhead_us": 0.0,
        "repeat_noise": 0.15,
        "repeat_noise_dof": 6,
    }
    profile_path = tmp_path / "calibrated.yaml"
    profile_path.write_text(yaml.safe_dump(profile))
    fake = fake_vllm(tmp_path)
    spec = write_spec(
        f"""
name: serve-host-noise
model: tiny-llama
{FAKE_SERVE_WORKLOAD}
cluster: {{accelerator: cpu, profile: {profile_path}, nodes: 1, devices_per_node: 1}}
target: vllm
backend: {{kind: vllm, python: {sys.executable}, entry: {fake}}}
space:
  max_num_seqs: [1, 8]
objectives: [goodput_rps_per_device]
search: {{n_trials: 2, sampler: random, seed: 5, stop_early: false, prune: false}}
ray: {{enabled: false}}
""",
        "serve.yaml",
    )
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert "noise between runs before any repeat: 15.0% per reading, measured by autotune calibrate" in result.output
    cert = json.loads(result.stdout)["certificate"]
    assert cert["noise_floor_from"] == "host" and cert["noise_measured"] and cert["noise"] >= 0.1
    between = cert["between_runs"]
    assert between is not None and "calibrate --serving" in between["noise_from"]
    assert between["low"] < between["high"] and "measured by autotune calibrate" in cert["sentence"]
    rate = cert["between_runs_max_rate"]  # the max rate between runs, at the same noise
    assert rate["metric"] == "max_rate_rps" and rate["low"] < rate["high"] and rate["noise"] == between["noise"]
