"""Profile, then probe (issue #35): the study runs a config the guide is not sure fits with fewer
layers first, decides from the fitted peak, and counts the budget in full-probe equivalents.

The last test is the acceptance on real probes: a tiny-Llama study with the torch probe on this
CPU uses memory profiles, and every full probe that followed one measured a peak inside the band
its profile predicted."""

from __future__ import annotations

import json
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.guide.guided import Guide, GuideSettings, Observation
from autotune.guide.memory_profile import (
    ProfileEstimate,
    calibrate_estimate,
    cost_of_trials,
    full_probe_cost_fpe,
    extrapolate_peak,
    plan_profile,
    profile_points,
    profile_residuals,
    trial_cost_fpe,
)
from autotune.study.profiling import MemoryProfiler, ProfileRun
from autotune.trial_attrs import A
from autotune.workers.protocol import ProbeResult, TrialRequest

TINY16 = (
    "{name: tiny-llama-16, hidden_size: 512, num_hidden_layers: 16, num_attention_heads: 8, "
    "num_key_value_heads: 4, intermediate_size: 1376, vocab_size: 2048, max_position_embeddings: 1024}"
)


# ------------------------------------------------------------------------------------ the pieces
def test_a_profile_is_planned_only_where_the_stages_hold_enough_layers():
    model = {"num_hidden_layers": 32}
    assert plan_profile(model, {"pp": 1}) == (1, 8)  # 32 per stage: the second at a quarter of it
    assert plan_profile(model, {"pp": 2}) == (1, 4)  # 16 per stage: a quarter is the fewest a second reads
    assert plan_profile({"num_hidden_layers": 80}, {"pp": 1}) == (1, 20)  # 70B: leverage 6, not 36 from 4
    assert plan_profile(model, {"pp": 4}) == (1, 4)  # 8 per stage: half of it
    assert plan_profile(model, {"pp": 4, "vpp": 2}) == (1, 2)  # 4 per virtual stage
    assert plan_profile(model, {"pp": 8, "vpp": 2}) is None  # 2 per stage: a profile costs a probe
    assert plan_profile(model, {"pp": 4, "first_stage_layers": 5}) is None  # stages unlike one another


def test_the_highest_stage_decides_and_a_probe_without_stages_is_one():
    assert profile_points({"peak_memory_gib": 3.0}, {"peak_memory_gib_by_stage": [2.0, 2.5]}) == {0: 2.0, 1: 2.5}
    assert profile_points({"peak_memory_gib": 3.0}, {}) == {0: 3.0}
    assert profile_points({}, {}) == {}
    # stage 0: 10 + 1/layer; stage 1: 8 + 1.5/layer: at 16 per stage the last stage is higher
    est = extrapolate_peak({0: {1: 11.0, 4: 14.0}, 1: {1: 9.5, 4: 14.0}}, 16, noise_rel=0.0)
    assert est.stage == 1 and est.peak_gib == pytest.approx(32.0)
    with pytest.raises(ValueError):
        extrapolate_peak({0: {1: 11.0}}, 16)


def test_measured_profile_errors_move_and_narrow_the_estimate():
    raw = ProfileEstimate(30.0, 0.9, 0, 16.0)  # 3 % before any evidence
    assert calibrate_estimate(raw, []) == raw
    tight = calibrate_estimate(raw, [0.004, 0.006, 0.005])  # profiles read 0.5 % low, consistently
    assert tight.peak_gib > raw.peak_gib and tight.sd_gib < 0.5 * raw.sd_gib
    loose = calibrate_estimate(raw, [0.06, -0.05, 0.07])  # a stack whose memory is not linear in layers
    assert loose.sd_gib > tight.sd_gib
    attrs = [
        {
            A.STATUS: "ok",
            A.METRICS: {"peak_memory_gib": 31.0},
            A.MEMORY_PROFILE: {"verdict": "probe", "fit_peak_gib": 30.0},
        },
        {A.STATUS: "oom_predicted", A.MEMORY_PROFILE: {"verdict": "oom_predicted", "peak_gib": 40.0}},
        {A.STATUS: "ok", A.METRICS: {"peak_memory_gib": 20.0}},  # no profile
    ]
    assert profile_residuals(attrs) == [pytest.approx(1 / 30)]


