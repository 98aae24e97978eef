"""``autotune calibrate --serving`` (issue 46): a serving engine's steps measured on this host and the
serving model corrected by them (``serving_steps`` in the profile).

The fit is checked against the model itself (readings made by the model at known factors are fitted
back to those factors), the profile's checks name the key and what was expected, the simulator's
closed-loop figures move as the factors say, and the whole command runs against the fake engine in
vLLM's place (tests/fixtures/fake_engine: 40 ms to the first token, 20 ms a token, whatever the
batch): the profile it writes predicts the fake's time for 100 tokens where the bundled one is far off.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import yaml
from support import REPO, fake_vllm
from typer.testing import CliRunner

from autotune.cli import app
from autotune.spec.load import load_spec
from autotune.spec.resolve import probe_context
from autotune.study.serving_calibration import calibration_config, calibration_spec
from autotune.workers.calibrate_serving import (
    TERMS,
    ServingRun,
    calibration_batches,
    calibration_prompts,
    fit_serving_steps,
    modelled_figures,
)
from autotune.workers.hardware import load_profile, validate_profile
from autotune.workers.simulate import columns_from_params, simulate_configs
from autotune.workers.simulate._serve import API_OVERHEAD_S

SPEC = REPO / "search_spaces" / "tiny_llama_serve_cpu.yaml"


def _context():
    spec = load_spec(SPEC)
    return spec, probe_context(spec), calibration_config(spec, {})


# decode_scale, prefill_scale, step_overhead_us, sequence_overhead_us, context_overhead_ns,
# prompt_token_overhead_ns, request_latency_us (TERMS' order)
TRUTH = (3.0, 1.5, 4000.0, 300.0, 5000.0, 20000.0, 60000.0)


def _workload(ctx, prompt: int, batches) -> dict:
    workload = copy.deepcopy(dict(ctx.workload))
    workload["traffic"] = {**workload["traffic"], "prompt_len": prompt, "output_len": 32}
    workload["batch_sweep"] = list(batches)
    return workload


def _keys(batches) -> list[str]:
    return [f"batch{b}_{f}" for b in batches for f in ("ttft_ms", "time_for_100_tokens_s")]


def _truth_runs(ctx, config, batches, slow: dict[int, float] | None = None) -> list[ServingRun]:
    """One run per prompt length, its figures the model's at :data:`TRUTH` (times ``slow[prompt]``)."""
    runs = []
    for prompt in calibration_prompts(128, 32, None):
        workload = _workload(ctx, prompt, batches)
        truth = modelled_figures(ctx.model, workload, ctx.hardware, ctx.cluster, config, _keys(batches), TRUTH)
        factor = (slow or {}).get(prompt, 1.0)
        measured = {k: factor * v * (1e3 if k.endswith("_ms") else 1) for k, v in zip(_keys(batches), truth)}
        runs.append(ServingRun(prompt, workload, measured))
    return runs


def test_the_fit_reproduces_readings_made_at_known_terms_and_predicts_others():
    """Readings the model makes at known terms are fitted back to within rounding, and the fitted model
    gives the same figures at a batch and a prompt length no reading had. (On this small model the
    decode step is affine in the batch and its context, so its factor and the three costs are one
    blend, and so are the prompt's factor and its cost a token: the fit may split them otherwise, but
    not predict otherwise.)"""
    spec, ctx, config = _context()
    batches = calibration_batches(int(config["max_num_seqs"]))
    runs = _truth_runs(ctx, config, batches)
    steps = fit_serving_steps(runs, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    assert steps["rms_error"] < 1e-3
    # what the readings pin down; the prompt's factor and its cost a token are one blend where the model's
    # prefill is near-linear in its tokens (this small model's is), as the decode's are
    for key in ("context_overhead_ns", "request_latency_us"):
        assert steps[key] == pytest.approx(TRUTH[[k for k, _, _ in TERMS].index(key)], rel=0.02), key
    assert len(steps["points"]) == 3 * 5 * 2  # prompts x batches (1..16 within max_num_seqs 32) x figures
    assert max(p["model_s"] / p["measured_s"] for p in steps["points"]) < 0.9  # the uncorrected model was off
    unseen = _workload(ctx, 100, [3, 12])
    fitted = [steps[k] for k, _, _ in TERMS]
    assert modelled_figures(ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), fitted) == (
        pytest.approx(
            modelled_figures(ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), TRUTH), rel=0.01
        )
    )
    validate_profile({**ctx.hardware, "serving_steps": steps}, "fitted")  # what the command writes loads back


