"""A re-measurement runs the warm-up and ``search.remeasure_steps`` timed steps, and costs the
budget what it ran (autotune/guide/short_remeasure.py)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from autotune.cli.assembly import study_runner
from autotune.dispatch.backends import BackendChoice, launch_for
from autotune.dispatch.dispatcher import InProcessDispatcher
from autotune.guide.guided import Guide, GuideSettings, Observation
from autotune.guide.memory_profile import cost_of_trials, full_probe_cost_fpe, median_full_wall
from autotune.guide.short_remeasure import (
    MEASURED_STEPS_ENV,
    remeasure_cost_estimate,
    remeasure_request,
    remeasure_steps_of,
    short_remeasure_steps,
    why_full_remeasure,
    why_full_remeasure_of,
    why_no_short_remeasure,
)
from autotune.guide.spec_settings import guide_settings
from autotune.spec.resolve import probe_context, request_settings
from autotune.workers.simulate import columns_from_params, simulate_configs
from autotune.spec.schema import Spec
from autotune.trial_attrs import A
from autotune.workers.protocol import ProbeResult
from support import GUIDED_SPEC, MessageObserver

TRAIN = {"kind": "train", "warmup_steps": 2, "measured_steps": 5}


def _spec(argv=("launch", "{trial_file}", "--steps", "{measured_steps}"), **search):
    search = {"remeasure_steps": 2, **search}
    # six configs within a few percent of each other: the study measures them all, then races
    space = {"tp": [1, 2, 4], "pp": [1], "micro_batch_size": [1, 2], "recompute": ["full"], "zero_stage": [1]}
    data = dict(
        GUIDED_SPEC,
        space=space,
        cluster={**GUIDED_SPEC["cluster"], "overrides": {"device_memory_gib": 64}},
        workload={**GUIDED_SPEC["workload"], "warmup_steps": 2, "measured_steps": 5},
        backend={"kind": "command", "argv": list(argv)},
        search={"n_trials": 8, "sampler": "auto", "prune": False, "seed": 3, **search},
    )
    return Spec.model_validate(data)


def test_which_backends_are_told_their_steps():
    assert why_no_short_remeasure("torch") is None and why_no_short_remeasure("mindspore") is None
    assert why_no_short_remeasure("command", ["run", "{trial_file}", "--iters={measured_steps}"]) is None
    assert "{measured_steps}" in why_no_short_remeasure("command", ["run", "{trial_file}"])
    assert why_no_short_remeasure("megatron") is not None and why_no_short_remeasure("simulate") is not None
    # training only, fewer steps than the workload's, and not turned off
    assert short_remeasure_steps(1, TRAIN, "torch", None) == 1
    assert short_remeasure_steps(None, TRAIN, "torch", None) is None
    assert short_remeasure_steps(5, TRAIN, "torch", None) is None  # would save no step
    assert short_remeasure_steps(1, {**TRAIN, "kind": "serve"}, "torch", None) is None
    assert short_remeasure_steps(1, TRAIN, "command", ["run"]) is None


def test_a_setting_that_changes_nothing_says_why():
    assert why_full_remeasure(None, TRAIN, "command", ["run"]) is None  # nothing asked, nothing to say
    assert why_full_remeasure(2, TRAIN, "torch", None) is None  # it runs
    assert "{measured_steps}" in why_full_remeasure(2, TRAIN, "command", ["run"])
    assert "rate" in why_full_remeasure(2, {**TRAIN, "kind": "serve"}, "torch", None)
    assert "runs its own step count" in why_full_remeasure(2, TRAIN, "megatron", None)
    why = why_full_remeasure(5, TRAIN, "torch", None)
    assert "measured_steps (5)" in why and "below 5" in why


def test_the_request_runs_fewer_timed_steps_and_leaves_the_trials_own_alone():
    request = request_settings(_spec(), remeasure_steps=2).request({"tp": 1, "pp": 1}, 3)
    short = remeasure_request(request, 2)
    assert short.workload["measured_steps"] == 2 and short.workload["warmup_steps"] == 2
    assert request.workload["measured_steps"] == 5
    with pytest.raises(ValueError, match="at least one timed step"):
        remeasure_request(request, 0)


def test_a_command_launcher_is_told_the_steps_in_its_argv_and_environment():
    spec = _spec()
    settings = request_settings(spec, remeasure_steps=remeasure_steps_of(spec, "command"))
    assert settings.remeasure_steps == 2
    launch = launch_for(spec, BackendChoice("command", "test"), remeasure_request(settings.request({"tp": 1}, 3), 2))
    assert launch.argv[-2:] == ["--steps", "2"] and launch.env[MEASURED_STEPS_ENV] == "2"
    full = launch_for(spec, BackendChoice("command", "test"), settings.request({"tp": 1}, 3))
    assert full.argv[-2:] == ["--steps", "5"] and full.env[MEASURED_STEPS_ENV] == "5"


def test_what_a_short_re_measurement_costs():
    # 2 warm-up and 1 timed step of 7, after a start-up: about half a full probe
    assert remeasure_cost_estimate(TRAIN, 1) == pytest.approx(0.1 + 0.9 * 3 / 7)
    assert remeasure_cost_estimate(TRAIN, None) == 1.0 == remeasure_cost_estimate(TRAIN, 5)
    # its wall over a full probe's, whatever the share (an ok full probe near that share costs 1)
    assert full_probe_cost_fpe("ok", 50.0, 100.0, short=True) == pytest.approx(0.5)
    assert full_probe_cost_fpe("ok", 130.0, 100.0, short=True) == 1.0  # a launcher that ran it in full
    assert full_probe_cost_fpe("ok", 50.0, 100.0) == 1.0
    # a short one is no full probe's wall: the median a profile is priced against leaves it out
    attrs = [{A.STATUS: "ok", A.WALL: 100.0}, {A.STATUS: "ok", A.WALL: 50.0, A.SHORT_STEPS: 1}]
    attrs += [{A.STATUS: "ok", A.WALL: 50.0, A.SHORT_STEPS: 1}]
    assert median_full_wall(attrs) == 100.0
    assert cost_of_trials(attrs) == pytest.approx(2.0)


def test_the_races_share_buys_readings_at_what_one_costs():
    spec = _spec(n_trials=25)

    def on_command(s):  # the settings the assembly makes for a command backend's study
        return guide_settings(s, remeasure_steps=remeasure_steps_of(s, "command"))

    short = on_command(spec)  # two timed steps
    full = on_command(_spec(n_trials=25, remeasure_steps=None))
    one = on_command(_spec(n_trials=25, remeasure_steps=1))
    assert full.confirm_readings == 6 and full.remeasure_cost == 1.0  # 0.25 of 25
    assert short.remeasure_cost == pytest.approx(0.1 + 0.9 * 4 / 7)
    assert short.confirm_readings == math.floor(6.25 / short.remeasure_cost) == 10
    assert one.confirm_readings == 12
    assert guide_settings(spec).confirm_readings == 6  # no steps named: full re-measurements
    # the budget held back at the end is the readings left at that cost, rounded up
    guide = Guide.__new__(Guide)
    guide.settings = GuideSettings(confirm_readings=10, remeasure_cost=short.remeasure_cost)
    assert guide._held_back([]) == math.ceil(10 * short.remeasure_cost) == 7
    obs = [Observation(index=0, number=0, status="ok", objective=1.0)]
    obs += [Observation(index=0, number=n, status="ok", objective=1.0) for n in (1, 2, 3)]
    assert guide._held_back(obs) == math.ceil(7 * short.remeasure_cost)  # three spent


def test_remeasure_steps_is_checked_and_two_by_default():
    with pytest.raises(ValidationError, match="remeasure_steps"):
        _spec(remeasure_steps=0)
    told = Spec.model_validate({**GUIDED_SPEC, "backend": {"kind": "command", "argv": ["x", "{measured_steps}"]}})
    assert told.search.remeasure_steps == 2 and remeasure_steps_of(told, "command") == 2
    off = Spec.model_validate({**GUIDED_SPEC, "search": {"remeasure_steps": None}})
    assert remeasure_steps_of(off, "torch") is None and why_full_remeasure_of(off, "torch") is None


def test_the_default_says_why_only_where_the_user_can_act():
    """At the default, a command backend's launcher not told its steps is said (add the placeholder);
    a stack preset or a serving study has nothing to change and is not. Set explicitly, every reason is said."""
    blind = Spec.model_validate({**GUIDED_SPEC, "backend": {"kind": "command", "argv": ["x", "{trial_file}"]}})
    assert "{measured_steps}" in why_full_remeasure_of(blind, "command")
    preset = Spec.model_validate(GUIDED_SPEC)
    assert why_full_remeasure_of(preset, "megatron") is None
    asked = Spec.model_validate({**GUIDED_SPEC, "search": {"remeasure_steps": 2}})
    assert "runs its own step count" in why_full_remeasure_of(asked, "megatron")


def _study(tmp_path, spec):
    """A guided study whose probe reads the simulator's figures with a few percent of noise, times
    each run by its steps (100 s a full probe of 2 + 5 steps, a start-up of 10 s), and records the
    timed steps each trial asked for."""
    ctx = probe_context(spec)
    asked: dict[int, int] = {}

    def probe(request):
        steps = int(request.workload["measured_steps"])
        asked[request.number] = steps
        p = simulate_configs(ctx.model, ctx.workload, ctx.hardware, ctx.cluster, columns_from_params([request.params]))
        if not p["valid"][0] or p["peak_memory_gib"][0] > p["memory_limit_gib"][0]:
            result = ProbeResult("oom", reason="NPU out of memory")
        else:
            noise = 1.0 + 0.04 * math.sin(3.0 * request.number)
            tps = float(p["tokens_per_s_per_device"][0]) / noise
            result = ProbeResult("ok", metrics={"tokens_per_s_per_device": tps, "step_time_s": 1000.0 / tps})
        result.wall_s = 10.0 + 90.0 * (2 + steps) / 7
        return result

    observer = MessageObserver()
    messages = observer.messages

    outcome = study_runner(
        spec,
        tmp_path / "run",
        BackendChoice("command", "test"),
        dispatcher=InProcessDispatcher(probe),
        observer=observer,
    ).run()
    return outcome, asked, messages


def test_a_study_re_measures_with_two_timed_steps_and_counts_what_it_ran(tmp_path):
    outcome, asked, messages = _study(tmp_path, _spec())
    assert not any("re-measurements run the full probe" in m for m in messages)
    probed = [t for t in outcome.study.trials if t.user_attrs.get(A.PROBED)]
    again = [t for t in probed if A.REMEASURE_OF in t.user_attrs]
    assert again, "the race re-measured nothing: the test's noise is too small to race"
    for t in probed:
        short = A.REMEASURE_OF in t.user_attrs
        assert asked[t.number] == (2 if short else 5)
        assert t.user_attrs.get(A.SHORT_STEPS) == (2 if short else None)
        assert ("2 timed steps after the warm-up" in t.user_attrs[A.CHOSEN]) == short
    full = len(probed) - len(again)
    assert outcome.probes_run == pytest.approx(
        full + len(again) * (10 + 90 * 4 / 7) / 100, rel=1e-4
    )  # walls kept to ms
    assert outcome.probes_run < len(probed)  # each re-measurement about 0.6 of a full probe


def test_a_launcher_not_told_its_steps_re_measures_in_full(tmp_path):
    outcome, asked, messages = _study(tmp_path, _spec(argv=("launch", "{trial_file}")))
    said = [m for m in messages if m.startswith("re-measurements run the full probe")]
    assert len(said) == 1 and "{measured_steps}" in said[0]  # said once, with the fix
    probed = [t for t in outcome.study.trials if t.user_attrs.get(A.PROBED)]
    assert any(A.REMEASURE_OF in t.user_attrs for t in probed)
    assert all(asked[t.number] == 5 and A.SHORT_STEPS not in t.user_attrs for t in probed)