def test_a_trials_cost_is_its_full_probe_and_its_profiles_share():
    profile = {"walls_s": [10.0, 20.0], "layers_per_stage": [1, 4], "full_layers_per_stage": 32}
    assert trial_cost_fpe(profile, True, 100.0) == pytest.approx(1.3)
    assert trial_cost_fpe({**profile, "verdict": "oom_predicted"}, False, 100.0) == pytest.approx(0.3)
    # before any full probe ran: start-up plus the layers' share, per run
    assert trial_cost_fpe(profile, False, None) == pytest.approx(0.2 + 5 / 32)
    attrs = [
        {A.STATUS: "ok", A.WALL: 100.0},
        {A.STATUS: "ok", A.WALL: 120.0, A.MEMORY_PROFILE: {**profile, "verdict": "probe"}},
        {A.STATUS: "oom_predicted", A.WALL: 30.0, A.MEMORY_PROFILE: {**profile, "verdict": "oom_predicted"}},
    ]
    assert cost_of_trials(attrs) == pytest.approx(1 + 1 + 30 / 110 + 30 / 110)


def test_a_full_probe_that_ran_out_of_memory_costs_the_wall_it_ran():
    """It ended at the step that failed: start-up and a step of a 6-step probe is about a third of one."""
    ok = [{A.STATUS: "ok", A.WALL: 100.0}, {A.STATUS: "ok", A.WALL: 120.0}]
    oom = {A.STATUS: "oom", A.WALL: 33.0}
    assert cost_of_trials([*ok, oom]) == pytest.approx(2 + 33 / 110)
    assert cost_of_trials([oom]) == 1.0  # no full probe's wall to measure it against yet
    assert full_probe_cost_fpe("oom", 500.0, 110.0) == 1.0  # sat on until its timeout: still one probe
    assert full_probe_cost_fpe("oom", 80.0, 110.0) == 1.0  # a late step: within a full probe's spread
    assert full_probe_cost_fpe("crash", 20.0, 110.0) == 1.0  # only an OOM: a crash may be anything
    # an OOM its memory profile caught ran no full probe: the profile's runs alone
    profile = {"walls_s": [10.0], "layers_per_stage": [1], "full_layers_per_stage": 32, "verdict": "oom"}
    assert cost_of_trials([*ok, {A.STATUS: "oom", A.WALL: 10.0, A.MEMORY_PROFILE: profile}]) == pytest.approx(
        2 + 10 / 110
    )


def _guide(peaks, limit=32.0, profiles=True):
    n = len(peaks)
    configs = [{"tp": 1, "micro_batch_size": i + 1} for i in range(n)]
    predictions = {
        "tokens_per_s_per_device": np.linspace(100, 200, n),
        "step_time_s": np.linspace(2, 1, n),
        "peak_memory_gib": np.asarray(peaks, dtype=float),
        "mem_activations": np.asarray(peaks, dtype=float) - 4.0,
        "mem_runtime_reserve": np.full(n, 3.0),
        "mem_comm_buffers": np.full(n, 1.0),
        "memory_limit_gib": np.full(n, limit),
        "valid": np.ones(n, bool),
    }
    ranking = SimpleNamespace(
        predictions=predictions,
        enumeration=SimpleNamespace(configs=configs, params=["tp", "micro_batch_size"]),
        objectives=[("tokens_per_s_per_device", "maximize")],
    )
    return Guide(ranking, ("tokens_per_s_per_device", "maximize"), GuideSettings(memory_profiles=profiles))


