"""The search benchmark's production path (issue 41): worlds whose probes report the step time and
the peak only, whose usable memory sits below the nominal, and whose out-of-memory failures come
in the frameworks' own words; and the benchmark's two checks over the trials (a layout probed again
after an OOM with only precision / HCCL / graph flags changed; the P(fits) calibration of the full
probes). Behaviour only: no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import search_efficiency as se  # noqa: E402
import true_world as tw  # noqa: E402

from autotune.spec.resolve import probe_context  # noqa: E402
from support import measured_record  # noqa: E402
from autotune.spec.space import Space  # noqa: E402
from autotune.workers.protocol import USABLE_KEY, classify_failure, oom_evidence  # noqa: E402

SCENARIO = "7b-8x32"


@pytest.fixture(scope="module")
def scenario():
    """The smallest scenario's spec, its valid configs and the probe context."""
    spec = se.spec_for(SCENARIO, se.SCENARIOS[SCENARIO], 3, 0, None)
    space = Space(spec)
    return spec, space, space.enumerate().configs, probe_context(spec)


def _world(scenario, path: str, oom_format: str | None = None, seed: int = 1000) -> tw.World:
    spec, space, _, ctx = scenario
    options = tw.PATHS[path]
    if oom_format is not None:
        options = tw.PathOptions(options.peak_only, options.usable_below, oom_format)
    return tw.World.draw(seed, ctx.hardware, space.choices).on_path(options, oom_format)


def _one(scenario, world: tw.World, fits: bool) -> dict:
    """A config of the space that fits (or does not) in ``world``."""
    _, _, configs, ctx = scenario
    t = world.truth(ctx.model, ctx.workload, ctx.cluster, configs)
    for config, valid, fit in zip(configs, t["valid"], t["fits"]):
        if valid and bool(fit) == fits:
            return config
    raise LookupError("no such config")