def test_rounds_of_a_prompt_length_are_fitted_at_their_median_and_the_points_say_how_many():
    """Three rounds, one of which ran on a host 60 % slower at one prompt length (a slow spell of a
    shared VM): the fit reads each figure's median, so it lands where the two quiet rounds put it; the
    slow round fitted alone does not. Each point says on how many readings it rests and how far
    apart they were; the profile keeps the most rounds and the median point's spread."""
    spec, ctx, config = _context()
    batches = calibration_batches(int(config["max_num_seqs"]))
    prompts = calibration_prompts(128, 32, None)
    quiet = _truth_runs(ctx, config, batches)
    slow = _truth_runs(ctx, config, batches, slow={prompts[1]: 1.6})
    steps = fit_serving_steps(quiet + slow + quiet, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    alone = fit_serving_steps(slow, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    assert steps["rms_error"] < 1e-3 and alone["rms_error"] > 0.05
    assert len(steps["points"]) == 3 * 5 * 2  # the rounds are pooled, not fitted as points of their own
    assert {p["readings"] for p in steps["points"]} == {3} and steps["repeats"] == 3
    spreads = {p["prompt_len"]: p["spread"] for p in steps["points"]}
    assert spreads[prompts[1]] == pytest.approx(0.6, rel=1e-6) and spreads[prompts[0]] == 0.0
    assert steps["repeat_spread"] == 0.0  # two lengths of three had no spread: the median point has none
    unseen = _workload(ctx, 100, [3, 12])
    truth = modelled_figures(ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), TRUTH)
    pooled = modelled_figures(
        ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), [steps[k] for k, _, _ in TERMS]
    )
    assert pooled == pytest.approx(truth, rel=0.01)
    single = fit_serving_steps(quiet, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    assert single["repeats"] == 1 and "repeat_spread" not in single
    assert {p["readings"] for p in single["points"]} == {1} and not any("spread" in p for p in single["points"])
    validate_profile({**ctx.hardware, "serving_steps": steps}, "pooled")


def test_a_round_whose_stream_piled_up_is_not_counted_and_a_batch_piled_up_in_every_round_is_left_out():
    """A batch timed the API server's lag in one round (its tokens arrived piled up): that round is not
    counted for it, and the other two decide; a batch piled up in all three is left out of the fit,
    once, with the lowest share."""
    spec, ctx, config = _context()
    batches = calibration_batches(int(config["max_num_seqs"]))
    rounds = [_truth_runs(ctx, config, batches) for _ in range(3)]
    for number, runs in enumerate(rounds):
        for run in runs:
            run.measured.update({f"batch{b}_tokens_apart_share": 1.0 for b in batches})
        first = runs[0].measured  # the shortest prompt
        first["batch2_tokens_apart_share"] = 0.1 * (number + 1)  # piled up in every round
        first["batch2_time_for_100_tokens_s"] = 0.001
        if number == 0:  # batch 4 piled up in the first round only, its figure the lag
            first.update(batch4_tokens_apart_share=0.2, batch4_time_for_100_tokens_s=0.001)
    steps = fit_serving_steps(
        [run for runs in rounds for run in runs], ctx.model, ctx.hardware, ctx.cluster, config, "vllm"
    )
    shortest = rounds[0][0].prompt_len
    assert steps["left_out"] == [{"prompt_len": shortest, "batch": 2, "tokens_apart_share": 0.1}]
    by_point = {(p["prompt_len"], p["batch"], p["figure"]): p for p in steps["points"]}
    assert by_point[(shortest, 4, "time_for_100_tokens_s")]["readings"] == 2
    assert by_point[(shortest, 4, "time_for_100_tokens_s")]["spread"] == 0.0  # the lag's figure not among them
    assert (shortest, 2, "ttft_ms") not in by_point
    assert steps["rms_error"] < 1e-3


def test_too_few_readings_are_refused_with_the_count():
    spec, ctx, config = _context()
    run = ServingRun(64, dict(ctx.workload), {"batch1_ttft_ms": 12.0})
    with pytest.raises(ValueError, match="1 closed-loop reading"):
        fit_serving_steps([run], ctx.model, ctx.hardware, ctx.cluster, config, "vllm")


def test_the_calibration_config_takes_the_widest_batch_limits_and_the_sets():
    spec, _, config = _context()
    assert config["max_num_seqs"] == 32 and config["enable_chunked_prefill"] is True
    assert calibration_config(spec, {"max_num_seqs": 8})["max_num_seqs"] == 8
    with pytest.raises(ValueError, match="--set tensor_speed"):
        calibration_config(spec, {"tensor_speed": 2})
    sized = calibration_spec(spec, 384, [1, 2, 4])
    traffic = sized.workload.traffic
    assert (traffic.prompt_len, traffic.output_len, traffic.rates) == (384, 32, [2.0])
    assert sized.workload.batch_sweep == [1, 2, 4]
    assert sized.workload.max_model_len == 416  # the study's context (192 + 32) grown to hold this prompt


@pytest.mark.parametrize(
    "steps, words",
    [
        ({"engine": "vllm", "decode_scale": 2.0, "prefill_scale": 1.0}, "lacks ['step_overhead_us']"),
        (
            {"engine": "vllm", "decode_scale": 0, "prefill_scale": 1.0, "step_overhead_us": 0},
            "decode_scale must be > 0",
        ),
        ({"engine": "vllm", "decode_scale": 1, "prefill_scale": 1, "step_overhead_us": 0, "speed": 2}, "unknown"),
        ({"engine": 3, "decode_scale": 1, "prefill_scale": 1, "step_overhead_us": 0}, "engine must be a string"),
        ({"engine": "vllm", "decode_scale": 1, "prefill_scale": 1, "step_overhead_us": -1}, "must be >= 0"),
    ],
)
def test_a_bad_serving_steps_section_is_refused_naming_the_key(steps, words):
    with pytest.raises(ValueError, match="my.yaml") as caught:
        validate_profile({**load_profile("cpu"), "serving_steps": steps}, "my.yaml")
    assert words in str(caught.value)


def test_the_factors_move_the_models_decode_and_prompt_figures_apart():
    spec, ctx, config = _context()
    cols = columns_from_params([config])

    def figures(**steps):
        hardware = dict(ctx.hardware)
        if steps:
            hardware["serving_steps"] = {"engine": "x", "step_overhead_us": 0.0, **steps}
        out = simulate_configs(dict(ctx.model), dict(ctx.workload), hardware, dict(ctx.cluster), dict(cols))
        ttft = float(out["batch1_ttft_ms"][0]) / 1e3
        # the model's continuous max rate: goodput is read on the ladder, where two engines may meet the same rung
        rate = float(out["max_rate_rps_model_per_device"][0])
        return ttft, float(out["batch1_time_for_100_tokens_s"][0]) - ttft, rate

    plain = figures()
    slow_decode = figures(decode_scale=3.0, prefill_scale=1.0)
    slow_prompt = figures(decode_scale=1.0, prefill_scale=3.0)
    assert slow_decode[1] == pytest.approx(3.0 * plain[1], rel=1e-6)  # decoding only: three times the model's
    assert slow_prompt[1] == pytest.approx(plain[1], rel=1e-6)  # the prompt's factor leaves decoding alone
    # a prompt's step has a part without its tokens (the step's fixed costs) and the tokens' part: each
    # factor scales its own, so the two slow-downs of the batch's TTFT add up to both at once
    both = figures(decode_scale=3.0, prefill_scale=3.0)
    assert plain[0] < slow_decode[0] < both[0] and plain[0] < slow_prompt[0] < both[0]
    assert slow_decode[0] + slow_prompt[0] - plain[0] == pytest.approx(both[0], rel=1e-6)
    assert slow_decode[2] < plain[2]  # a slower engine sustains less


def test_a_closed_loop_batch_prices_the_first_prompt_alone_and_the_others_a_token_each():
    """vLLM reads a batch sent at once as its requests reach the engine: the first alone in a step of
    its own, the others together in the next (beside the first one's decode). With the engine's step
    made only of a fixed cost and a cost per prompt token, the batch's TTFT is two steps' fixed costs
    and every prompt's tokens; priced as one step of all b prompts, it was one step's."""
    spec, ctx, config = _context()
    step_s, token_s, prompt = 0.02, 30e-6, 256
    steps = {
        "engine": "x",
        "decode_scale": 1e-3,
        "prefill_scale": 1e-3,
        "step_overhead_us": step_s * 1e6,
        "sequence_overhead_us": 0.0,
        "context_overhead_ns": 0.0,
        "prompt_token_overhead_ns": token_s * 1e9,
    }
    validate_profile({**ctx.hardware, "serving_steps": steps}, "by hand")
    theta = [steps.get(k, default) for k, default, _ in TERMS]
    workload = _workload(ctx, prompt, [1, 8])
    ttft1, _, ttft8, _ = modelled_figures(ctx.model, workload, ctx.hardware, ctx.cluster, config, _keys([1, 8]), theta)
    api = API_OVERHEAD_S  # the model's API server, outside the steps
    assert ttft1 == pytest.approx(api + step_s + prompt * token_s, rel=0.02)
    assert ttft8 == pytest.approx(api + 2 * step_s + 8 * prompt * token_s, rel=0.02)
    # a profile written before the cost a prompt token was fitted prices as it did
    older = {k: v for k, v in steps.items() if k != "prompt_token_overhead_ns"}
    validate_profile({**ctx.hardware, "serving_steps": older}, "older")
    no_token = [older.get(k, default) for k, default, _ in TERMS]
    ttft1_older = modelled_figures(ctx.model, workload, ctx.hardware, ctx.cluster, config, _keys([1]), no_token)[0]
    assert ttft1_older == pytest.approx(api + step_s, rel=0.02)


@pytest.mark.timeout(300)
def test_calibrate_serving_measures_the_engine_and_writes_a_profile_that_predicts_it(write_spec, tmp_path):
    fake = fake_vllm(tmp_path, ttft_ms=40, token_ms=20)  # whatever the batch
    spec_path = write_spec(
        f"""
name: calibrate-fake
model: tiny-llama
workload:
  kind: serve
  traffic: {{rates: [2, 4], prompt_len: 32, output_len: 4, duration_s: 1, warmup_requests: 1}}
  slo: {{ttft_p99_ms: 20000, tpot_p99_ms: 5000}}
  startup_timeout_s: 30
  timeout_s: 60
cluster: {{accelerator: cpu, profile: cpu, nodes: 1, devices_per_node: 1, calibrate: never}}
target: vllm
backend: {{kind: vllm, python: {sys.executable}, entry: {fake}}}
space:
  max_num_seqs: [2, 4]
  graph_mode: [eager]
ray: {{enabled: false}}
""",
        "serve.yaml",
    )
    out = tmp_path / "host.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--serving", str(spec_path), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)
    assert said["config"]["max_num_seqs"] == 4 and not said["failures"]
    profile = load_profile(str(out))  # the file loads as a profile a spec can name
    steps = profile["serving_steps"]
    assert {p["prompt_len"] for p in steps["points"]} == {16, 32}  # twice the mean is past the context
    assert {p["batch"] for p in steps["points"]} == {1, 2, 4}
    # the fake takes 40 ms + 99 x 20 ms for 100 tokens whatever the batch: the calibrated model says so
    spec = load_spec(spec_path)
    ctx = probe_context(spec)
    cols = columns_from_params([said["config"]])
    workload = {**dict(ctx.workload), "batch_sweep": [1, 4]}
    calibrated = simulate_configs(dict(ctx.model), workload, profile, dict(ctx.cluster), dict(cols))
    bundled = simulate_configs(dict(ctx.model), workload, dict(ctx.hardware), dict(ctx.cluster), dict(cols))
    for b in (1, 4):
        measured = 0.04 + 99 * 0.02
        assert calibrated[f"batch{b}_time_for_100_tokens_s"][0] == pytest.approx(measured, rel=0.25)
        assert bundled[f"batch{b}_time_for_100_tokens_s"][0] < 0.5 * measured  # far off before
    kept = [json.loads(line) for line in (tmp_path / "host.serving-calibration" / "readings.jsonl").open()]
    # three rounds by default, each over every prompt length, so that a slow spell falls on a round
    assert [(k["repeat"], k["prompt_len"]) for k in kept] == [(r, n) for r in range(3) for n in (16, 32)]
    assert all(k["info"]["serving"]["requests_jsonl"] for k in kept)
    assert {k["output_len"] for k in kept} == {4}  # what a refit checks its spec against
    assert steps["repeats"] == 3 and {p["readings"] for p in steps["points"]} == {3}
    assert all(0 <= p["spread"] < 1 for p in steps["points"]) and steps["repeat_spread"] >= 0
    text = out.read_text()
    assert text.startswith("# Hardware profile written by `autotune calibrate --serving")
    assert "each the median of up to 3 rounds" in text
    assert yaml.safe_load(text)["serving_steps"]["engine"]