def test_after_a_profile_the_verdict_follows_the_profile_not_the_models_belief():
    guide = _guide([20.0, 26.0, 31.0, 36.0])
    measured = [Observation(index=0, status="ok", objective=100.0, peak_memory_gib=20.0, number=0)]
    p_fit, device, usable = guide.fit_after_profile(measured, 3, 30.0, 0.3)  # predicted 36: it fits
    assert p_fit > 0.99 and device == pytest.approx(30.0) and usable == pytest.approx(32.0)
    p_fit, _, _ = guide.fit_after_profile(measured, 1, 33.0, 0.3)  # predicted 26: it does not
    assert p_fit < 0.01
    # what the allocator counts leaves out the runtime and the buffers: the model adds them back
    p_fit, device, _ = guide.fit_after_profile(measured, 2, 28.5, 0.3, counts="allocated")
    assert device > 28.5 and p_fit < 0.5
    # a reported usable memory below the nominal one is what the verdict is taken against
    p_fit, _, usable = guide.fit_after_profile(measured, 3, 30.0, 0.3, usable_gib=24.0)
    assert usable == pytest.approx(min(32.0, 24.0 + 3.0 + 1.0)) and p_fit < 0.5


def test_a_profiled_config_teaches_the_memory_model_and_costs_no_oom():
    guide = _guide([20.0, 26.0, 31.0, 36.0])
    obs = [
        Observation(index=0, status="ok", objective=100.0, peak_memory_gib=20.0, number=0),
        Observation(index=3, status="oom_predicted", number=1, profile_peak_gib=38.0, profile_sd_gib=0.4),
    ]
    belief = guide._memory_belief(obs)
    assert belief.mean[3] > 36.5  # pulled towards the profile's 38
    assert not guide.oom_allowance_spent(sum(o.status == "oom" for o in obs), len(obs), 18)
    proposal, _ = guide.propose(obs, best=100.0, budget_left=18)
    assert proposal is not None and proposal.index != 3  # never proposed again


def test_a_profile_verdict_caps_the_configs_with_less_headroom_where_the_model_is_more_hopeful():
    """A profile that measured its layout against what its allocator could use said no (P 0.2),
    while the model, not knowing that capacity, puts the profiled peak under its limit: the model's
    P(fits) of that config and of every config it gives less headroom is capped at the verdict's."""
    guide = _guide([20.0, 26.0, 31.0, 36.0])
    measured = Observation(index=0, status="ok", objective=100.0, peak_memory_gib=20.0, number=0)
    profiled = dict(index=2, status="oom_predicted", number=1, profile_peak_gib=28.0, profile_sd_gib=0.3)
    hopeful = [measured, Observation(**profiled)]
    told = [measured, Observation(**profiled, profile_p_fit=0.2)]
    before = guide.fit_probability(hopeful, *_mean_sd(guide, hopeful))
    after = guide.fit_probability(told, *_mean_sd(guide, told))
    assert before[2] > 0.9 and after[2] == pytest.approx(0.2)
    assert after[3] <= 0.2  # less headroom than the profiled config
    assert after[1] == pytest.approx(before[1])  # more headroom: the model's own figure


def _mean_sd(guide, obs):
    belief = guide._memory_belief(obs)
    return belief.mean, belief.sd


@pytest.mark.slow  # ~70 s; tests/test_memory_profile.py checks profiles against full probes on this CPU in CI
# ------------------------------------------------------------------ the acceptance, on real probes
# fp32: this machine's CPUs have no bf16 instructions (no AVX512-BF16/AMX), so torch emulates bf16
# matmuls and the same study in bf16 took 636 s (a pp=2 full probe alone 192 s); in fp32, 61 s. The
# timeout is a hang guard, not a speed limit
@pytest.mark.timeout(900)
def test_a_cpu_study_profiles_memory_first_and_each_full_probe_lands_in_its_predicted_band(write_spec, tmp_path):
    spec = write_spec(
        f"""
name: tiny-profile
model: {TINY16}
workload: {{kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 2, overrides: {{device_memory_gib: 1.7}}}}
backend: torch
space:
  tp: [1, 2]
  pp: [1, 2]
  micro_batch_size: [1, 4]
  recompute: [none, full]
  precision: [fp32]
objectives: [tokens_per_s_per_device]
search: {{n_trials: 3, seed: 1}}
ray: {{enabled: false}}
""",
        "profile.yaml",
    )
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json", "--no-tracking"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    trials = [t for t in report["trials"] if t["probed"]]
    profiled = [t for t in trials if t.get("memory_profile")]
    assert profiled, [t["chosen_because"] for t in trials]  # memory probes were used
    for t in profiled:
        mp = t["memory_profile"]
        assert max(mp["layers_per_stage"]) < mp["full_layers_per_stage"]  # fewer layers than the model
        assert "memory profile" in t["chosen_because"]
    probed_after = [t for t in profiled if t["memory_profile"]["verdict"] == "probe" and t["status"] == "ok"]
    assert probed_after
    for t in probed_after:
        low, high = t["memory_profile"]["band_gib"]
        assert low <= t["metrics"]["peak_memory_gib"] <= high, (t["number"], t["memory_profile"], t["metrics"])
    # the budget is full-probe equivalents: the profiles are counted at their share (not a whole
    # probe, not nothing), and a trial starts only while the budget is not spent (the last may
    # overshoot by its own cost, at most a full probe and its profile)
    spent = payload["probes"]
    full = sum(1 for t in trials if (t.get("memory_profile") or {}).get("verdict", "probe") in ("probe", "failed"))
    assert full < spent < full + len(profiled)
    assert spent < 3 + 2