def _launch(tmp_path: Path, scenario, world: tw.World, config: dict, *extra: str) -> subprocess.CompletedProcess:
    """The world's launcher as the command backend runs it: a subprocess with a trial file."""
    _, _, _, ctx = scenario
    world_file = tmp_path / "world.json"
    world_file.write_text(json.dumps(world.to_json()))
    trial = tmp_path / "trial.json"
    trial.write_text(
        json.dumps(
            {"model": ctx.model, "workload": ctx.workload, "cluster": ctx.cluster, "params": config, "number": 3}
        )
    )
    env = {**os.environ, "AUTOTUNE_BENCH_WORLD": str(world_file)}
    return subprocess.run(
        [sys.executable, str(BENCH / "true_world.py"), str(trial), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_production_world_draws_usable_memory_below_the_nominal(scenario):
    world = _world(scenario, "production")
    assert world.peak_only and world.oom_format in tw.MIXED_OOM_FORMATS
    assert tw.USABLE_BELOW[0] <= world.usable_below <= tw.USABLE_BELOW[1]
    _, _, configs, ctx = scenario
    t = world.truth(ctx.model, ctx.workload, ctx.cluster, configs[:5])
    assert t["capacity"] == pytest.approx(t["nominal"] * (1 - world.usable_below))
    # the lab's worlds are what they were: the whole nominal usable, no format of their own
    lab = _world(scenario, "lab")
    assert lab.usable_below == 0.0 and lab.oom_format is None and not lab.peak_only
    assert tw.World.from_json(json.loads(json.dumps(world.to_json()))) == world


def test_the_device_check_reads_what_the_real_check_would_before_any_communicator(scenario):
    """workers/device_check.py reads free + reserved after one small tensor, before a communicator
    exists: the world's capacity less its runtime's context, with the communication buffers still
    free. The benchmark once subtracted the smallest config's buffers too (1-4 GiB the real check
    never loses), and the guide believed less usable memory than there was."""
    spec, _, configs, _ = scenario
    world = _world(scenario, "production")
    truth = se.Truth(world, spec, configs)
    t = world.truth(truth.ctx.model, truth.ctx.workload, truth.ctx.cluster, configs)
    valid = t["valid"].astype(bool)
    checked = se.with_device_check(spec, truth).cluster.overrides["usable_memory_gib"]
    runtime = float(np.nanmax(t["runtime_reserve_gib"][valid]))
    assert checked == pytest.approx(float(np.nanmax(t["capacity"][valid])) - runtime, abs=2e-3)
    # more than any config's allocator can use once its communicators hold their buffers
    assert checked > float(np.nanmax((t["limit"] - t["held_outside_gib"])[valid]))


def test_probe_output_has_no_usable_memory_on_the_production_path(tmp_path, scenario):
    world = _world(scenario, "production")
    config = _one(scenario, world, fits=True)
    run = _launch(tmp_path, scenario, world, config)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert USABLE_KEY not in run.stdout and "peak_reserved_gib" not in out["metrics"]
    assert set(out["metrics"]) == {"step_time_s", "tokens_per_s_per_device", "tokens_per_s", "peak_memory_gib"}
    # the lab path reports both, as the torch probe does on a device
    lab = _world(scenario, "lab")
    _, _, _, ctx = scenario
    measured = lab.measure(ctx.model, ctx.workload, ctx.cluster, _one(scenario, lab, fits=True))
    assert USABLE_KEY in measured["info"] and "peak_reserved_gib" in measured["metrics"]


@pytest.mark.parametrize("fmt", tw.MIXED_OOM_FORMATS)
def test_oom_formats_parse_as_oom(scenario, fmt):
    world = _world(scenario, "production", fmt)
    _, _, _, ctx = scenario
    config = _one(scenario, world, fits=False)
    out = world.measure(ctx.model, ctx.workload, ctx.cluster, config, 5)
    assert out["failure"] == "oom" and out["format"] == fmt
    rc, lines = tw.probe_output(out)
    assert rc != 0
    assert classify_failure(rc, lines)[0] == "oom"
    # the in-process dispatcher makes of them what the command backend makes
    result = se.parse_probe_output(rc, lines, 1.0)
    assert result.status == "oom"
    evidence = oom_evidence(lines)
    if fmt in ("cuda", "npu"):  # the allocator's numbers: a request larger than what was free failed
        assert evidence is not None and evidence["requested"] > evidence["free"]
        assert evidence["capacity"] == pytest.approx(out["capacity"], abs=0.01)
        # in use + requested: above the device's total, at most the config's need (nothing else is held here)
        assert out["capacity"] - 0.01 <= evidence["needed_at_least"] <= out["need"] + 0.01
        assert result.info["oom"] == evidence
    elif fmt == "plain":
        assert evidence is None  # no numbers at all
    elif evidence is not None:  # MindSpore's: the pool it took at start, and its need within the pool
        assert evidence["needed_at_least"] <= out["need"] + 0.01
        # the pool is what its allocator could use: the usable memory less what lives beside it
        # (runtime, HCCL), the figure a probe that reports it gives (USABLE_KEY); it failed over it
        assert evidence["allocator_usable"] < out["limit"] - 0.1
        assert evidence["needed_at_least"] > evidence["allocator_usable"]


def test_vllm_format_is_the_engines_words(scenario):
    world = _world(scenario, "production", "vllm")
    _, _, _, ctx = scenario
    out = world.measure(ctx.model, ctx.workload, ctx.cluster, _one(scenario, world, fits=False), 1)
    rc, lines = tw.probe_output(out)
    assert rc == 1 and any("No available memory for the cache blocks" in line for line in lines)
    # whatever the generic parser makes of it, the benchmark counts it as an OOM the study misread
    # when it is not "oom" (misread_ooms); it is not in --oom-format mixed
    assert "vllm" not in tw.MIXED_OOM_FORMATS


def test_launcher_prints_the_format_on_every_node(tmp_path, scenario):
    world = _world(scenario, "production", "cuda")
    config = _one(scenario, world, fits=False)
    for rank in ("0", "1"):
        run = _launch(tmp_path, scenario, world, config, "--node-rank", rank)
        assert run.returncode == 1
        assert classify_failure(run.returncode, run.stdout.splitlines())[0] == "oom"
        assert "CUDA out of memory. Tried to allocate" in run.stdout


def _record(number: int, config: dict, status: str, p_fit: float | None = None, profile: dict | None = None):
    predicted = {} if p_fit is None else {"guided_p_fit": p_fit}
    return measured_record(number, config, {}, status=status, predicted=predicted, memory_profile=profile or {})


def test_a_full_probe_that_runs_out_of_memory_is_priced_up_to_the_step_that_fails(scenario):
    """A probe's wall priced by what it runs (issue 41): start-up and the steps up to the failing one,
    counted whole, not the six a full probe measures; memory that grows after step 1 fails later."""
    _, _, configs, ctx = scenario
    world = _world(scenario, "production")
    over = _one(scenario, world, fits=False)
    steps = tw._steps_run(ctx.workload)
    one_step = tw.FULL_PROBE_WALL_S * (tw.PROBE_STARTUP_SHARE + (1 - tw.PROBE_STARTUP_SHARE) / steps)
    assert tw.oom_wall_s(world, ctx.model, ctx.workload, ctx.cluster, over) == pytest.approx(one_step)
    # a config over the limit only once the optimizer states' late growth lands (step 3): it fails there
    grows = tw.World.draw(7, ctx.hardware, Space(scenario[0]).choices)
    grows.structure = {"tracker-ooms": 1.0}
    first = grows.truth(ctx.model, {**ctx.workload, "warmup_steps": 0, "measured_steps": 1}, ctx.cluster, configs)
    full = grows.truth(ctx.model, ctx.workload, ctx.cluster, configs)
    late = [c for c, v, f1, f in zip(configs, full["valid"], first["fits"], full["fits"]) if v and f1 and not f]
    assert late, "no config that fits its first step and not its third in this world"
    walls = {tw.oom_wall_s(grows, ctx.model, ctx.workload, ctx.cluster, c) for c in late}
    assert min(walls) > one_step and max(walls) < tw.FULL_PROBE_WALL_S


def test_a_short_re_measurement_reads_noisier_and_costs_its_steps(tmp_path, scenario):
    """A re-measurement of fewer timed steps (autotune.guide.short_remeasure) costs the world's
    start-up and its steps, and its reading carries its few steps' spread on top of the launch's
    noise; a full probe's reading is as before (no spread added where it times every step)."""
    _, _, _, ctx = scenario
    world = _world(scenario, "production")
    config = _one(scenario, world, fits=True)
    full = ctx.workload["measured_steps"]
    short = {**ctx.workload, "measured_steps": 1}

    def reading(workload, run):
        out = world.measure(ctx.model, workload, ctx.cluster, config, run, full_steps=full)
        return out["metrics"]["step_time_s"]

    runs = range(400)
    plain = [world.measure(ctx.model, ctx.workload, ctx.cluster, config, r)["metrics"]["step_time_s"] for r in runs]
    assert [reading(ctx.workload, r) for r in runs] == plain
    ratios = np.array([reading(short, r) / p for r, p in zip(runs, plain)])
    extra = tw.STEP_JITTER * np.sqrt(1.0 - 1.0 / full)
    assert np.std(ratios) == pytest.approx(extra, rel=0.2) and abs(np.mean(ratios) - 1.0) < 0.01
    share = tw.steps_share(short, full)
    assert share == pytest.approx(3 / 7)
    assert tw.probe_wall_s(32, 32, False, share) == pytest.approx(100 * (0.15 + 0.85 * 3 / 7))
    # the launcher checks what autotune's {measured_steps} says against the trial file
    bad = _launch(tmp_path, scenario, world, config, "--measured-steps", "1")
    assert bad.returncode == 2 and "disagrees with the trial file's workload" in bad.stderr


def test_a_trials_launches_share_their_noise_or_draw_their_own(scenario, monkeypatch):
    """--launch-noise: with one draw per trial (the default) a memory profile's peak and its full
    probe's are off the truth by the same factor, so a profile's extrapolation checked against its
    own trial's full probe looks exact; with one per launch each is off by its own, as separate
    launches of different sizes read. A full probe's reading is the same either way but for its draw."""
    from autotune.guide.memory_profile import PROFILE_MARK

    _, _, _, ctx = scenario
    world = _world(scenario, "production")
    config = _one(scenario, world, fits=True)
    cut = {**ctx.model, "num_hidden_layers": 4}
    profile = {**ctx.workload, "measured_steps": 1, PROFILE_MARK: 2}

    def errors(noise: str) -> np.ndarray:
        monkeypatch.setattr(tw, "LAUNCH_NOISE", noise)
        out = []
        for run in range(40):
            pair = []
            for model, workload in ((cut, profile), (ctx.model, ctx.workload)):
                peak = world.measure(model, workload, ctx.cluster, config, run)["metrics"]["peak_memory_gib"]
                pair.append(peak / float(world.truth(model, workload, ctx.cluster, [config])["peak_memory_gib"][0]))
            out.append(pair)
        return np.array(out)

    shared, own = errors("trial"), errors("launch")
    assert np.allclose(shared[:, 0], shared[:, 1])  # the same factor on both peaks
    assert not np.allclose(own[:, 0], own[:, 1]) and np.all(np.abs(own - 1.0) <= 0.01 + 1e-12)
    assert np.corrcoef(own[:, 0], own[:, 1])[0, 1] < 0.5


def test_repeat_check_counts_a_layout_probed_again_after_an_oom():
    base = {"tp": 2, "pp": 1, "micro_batch_size": 2, "precision": "bf16", "env.HCCL_BUFFSIZE": "200"}
    records = [
        _record(0, base, "oom"),
        _record(1, {**base, "env.HCCL_BUFFSIZE": "400"}, "oom"),  # a repeat, out of memory again
        _record(2, {**base, "micro_batch_size": 1}, "ok"),  # another layout
        _record(3, {**base, "precision": "fp16", "compile": "default"}, "ok"),  # a repeat that fitted
        # its profile stopped it: no full probe, no repeat
        _record(4, {**base, "env.HCCL_BUFFSIZE": "120"}, "oom_predicted", profile={"verdict": "oom_predicted"}),
        _record(5, {**base, "micro_batch_size": 1, "env.HCCL_BUFFSIZE": "400"}, "ok"),  # its layout fitted
    ]
    repeats = se.repeats_after_oom(records)
    assert [(r["trial"], r["after"], r["oom_again"]) for r in repeats] == [(1, 0, True), (3, 0, False)]
    assert repeats[0]["changed"] == {"env.HCCL_BUFFSIZE": ("200", "400")}
    assert se.layout_of(base) == se.layout_of({**base, "precision": "fp32", "env.HCCL_CONNECT_TIMEOUT": "600"})


def test_the_race_check_reads_the_pair_the_guides_own_reason_names():
    """``race_pairs`` reads the leader and the threat from the reason the guide writes
    (``GuideRace.close_call``, not a copy of its words) and judges the pair by the world's truth:
    twins that differ only in an HCCL buffer are one config to the race; a layout 5 % apart is a
    pair whose order matters."""
    from types import SimpleNamespace

    from support import flat_guide

    from autotune.guide.guided import Observation

    guide = flat_guide(2)
    again = guide.close_call([Observation(0, "ok", 1000.0, 1.0, number=3), Observation(1, "ok", 1010.0, 1.0, number=5)])
    assert again is not None and again.remeasure and "trial 5 leads" in again.reason
    twin = {"tp": 2, "micro_batch_size": 1, "env.HCCL_BUFFSIZE": "200"}
    cases = [
        ({**twin, "env.HCCL_BUFFSIZE": "400"}, 1.001, {"equal": 1, "env_only": 1, "env_only_equal": 1}),
        ({**twin, "micro_batch_size": 2, "dp": 4}, 0.95, {"apart": 1}),
        ({**twin, "micro_batch_size": 2}, 0.99, {"tied": 1}),
    ]
    for other, ratio, expected in cases:
        records = [
            _record(3, twin, "ok"),
            _record(5, other, "ok"),
            measured_record(6, other, {}, chosen_because=again.reason),
            measured_record(7, twin, {}, chosen_because="rank 1 by model"),  # not the race's
        ]
        truth = SimpleNamespace(value={se.config_key(twin): 1000.0, se.config_key(other): 1000.0 * ratio})
        counts = se.race_pairs(records, truth)
        assert counts == {**dict.fromkeys(se.RACE_KINDS, 0), **expected}, (other, counts)


def test_calibration_bins_the_full_probes_by_their_stated_p_fit():
    configs = [{"tp": t} for t in (1, 2, 4, 8, 16)]
    fits = {se.config_key(c): c["tp"] != 2 for c in configs}
    records = [
        _record(0, configs[0], "ok", 0.3),
        _record(1, configs[1], "oom", 0.95),
        _record(2, configs[2], "ok", 1.0),  # P(fits) 1: the last bin is closed
        _record(3, configs[3], "ok", 0.6, profile={"verdict": "probe", "p_fit": 0.92}),
        _record(4, configs[4], "oom_predicted", 0.5, profile={"verdict": "oom_predicted", "p_fit": 0.1}),
        _record(5, configs[0], "ok"),  # not chosen by the guide (no P(fits)): left out
    ]
    rows = se.full_probe_calibration(records, fits)
    assert [r["trial"] for r in rows] == [0, 1, 2, 3]
    assert se.p_fit_bins(rows) == [("[0,0.5)", 1, 1), ("[0.5,0.7)", 1, 1), ("[0.7,0.9)", 0, 0), ("[0.9,1]", 2, 1)]
    # by the P(fits) the full probe ran at: trial 3's profile said 0.92
    assert se.p_fit_bins(rows, "stated")[-1] == ("[0.9,1]", 3, 2)
    assert se.misread_ooms([*records, _record(6, configs[1], "crash", 0.9)], fits) == 1


def test_the_profiles_verdicts_are_judged_by_the_truth_those_turned_away_included():
    """``profile_verdicts``: every profile with a verdict, run in full or turned away, against whether
    the config truly fits; a failed profile (no verdict) and a config never profiled are left out."""
    configs = [{"tp": t} for t in (1, 2, 4, 8, 16)]
    fits = {se.config_key(c): c["tp"] != 2 for c in configs}
    records = [
        _record(0, configs[0], "ok", 0.6, profile={"verdict": "probe", "p_fit": 0.55}),
        _record(1, configs[1], "oom_predicted", 0.5, profile={"verdict": "oom_predicted", "p_fit": 0.42}),
        _record(2, configs[2], "oom_predicted", 0.5, profile={"verdict": "oom_predicted", "p_fit": 0.45}),
        _record(3, configs[3], "ok", 0.6, profile={"verdict": "failed"}),
        _record(4, configs[4], "ok", 1.0),
    ]
    rows = se.profile_verdicts(records, fits)
    assert [(r["trial"], r["run"], r["fitted"]) for r in rows] == [(0, True, True), (1, False, False), (2, False, True)]
    bins = dict((b, (n, fit, ran)) for b, n, fit, ran in se.verdict_bins(rows))
    # of the two turned away at 0.3-0.5, one would have fitted
    assert bins["[0.3,0.5)"] == (2, 1, 0) and bins["[0.5,0.7)"] == (1, 1, 1) and bins["[0.9,1]"] == (0, 0, 0)


def test_a_miss_says_why_and_a_share_of_worlds_its_interval():
    """``miss_cause``: a reported best within 2 % is no miss; below it, a study that measured a config
    within 2 % reported another; one that did not is judged by what the guide believed of the optimum
    at the end, in order: a profile of it or of a config within 2 % of it said not to run it (the memory
    edge, whatever the model predicted); the model put it below the best measured (the model, whatever
    its memory); its memory unsure; else predicted to win, sure to fit and left unprobed.
    ``share_cell``: 30 worlds put a 90 % share in an interval 25 points wide, 240 in one of 8."""
    seen = se.OptimumSeen
    hit = {"final": 0.985, "best_probed": 1.0}
    assert se.miss_cause(hit, seen(0.3, True, True)) is None
    found = {"final": 0.97, "best_probed": 0.99}
    assert se.miss_cause(found, None) == se.MISS_CAUSES[0]
    never = {"final": 0.95, "best_probed": 0.95}
    assert se.miss_cause(never, seen(0.45, True, True)) == se.MISS_CAUSES[1]
    assert se.miss_cause(never, seen(0.45, False, True)) == se.MISS_CAUSES[2]
    assert se.miss_cause(never, seen(0.99, False, True)) == se.MISS_CAUSES[2]
    assert se.miss_cause(never, seen(0.5, False, False)) == se.MISS_CAUSES[3]
    assert se.miss_cause(never, seen(0.99, False, False)) == se.MISS_CAUSES[4]
    assert se.miss_cause(never, None) is None  # no view of the optimum: counted as a miss, no cause
    assert se.share_cell(27, 30) == "90% [73%-98%]" and se.share_cell(216, 240) == "90% [85%-93%]"
    assert se.share_cell(30, 30).endswith("-100%]") and se.share_cell(0, 0) == "-"


@pytest.mark.parametrize("profiles", [True, False], ids=["profiles", "no-profiles"])
def test_benchmark_runs_on_the_production_path(tmp_path, capsys, profiles):
    argv = ["--methods", "autotune", "--in-process", "--worlds", "1", "--scenarios", SCENARIO, "--budget", "3"]
    argv += ["--path", "production", "--oom-format", "mixed", "--json", str(tmp_path / "rows.json")]
    results = se.main(argv + ([] if profiles else ["--no-memory-profiles"]))
    row = results[SCENARIO]["autotune"][0]
    assert row["oom_format"] in tw.MIXED_OOM_FORMATS and tw.USABLE_BELOW[0] <= row["usable_below"] <= 0.12
    assert isinstance(row["repeats"], list) and isinstance(row["misread_ooms"], int)
    assert all({"chosen", "stated", "fitted"} <= set(x) for x in row["p_fit"])
    # the study's budget in full-probe equivalents is counted from the modelled walls in-process
    assert row["study_cost"] == pytest.approx(row["model_cost"], rel=0.05, abs=0.3)
    text = capsys.readouterr().out
    assert "path production: peak only True" in text
    assert "repeats after an OOM" in text and "P(fits) calibration of the full probes" in text
    assert "[0.9,1]" in text and "memory profiles' verdicts against the truth" in text
    assert "by why (miss_cause)" in text and row["miss"] in (None, *se.MISS_CAUSES)
    assert json.loads((tmp_path / "rows.json").read_text())[SCENARIO]["autotune"][0]["p_fit"] == row["p_fit"]