def test_calibrate_serving_refuses_a_spec_it_cannot_measure(write_spec, tmp_path):
    train = REPO / "search_spaces" / "tiny_llama_cpu.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--serving", str(train), "--out", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "workload is 'train'" in result.output
    data = yaml.safe_load(SPEC.read_text())
    data["backend"] = {"kind": "simulate"}
    simulated = write_spec(yaml.safe_dump(data), "sim.yaml")
    result = CliRunner().invoke(app, ["calibrate", "--serving", str(simulated), "--out", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "simulator" in result.output, result.output
    result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "x.yaml"), "--set", "max_num_seqs=2"])
    assert result.exit_code == 2 and "--set picks the config of --serving" in result.output
    for argv, words in (
        (["--serving", str(SPEC), "--repeats", "0"], "--repeats: expected at least 1"),
        (["--serving", str(SPEC), "--repeats", "2", "--readings", str(tmp_path)], "--readings refits readings"),
        (["--repeats", "2"], "give the spec with --serving"),
    ):
        result = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "x.yaml"), *argv])
        assert result.exit_code == 2 and words in result.output, (argv, result.output)
    assert not (tmp_path / "x.yaml").exists()


def test_solve_steps_leaves_a_term_no_reading_weighs_at_the_uncorrected_model():
    """A fit set that cannot see a term (here: no reading moves the prompt part) leaves it where the
    uncorrected model has it, and the prior's weight decides how far the terms it does see may move."""
    import numpy as np

    from autotune.workers.calibrate_serving import solve_steps

    c = np.array([1.0, 2.0, 3.0])  # the uncorrected model's figures less their slopes' share
    J = np.zeros((3, len(TERMS)))
    J[:, 0] = [0.5, 1.0, 1.5]  # the decode part: what each reading's figure gains per unit of its factor
    target = c + J[:, 0] * 3.0  # readings that want the decode part x3
    faint = solve_steps(J, c, target)
    strong = solve_steps(J, c, target, pull=10.0)
    assert faint[0] == pytest.approx(3.0, rel=1e-3) and faint[1] == pytest.approx(1.0, abs=1e-6)
    assert 1.0 < strong[0] < 2.5 and strong[1] == pytest.approx(1.0, abs=1e-6)