def test_the_torch_probe_reports_what_its_allocator_could_use_on_a_device():
    """On a device: the peaks from the allocator, and usable = its reserve + the device's free
    memory (mem_get_info); on the CPU both peaks are the RSS and usable is unknown."""
    import math

    from autotune.workers.torch_probe import measure
    from autotune.workers.torch_probe.train import _Trainer

    gib = measure.GIB

    class FakeDevice:
        @staticmethod
        def max_memory_allocated(device=None):
            return 20 * gib

        @staticmethod
        def max_memory_reserved(device=None):
            return 22 * gib

        @staticmethod
        def memory_reserved(device=None):
            return 21 * gib

        @staticmethod
        def mem_get_info(device=None):
            return (9 * gib, 64 * gib)  # free, total: the runtime and communicators hold the rest

    rt = SimpleNamespace(device_kind="npu", devmod=FakeDevice, device="npu:0")
    assert _Trainer.memory_now(SimpleNamespace(rt=rt)) == (20.0, 22.0, 30.0)
    cpu = _Trainer.memory_now(SimpleNamespace(rt=SimpleNamespace(device_kind="cpu", devmod=None, device="cpu")))
    assert cpu[0] == cpu[1] > 0 and math.isnan(cpu[2])


class _Trial:
    """An optuna trial as the profile stage uses it: a number and user attributes."""

    def __init__(self, number: int):
        self.number, self.user_attrs = number, {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def _profiler_spec(go: float):
    """The spec fields ``MemoryProfiler`` reads: a torch probe on an NPU."""
    return SimpleNamespace(
        search=SimpleNamespace(fit_confidence=0.95, profile_go_probability=go, memory_profiles=True),
        cluster=SimpleNamespace(accelerator="npu"),
        backend=SimpleNamespace(kind="torch"),
    )


def test_the_guides_last_gamble_and_a_re_measurement_run_in_full_without_a_profile():
    """A config the guide is unsure of is profiled first; its re-measurement and the guide's last
    gamble on a config a profile turned away (``A.GAMBLE_ON``) go straight to the full probe: the
    profile already read what a profile can."""
    profiler = MemoryProfiler(_profiler_spec(0.4), _GuidedAt30())
    request = TrialRequest(params={"pp": 1}, model={"num_hidden_layers": 32}, workload={}, cluster={})
    for extra, planned in (({}, True), ({A.REMEASURE_OF: 3}, False), ({A.GAMBLE_ON: 3}, False)):
        trial = _Trial(9)
        trial.user_attrs.update({A.PREDICTED: {"guided_p_fit": 0.3}, **extra})
        assert (profiler.plan(trial, {"pp": 1}, request, "why") is not None) == planned, extra


def test_a_profile_that_measured_both_sides_decides_without_the_model():
    """Reserved peaks and the usable memory from the profile's own runs: the verdict is theirs."""
    from autotune.guide.sampler import _profile_steps
    from autotune.study.profiling import MemoryProfiler, ProfileRun
    from autotune.workers.protocol import ProbeResult, TrialRequest

    class Guided:  # the model's verdict, which a direct measurement overrides
        guide = SimpleNamespace(settings=GuideSettings())

        def fit_after_profile(self, *args):
            return 0.5, 30.0, 32.0

        def oom_allowance_spent(self, study):
            return False

    profiler = MemoryProfiler(_profiler_spec(0.8), Guided())
    request = TrialRequest(params={"pp": 1}, model={"num_hidden_layers": 32}, workload={}, cluster={})
    study = SimpleNamespace(get_trials=lambda deepcopy=False: [])

    def run_with(reserved_per_layer):
        run = ProfileRun(_Trial(5), {"pp": 1}, request, "rank 1", (1, 4))
        for k in (1, 4):
            result = ProbeResult(
                "ok",
                metrics={
                    "peak_memory_gib": 10 + k,
                    "peak_reserved_gib": 8 + reserved_per_layer * k,
                    "step_time_s": 0.5 + 0.25 * k,
                },
                info={"usable_memory_gib": 40.0},
                wall_s=5.0,
            )
            action, final = profiler.take(study, run, result)
        return action, final, run.trial.user_attrs[A.MEMORY_PROFILE]

    action, _, record = run_with(0.9)  # reserved 8 + 0.9 x 32 = 36.8 of 40 usable: it fits
    assert action == "probe" and record["p_fit"] > 0.99 and record["verdict"] == "probe"
    # each profile's step time is kept: a reading of the layout's speed on the cut model for the guide
    assert record["step_times_s"] == {"1": 0.75, "4": 1.5}
    assert _profile_steps(record) == ((1, 0.75), (4, 1.5))
    assert _profile_steps({"step_times_s": {"x": 1.0, "2": float("nan"), "0": 1.0, "3": -1.0}}) == ()
    action, final, record = run_with(1.1)  # 8 + 1.1 x 32 = 43.2: it does not
    assert action == "stop" and final.status == "oom_predicted" and record["p_fit"] < 0.01
    assert "reserved peak 43.2" in final.reason and "40 GiB it could use" in final.reason


def test_a_profile_that_gives_no_line_falls_back_to_the_full_probe():
    """Runs that report peaks of different stages (no stage measured twice), or a run that
    crashed: no verdict, the full probe runs as it would have without profiles, and says why."""
    from autotune.study.profiling import MemoryProfiler, ProfileRun
    from autotune.workers.protocol import ProbeResult, TrialRequest

    guided = SimpleNamespace(guide=SimpleNamespace(settings=GuideSettings()))
    profiler = MemoryProfiler(_profiler_spec(0.5), guided)
    request = TrialRequest(params={"pp": 2}, model={"num_hidden_layers": 32}, workload={}, cluster={})
    study = SimpleNamespace(get_trials=lambda deepcopy=False: [])
    run = ProfileRun(_Trial(7), {"pp": 2}, request, "rank 1", (1, 4))
    first = ProbeResult("ok", metrics={"peak_memory_gib": 5.0}, info={"peak_memory_gib_by_stage": {0: 5.0}})
    second = ProbeResult("ok", metrics={"peak_memory_gib": 6.0}, info={"peak_memory_gib_by_stage": {1: 6.0}})
    assert profiler.take(study, run, first) == ("again", None)
    assert profiler.take(study, run, second) == ("probe", None)
    assert run.trial.user_attrs[A.MEMORY_PROFILE]["verdict"] == "failed"
    assert "probed in full" in run.trial.user_attrs[A.CHOSEN]
    crashed = ProfileRun(_Trial(8), {"pp": 2}, request, "rank 1", (1, 4))
    assert profiler.take(study, crashed, ProbeResult("crash", reason="Segmentation fault")) == ("probe", None)
    assert "Segmentation fault" in crashed.trial.user_attrs[A.MEMORY_PROFILE]["failure"]


class _GuidedAt30:
    """The guide as ``MemoryProfiler`` sees it: P(fits) against a usable memory of 30 GiB, known
    exactly; the study's OOM allowance not spent."""

    guide = SimpleNamespace(settings=GuideSettings())

    def fit_after_profile(self, study, number, peak, sd, counts, usable=None):
        return NormalDist().cdf((30.0 - peak) / sd), peak, 30.0

    def oom_allowance_spent(self, study):
        return False


def _profile_until_decided(profiler, layers, peak_at, stage_layers=32):
    """A pp-1 trial's profile runs, each reading ``peak_at(layers)`` GiB, until the profiler decides:
    (the actions it answered, the trial's own result where it ended the trial, the run)."""
    request = TrialRequest(params={"pp": 1}, model={"num_hidden_layers": stage_layers}, workload={}, cluster={})
    run = ProfileRun(_Trial(9), {"pp": 1}, request, "rank 1", layers)
    study = SimpleNamespace(get_trials=lambda deepcopy=False: [])
    actions = []
    while True:
        action, final = profiler.take(
            study, run, ProbeResult("ok", metrics={"peak_memory_gib": peak_at(run.layers[run.done])})
        )
        actions.append(action)
        if action != "again":
            return actions, final, run


def test_an_undecided_profile_reads_its_line_again_from_half_the_stage_and_decides():
    """Two near profiles (1 and 4 layers) read a 32-layer stage's peak to about 3 %: a config 0.8 GiB
    under a 30 GiB limit is undecided at P(fits) 0.8. A third profile at 16 layers reads the line up
    to half the stage, and the verdict follows it (here: it fits, surely). A config clearly over the
    limit, or one whose stages are too short for a far profile, is decided without one."""
    profiler = MemoryProfiler(_profiler_spec(0.9), _GuidedAt30())

    def profile(layers, per_layer, static=10.0, stage_layers=32):
        return _profile_until_decided(profiler, layers, lambda k: static + per_layer * k, stage_layers)

    # 10 + 0.6 x 32 = 29.2 GiB: under the limit by 0.8
    actions, final, run = profile((1, 4), 0.6)
    record = run.trial.user_attrs[A.MEMORY_PROFILE]
    assert actions == ["again", "again", "probe"] and final is None
    assert record["layers_per_stage"] == [1, 4, 16]
    assert 0.5 < record["undecided_p_fit"] < 0.9 < record["p_fit"]
    assert record["peak_gib"] == pytest.approx(29.2, abs=0.01) and record["sd_gib"] < 0.5
    assert "from the first 2 profiles" in run.trial.user_attrs[A.CHOSEN]
    # 10 + 0.7 x 32 = 32.4 GiB: over by 2.4, decided by the first two
    actions, final, run = profile((1, 4), 0.7)
    assert actions == ["again", "stop"] and final.status == "oom_predicted"
    assert run.trial.user_attrs[A.MEMORY_PROFILE]["layers_per_stage"] == [1, 4]
    # an 8-layer stage: half of it (4) is no farther than the second profile; undecided, it stops there
    actions, final, run = profile((1, 4), 2.3, static=10.6, stage_layers=8)
    assert len(actions) == 2 and run.trial.user_attrs[A.MEMORY_PROFILE]["layers_per_stage"] == [1, 4]


def test_a_profile_above_the_go_threshold_but_not_sure_reads_its_line_again_before_the_full_probe():
    """At the default go threshold (0.4) a config two near profiles put at P(fits) 0.8 used to run in
    full; where each launch reads its own noise such configs fitted 70-80 % of the time, and half the
    OOM full probes of 7B 8x32 and 70B came from them (benchmarks/README.md, 2026-12-05). Below
    ``search.fit_confidence`` a long stage now gets its third profile first. Both configs here read
    29.2 GiB of 30 from their first two profiles (P(fits) 0.79): the one whose stage is straight is
    read again from 16 layers (29.2 GiB, P 0.99) and goes in full; the one whose stage bends upward
    past 4 layers (31.7 GiB at 32) reads 31.5 from three and stops as oom_predicted without its full
    probe."""
    profiler = MemoryProfiler(_profiler_spec(0.4), _GuidedAt30())

    actions, final, run = _profile_until_decided(profiler, (1, 4), lambda k: 10.0 + 0.6 * k)
    record = run.trial.user_attrs[A.MEMORY_PROFILE]
    assert actions == ["again", "again", "probe"] and record["layers_per_stage"] == [1, 4, 16]
    assert 0.4 < record["undecided_p_fit"] < 0.95 < record["p_fit"]
    assert "from the first 2 profiles): probed in full" in run.trial.user_attrs[A.CHOSEN]
    bends = lambda k: 10.0 + 0.6 * k + (0.09 * (k - 4) if k > 4 else 0.0)  # noqa: E731
    actions, final, run = _profile_until_decided(profiler, (1, 4), bends)
    record = run.trial.user_attrs[A.MEMORY_PROFILE]
    assert actions == ["again", "again", "stop"] and final.status == "oom_predicted"
    assert 0.4 < record["undecided_p_fit"] < 0.95 and record["p_fit"] < 0.4


def test_a_profiled_study_keeps_its_go_threshold_after_one_oom_and_needs_sure_fits_after_two():
    """With 20 full probes, 5 % of OOMs rounds to one; after a profile said go, that one OOM is a near
    miss at the wall, and with only it allowed it closed every config near the wall (13B world 154 of
    the search benchmark: the optimum's profile at P(fits) 0.65 was not run). A profiled study may have
    two (``PROFILED_OOM_ALLOWANCE``): after one OOM, a profile at P(fits) 0.65 still runs in full
    (``search.profile_go_probability`` 0.4); after two, it needs ``search.fit_confidence``."""
    from statistics import NormalDist

    from autotune.guide.guided import PROFILED_OOM_ALLOWANCE, Guide
    from autotune.study.profiling import MemoryProfiler, ProfileRun
    from autotune.workers.protocol import ProbeResult, TrialRequest

    class Guided:  # P(fits) against a usable memory of 30 GiB; the study's OOMs so far in ``ooms``
        guide = SimpleNamespace(settings=GuideSettings(max_oom_share=0.05))
        ooms = 0

        def fit_after_profile(self, study, number, peak, sd, counts, usable=None):
            return NormalDist().cdf((30.0 - peak) / sd), peak, 30.0

        def oom_allowance_spent(self, study):  # 20 probes: the share's count is one
            return Guide.oom_allowance_spent(self.guide, self.ooms, 10, 10)

    guided = Guided()
    profiler = MemoryProfiler(_profiler_spec(0.4), guided)
    study = SimpleNamespace(get_trials=lambda deepcopy=False: [])

    def verdict():
        request = TrialRequest(params={"pp": 1}, model={"num_hidden_layers": 8}, workload={}, cluster={})
        run = ProfileRun(_Trial(9), {"pp": 1}, request, "rank 1", (1, 4))
        while True:  # 10 + 2.47 x 8 = 29.76 GiB, 0.24 under the limit: P(fits) about 0.65
            k = run.layers[run.done]
            result = ProbeResult("ok", metrics={"peak_memory_gib": 10.0 + 2.47 * k})
            action, final = profiler.take(study, run, result)
            if action != "again":
                return action, final, run

    blind = SimpleNamespace(settings=GuideSettings(max_oom_share=0.05, memory_profiles=False))
    profiled = SimpleNamespace(settings=GuideSettings(max_oom_share=0.05, memory_profiles=True))
    assert PROFILED_OOM_ALLOWANCE == 2 and Guide.oom_allowance_spent(blind, 1, 10, 10)
    assert not Guide.oom_allowance_spent(profiled, 1, 10, 10) and Guide.oom_allowance_spent(profiled, 2, 10, 10)
    assert guided.guide.settings.memory_profiles  # the profiler told the guide its full probes follow profiles
    guided.ooms = 1
    action, _, run = verdict()
    assert action == "probe" and 0.4 <= run.trial.user_attrs[A.MEMORY_PROFILE]["p_fit"] < 0.95
    guided.ooms = 2
    action, final, run = verdict()
    assert action == "stop" and final.status == "oom_predicted"
    assert "below search.fit_confidence (OOM allowance spent) 0.95" in final.reason