def test_a_batch_whose_stream_came_piled_up_is_left_out_of_the_fit_and_said():
    """A batch whose tokens mostly reached the client in one chunk (the API server behind: on the 2-core
    machine a request of 32 tokens came back whole, TTFT 98 ms, TPOT 0) times the server's lag. Left in,
    it pulls the decode step toward zero; left out, the fit is the one the other readings make."""
    spec, ctx, config = _context()
    batches = calibration_batches(int(config["max_num_seqs"]))
    runs, clean = [], []
    for prompt in calibration_prompts(128, 32, None):
        workload = _workload(ctx, prompt, batches)
        truth = modelled_figures(ctx.model, workload, ctx.hardware, ctx.cluster, config, _keys(batches), TRUTH)
        measured = {k: v * (1e3 if k.endswith("_ms") else 1) for k, v in zip(_keys(batches), truth)}
        measured.update({f"batch{b}_tokens_apart_share": 1.0 for b in batches})
        clean.append(ServingRun(prompt, workload, dict(measured)))
        if prompt == min(calibration_prompts(128, 32, None)):  # its batch of 1 came back whole
            measured.update(
                batch1_time_for_100_tokens_s=measured["batch1_ttft_ms"] / 1e3, batch1_tokens_apart_share=0.0
            )
        runs.append(ServingRun(prompt, workload, measured))
    steps = fit_serving_steps(runs, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    assert steps["left_out"] == [{"prompt_len": runs[0].prompt_len, "batch": 1, "tokens_apart_share": 0.0}]
    assert len(steps["points"]) == 3 * 5 * 2 - 2 and steps["rms_error"] < 1e-3
    kept = fit_serving_steps(clean, ctx.model, ctx.hardware, ctx.cluster, config, "vllm 0.32.0")
    assert kept["left_out"] == []
    unseen = _workload(ctx, 100, [3, 12])
    assert modelled_figures(
        ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), [steps[k] for k, _, _ in TERMS]
    ) == pytest.approx(
        modelled_figures(
            ctx.model, unseen, ctx.hardware, ctx.cluster, config, _keys([3, 12]), [kept[k] for k, _, _ in TERMS]
        ),
        rel=0.01,
    )
    # read as a decode reading, the piled-up batch moves the fit off the truth
    as_read = [
        ServingRun(r.prompt_len, r.workload, {k: v for k, v in r.measured.items() if "share" not in k}) for r in runs
    ]
    assert fit_serving_steps(as_read, ctx.model, ctx.hardware, ctx.cluster, config, "vllm")["rms_error"] > 0.02
    validate_profile({**ctx.hardware, "serving_steps": steps}, "fitted")
