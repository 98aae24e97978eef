"""Memory on the production path (issue 41): the usable memory measured before the first probe, an
out-of-memory message without numbers still bounding it, no second walk into the same wall, and a
P(fits) that corrects itself where it over-promised."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from autotune.guide.guided import Guide, GuideSettings, Observation


def _guide(configs, peaks, limit=64.0, **settings):
    n = len(configs)
    peaks = np.asarray(peaks, dtype=float)
    predictions = {
        "tokens_per_s_per_device": np.linspace(100, 200, n),
        "step_time_s": np.linspace(2, 1, n),
        "peak_memory_gib": peaks,
        "mem_activations": peaks - 4.0,
        "mem_runtime_reserve": np.full(n, 3.0),
        "mem_comm_buffers": np.full(n, 1.0),
        "memory_limit_gib": np.full(n, limit),
        "valid": np.ones(n, bool),
    }
    ranking = SimpleNamespace(
        predictions=predictions,
        enumeration=SimpleNamespace(configs=configs, params=sorted({k for c in configs for k in c})),
        objectives=[("tokens_per_s_per_device", "maximize")],
    )
    return Guide(ranking, ("tokens_per_s_per_device", "maximize"), GuideSettings(**settings))


LAYOUT = {"tp": 1, "pp": 4, "micro_batch_size": 1, "recompute": "selective", "zero_stage": 1}
CONFIGS = [
    {**LAYOUT, "precision": "bf16", "env.HCCL_BUFFSIZE": 200},  # 0: runs out of memory
    {**LAYOUT, "precision": "fp16", "env.HCCL_BUFFSIZE": 200},  # 1: the same bytes
    {**LAYOUT, "precision": "bf16", "env.HCCL_BUFFSIZE": 400},  # 2: a larger buffer: no saving
    {**LAYOUT, "precision": "bf16", "env.HCCL_BUFFSIZE": 120},  # 3: a smaller buffer may save
    {**LAYOUT, "recompute": "full", "precision": "bf16", "env.HCCL_BUFFSIZE": 200},  # 4: saves activations
    {**LAYOUT, "micro_batch_size": 2, "precision": "bf16", "env.HCCL_BUFFSIZE": 200},  # 5
]
PEAKS = [62.0, 62.0, 62.3, 61.8, 50.0, 70.0]


def test_no_second_walk_into_the_same_wall():
    """A layout that ran out of memory is not probed again with only a half precision, a larger
    HCCL buffer or a graph flag changed: those configs' P(fits) is 0, whatever the model says."""
    guide = _guide(CONFIGS, PEAKS)
    oom = [Observation(index=0, status="oom", number=0)]
    p = guide.fit_probability(oom, *_mean_sd(guide, oom))
    assert p[1] == 0.0 and p[2] == 0.0
    assert p[3] > 0.0 and p[4] > 0.5  # a smaller buffer, full recompute: may save memory
    proposal, _ = guide.propose(oom, best=None, budget_left=10)
    assert proposal is not None and proposal.index not in (1, 2)


def test_an_oom_without_numbers_bounds_the_usable_memory_by_the_known_peak():
    """The message gave no byte counts, but the config's memory profile read its peak (62 GiB):
    what is usable lies between the highest peak that fitted (55) and that, not at the nominal 64."""
    guide = _guide(CONFIGS, PEAKS)
    fitted = Observation(index=4, status="ok", objective=120.0, peak_memory_gib=55.0, number=1)
    before, _ = guide.usable_limit([fitted])
    assert before[0] == pytest.approx(64.0)
    failed = Observation(index=0, status="oom", number=0, profile_peak_gib=62.0, profile_sd_gib=0.4)
    usable, sd = guide.usable_limit([fitted, failed])
    assert 55.0 <= usable[0] < 62.4 and np.all(np.asarray(sd) > 0)
    # without a profile and with nothing that pins the model down, the OOM teaches no bound
    assert guide.usable_limit([Observation(index=0, status="oom", number=0)])[0][0] == pytest.approx(64.0)


def test_a_plain_oom_after_the_device_check_keeps_the_usable_memory_near_its_bound():
    """The device check read 59 GiB usable; a config whose profile read 58 GiB (+0.5 sd) then ran out
    of memory with no numbers. The usable memory lies below 58.5 GiB, and the check says close to
    it: not the middle of [45, 58.5] (51.8 GiB), which would call configs of 55-57 GiB unfit, as a
    13B benchmark world's optimum was."""
    guide = _guide(CONFIGS, PEAKS, device_usable_gib=56.0)  # 59 GiB with the runtime reserve
    fitted = Observation(index=4, status="ok", objective=120.0, peak_memory_gib=45.0, number=1)
    failed = Observation(index=0, status="oom", number=0, profile_peak_gib=58.0, profile_sd_gib=0.5)
    usable, sd = guide.usable_limit([fitted, failed])
    assert 56.5 < usable[4] < 58.5 and float(np.max(sd)) < 2.0
    # without a check the prior is the nominal capacity, looser: still nearer the bound than the middle
    loose, loose_sd = _guide(CONFIGS, PEAKS).usable_limit([fitted, failed])
    assert 51.75 < loose[4] < 58.5 and float(np.max(loose_sd)) > float(np.max(sd))
    # an OOM with byte counts is read as before: between in use and in use + requested
    counted = Observation(index=0, status="oom", number=0, oom_needed_gib=57.0, oom_in_use_gib=56.0)
    assert guide.usable_limit([fitted, counted])[0][4] == pytest.approx(56.5)


def test_the_fit_model_is_corrected_where_a_level_over_promised():
    guide = _guide(CONFIGS, PEAKS)
    honest = [Observation(index=i, status="ok", number=i, stated_p_fit=0.95) for i in range(4)]
    assert guide.fit_correction(honest) == 1.0
    broken = [Observation(index=i, status="oom" if i % 2 else "ok", number=i, stated_p_fit=0.9) for i in range(6)]
    gamma = guide.fit_correction(broken)
    assert gamma > 1.0 and sum(0.9**gamma for _ in range(6)) == pytest.approx(3, abs=0.1)


def test_the_device_checks_usable_memory_lowers_the_capacity_the_guide_starts_from():
    guide = _guide(CONFIGS, PEAKS, device_usable_gib=56.0)  # plus the model's 3 GiB runtime reserve
    assert guide.device_limit()[0] == pytest.approx(59.0)
    p = guide.fit_probability([], *_mean_sd(guide, []))
    assert p[0] < 0.5 < p[4]
    assert _guide(CONFIGS, PEAKS, device_usable_gib=63.9).device_limit()[0] == pytest.approx(64.0)  # not clearly less


def test_the_device_checks_total_bounds_a_device_peak_whatever_the_profiles_runtime_reserve(monkeypatch):
    """mem_get_info says the device's total beside what is free: the profile's memory becomes that
    total, and its runtime reserve what the runtime held when the check ran (total less usable). The guide's bound is then the device's total, not the usable
    memory plus a reserve the profile guessed (4.0 GiB on the 910B; a runtime that held 5.6 left every
    config near the wall 1.6 GiB short of what it had). The CPU's total is the host's: no runtime."""
    from autotune.guide.ranking import rank_space
    from autotune.spec.load import load_spec
    from autotune.spec.resolve import objectives_of, probe_context
    from autotune.spec.space import Space
    from autotune.study.usable_memory import check_overrides

    from support import REPO

    spec = load_spec(REPO / "search_spaces" / "llama2_7b_8npu.yaml")
    nominal = float(probe_context(spec).cluster["hardware"]["device_memory_gib"])
    held_more = check_overrides(spec, {"usable_memory_gib": 55.0, "total_memory_gib": 60.6})
    assert held_more == {"usable_memory_gib": 55.0, "device_memory_gib": 60.6, "runtime_reserve_gib": 5.6}
    # a runtime that held less than the profile's reserve: the measurement, not the profile's guess
    assert check_overrides(spec, {"usable_memory_gib": 58.0, "total_memory_gib": 60.6}) == {
        "usable_memory_gib": 58.0,
        "device_memory_gib": 60.6,
        "runtime_reserve_gib": 2.6,
    }
    # no total, or the nominal's: the usable memory alone
    assert check_overrides(spec, {"usable_memory_gib": 55.0}) == {"usable_memory_gib": 55.0}
    assert check_overrides(spec, {"usable_memory_gib": 55.0, "total_memory_gib": nominal + 1})[
        "runtime_reserve_gib"
    ] == pytest.approx(nominal + 1 - 55.0)
    cpu = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"accelerator": "cpu"})})
    assert check_overrides(cpu, {"usable_memory_gib": 5.0, "total_memory_gib": 24.0}) == {"usable_memory_gib": 5.0}

    def limit(overrides):
        checked = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"overrides": overrides})})
        enum = Space(checked).enumerate()
        ranking = rank_space(enum, probe_context(checked), objectives_of(checked))
        guide = Guide(ranking, ("tokens_per_s_per_device", "maximize"), GuideSettings(device_usable_gib=55.0))
        return guide.device_limit()

    # the study records what the runtime held beside the check's answer, and says the total
    from autotune.study import usable_memory

    how = "npu mem_get_info after the runtime started (free + the allocator's reserve)"
    answer = {"usable_memory_gib": 55.0, "total_memory_gib": 60.6, "how": how}
    monkeypatch.setattr(usable_memory, "measure_usable_memory", lambda spec: dict(answer))
    lines = []
    checked, found = usable_memory.with_usable_memory(spec, False, lines.append)
    assert found["runtime_held_gib"] == pytest.approx(5.6)
    assert checked.cluster.overrides["runtime_reserve_gib"] == pytest.approx(5.6)
    assert "usable memory: 55.00 GiB per device of 60.60 GiB the runtime reports" in lines[0]

    # the report says what the check read: on a device the total and what the runtime held; on the CPU not
    from autotune.finish.report import summary_lines

    def said(found):
        base = {"objectives": [{"metric": "tokens_per_s_per_device", "direction": "maximize"}], "usable_memory": found}
        return " ".join(line.strip() for line in summary_lines(base))

    assert "55.00 GiB of 60.60 GiB (the runtime held 5.60)" in said(found)
    host = said({"usable_memory_gib": 5.0, "total_memory_gib": 24.0, "how": "the host's available memory"})
    assert "5.00 GiB (the host's available memory)" in host and "24.00" not in host

    # the guide's bound is the device's total for every config ...
    assert np.allclose(limit({**spec.cluster.overrides, **held_more}), 60.6)
    # ... where the usable memory alone left it at usable + the profile's 4.0 GiB
    assert np.allclose(limit({**spec.cluster.overrides, "usable_memory_gib": 55.0}), 59.0)


def test_the_device_check_on_the_cpu_reads_the_probes_soft_limit(monkeypatch):
    from autotune.workers.device_check import measure

    monkeypatch.setenv("AUTOTUNE_MEMORY_LIMIT_GIB", "1.5")
    out = measure("cpu")
    assert out["usable_memory_gib"] == pytest.approx(1.5) and "AUTOTUNE_MEMORY_LIMIT_GIB" in out["how"]


def test_a_real_study_measures_and_reports_its_usable_memory(write_spec, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from autotune.spec.load import load_spec
    from autotune.study.usable_memory import with_usable_memory

    monkeypatch.setenv("AUTOTUNE_MEMORY_LIMIT_GIB", "2.5")
    spec = load_spec(
        write_spec(
            """
name: usable
model: tiny-llama
workload: {kind: train, seq_len: 64, global_batch_size: 4}
cluster: {accelerator: cpu, nodes: 1, devices_per_node: 1}
backend: torch
space: {micro_batch_size: [1, 2]}
ray: {enabled: false}
""",
            "usable.yaml",
        )
    )
    said = []
    measured, found = with_usable_memory(spec, False, said.append)
    assert found["usable_memory_gib"] == pytest.approx(2.5)
    assert measured.cluster.overrides["usable_memory_gib"] == pytest.approx(2.5)
    assert "usable memory: 2.50 GiB" in said[0]
    assert with_usable_memory(spec, True, said.append) == (spec, {})  # the simulator: no device
    # through a study: the report says it
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["run", str(spec.source_path), "--run-dir", str(run_dir), "--no-tracking", "--n-trials", "1"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["usable_memory"]["usable_memory_gib"] == pytest.approx(2.5)
    assert "usable memory per device, measured before the first probe: 2.50 GiB" in (run_dir / "summary.md").read_text()


def _mean_sd(guide, obs):
    belief = guide._memory_belief(obs)
    return belief.mean, belief.sd


def test_the_cpu_probes_soft_limit_message_teaches_the_usable_memory():
    """The torch probe's out-of-memory line on the CPU gives its peak and the limit: the guide's usable
    memory falls from the nominal capacity to below that peak at once."""
    from autotune.workers.protocol import classify_failure, oom_evidence

    line = (
        "out of memory: peak RSS 3.214 GiB exceeds the soft limit AUTOTUNE_MEMORY_LIMIT_GIB=3 GiB (requested 3.214 GiB)"
    )
    assert classify_failure(1, line)[0] == "oom"
    evidence = oom_evidence(line)
    assert evidence == {"capacity": 3.0, "needed_at_least": 3.214}
    guide = _guide(CONFIGS, [3.4, 3.4, 3.5, 3.3, 2.0, 4.0], limit=23.0)
    fitted = Observation(index=4, status="ok", objective=120.0, peak_memory_gib=2.1, number=1)
    failed = Observation(index=0, status="oom", number=0, oom_needed_gib=evidence["needed_at_least"])
    usable, _ = guide.usable_limit([fitted, failed])
    assert 2.1 <= usable[0] < 3.214


TINY16 = (
    "{name: tiny-llama-16, hidden_size: 512, num_hidden_layers: 16, num_attention_heads: 8, "
    "num_key_value_heads: 4, intermediate_size: 1376, vocab_size: 2048, max_position_embeddings: 1024}"
)


@pytest.mark.slow
# bf16 and fp16 on purpose (a half precision cannot save memory): this machine's CPUs emulate both, a
# probe takes 100-210 s on 2 cores, five trials about 14 minutes; the timeout is a hang guard
@pytest.mark.timeout(1800)
def test_a_real_cpu_study_under_a_memory_limit_never_walks_into_the_same_wall_twice(write_spec, tmp_path, monkeypatch):
    """Real torch probes on this CPU under a soft memory limit below the host's: the study knows the
    limit (the device check reads it; an OOM's message teaches it too), and no layout runs out of
    memory twice with only its precision changed."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from autotune.guide.memory_belief import _wall_of

    monkeypatch.setenv("AUTOTUNE_MEMORY_LIMIT_GIB", "1.3")
    spec = write_spec(
        f"""
name: tiny-wall
model: {TINY16}
workload: {{kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 2}}
backend: torch
space:
  tp: [1, 2]
  micro_batch_size: [1, 2, 4]
  recompute: [none, full]
  precision: [bf16, fp16]
objectives: [tokens_per_s_per_device]
search: {{n_trials: 5, seed: 1}}
ray: {{enabled: false}}
""",
        "wall.yaml",
    )
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json", "--no-tracking"])
    assert result.exit_code in (0, 4), result.output
    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    assert report["summary"]["usable_memory"]["usable_memory_gib"] == pytest.approx(1.3)
    ooms = [t["params"] for t in report["trials"] if t["status"] == "oom"]
    walls = [_wall_of(params) for params in ooms]
    assert len(walls) == len(set(walls)), ooms


EDGE = [
    {"tp": 1, "micro_batch_size": m, "recompute": r} for m, r in ((1, "full"), (2, "full"), (1, "none"), (2, "none"))
]
EDGE += [{"tp": 2, "micro_batch_size": 1, "recompute": "full"}, {"tp": 2, "micro_batch_size": 2, "recompute": "none"}]
EDGE += [{"tp": 4, "micro_batch_size": 2, "recompute": "none"}]
EDGE_PEAKS = [30.0, 32.0, 34.0, 36.0, 38.0, 64.5, 90.0]  # 5 at the memory's edge; 6 far over it


def test_a_study_with_budget_left_risks_a_config_that_may_fit_and_could_win_before_it_stops():
    """Every config at least ``min_fit_probability`` likely to fit is measured, and the one left could
    win but is less likely to fit than that floor (7B 32 GB world 17 of the search benchmark stopped
    after 11 of 20 probes at 0.937 of an optimum at 98.7 % of its memory). With budget left and no OOM
    risked yet, it is probed; once the OOM allowance is spent, or the budget is, it is not (the race
    measures the leader again before the study stops)."""
    guide = _guide(EDGE, EDGE_PEAKS, max_oom_share=0.05)
    value = guide.objective_raw
    obs = [
        Observation(index=i, status="ok", objective=float(value[i]), step_time_s=float(2 - i / 5), number=i)
        for i in range(5)
    ]
    best = float(value[4])
    p_edge = guide.fit_probability(obs, *_mean_sd(guide, obs))[5]
    assert 0.05 <= p_edge < 0.5, p_edge
    proposal, why = guide.propose(obs, best=best, budget_left=10)
    assert proposal is not None and proposal.index == 5, why
    assert "OOM allowance unspent" in proposal.reason
    # the allowance spent (one OOM of twenty): the study stops instead of risking another
    spent = [*obs, Observation(index=6, status="oom", number=5)]
    assert 0.05 <= guide.fit_probability(spent, *_mean_sd(guide, spent))[5] < 0.5
    proposal, why = guide.propose(spent, best=best, budget_left=10)
    # no risk: before it stops, the race measures its leader again (no config was read twice, so the
    # noise is assumed and nothing is certified)
    assert proposal is not None and proposal.remeasure and proposal.index == 4, why
    assert "the noise is assumed" in proposal.reason
    # the last probe of the budget is not spent on a risk
    proposal, why = guide.propose(obs, best=best, budget_left=1)
    assert proposal is None or proposal.remeasure, why


def _gamble_study(profile_p_fit):
    """Configs 0-4 measured (4 the leader, read twice; 3 read twice, to measure the noise), config 5
    (predicted best, at the memory's edge) turned away by its memory profile at ``profile_p_fit``,
    config 6 far over the memory: nothing left that may fit could win."""
    guide = _guide(EDGE, EDGE_PEAKS, max_oom_share=0.05, memory_profiles=True)
    value = guide.objective_raw
    obs = [
        Observation(index=i, status="ok", objective=float(value[i]), step_time_s=float(2 - i / 5), number=i)
        for i in range(5)
    ]
    obs += [
        Observation(index=4, status="ok", objective=float(value[4]) * 1.004, step_time_s=1.2, number=5),
        Observation(index=3, status="ok", objective=float(value[3]) * 0.996, step_time_s=1.4, number=6),
        Observation(
            index=5,
            status="oom_predicted",
            number=7,
            profile_peak_gib=64.3,
            profile_sd_gib=0.5,
            profile_p_fit=profile_p_fit,
        ),
    ]
    return guide, obs, float(np.mean([value[4], value[4] * 1.004]))


def test_with_budget_left_a_config_its_profile_turned_away_near_the_wall_is_run_in_full_once():
    """The study would stop with budget left (nothing left that may fit could win, the race
    settled), and the config the model puts above the best measured was turned away by its memory
    profile at P(fits) 0.3 (a profile's verdict near the wall is a coin: in the search benchmark's
    70B world 5 the optimum's profile said 0.30, its full probe fitted). Its full probe runs, once,
    without another profile (``gamble``); not where the profile said less than ``GAMBLE_FROM``, the
    OOM allowance is spent, one full probe is left, or it has run in full already."""
    from autotune.guide.guided import GAMBLE_FROM

    guide, obs, best = _gamble_study(0.3)
    proposal, why = guide.propose(obs, best=best, budget_left=5)
    assert proposal is not None and proposal.gamble and proposal.index == 5, why
    assert not proposal.remeasure
    assert "a last gamble" in proposal.reason and "trial 7's memory profile" in proposal.reason
    assert GAMBLE_FROM <= proposal.predicted["guided_p_fit"] <= 0.3
    # the allowance spent (two OOMs with profiles on): the study stops instead
    spent = [*obs, Observation(index=6, status="oom", number=8), Observation(index=6, status="oom", number=9)]
    proposal, why = guide.propose(spent, best=best, budget_left=5)
    assert proposal is None or not proposal.gamble, why
    # the last full probe of the budget is not spent on a gamble
    proposal, why = guide.propose(obs, best=best, budget_left=1)
    assert proposal is None or not proposal.gamble, why
    # a profile that said 0.1: no gamble
    low, low_obs, best = _gamble_study(0.1)
    proposal, why = low.propose(low_obs, best=best, budget_left=5)
    assert proposal is None or not proposal.gamble, why
    # run in full already (it fitted): not again, and its profile's "over" caps nothing now
    ran = [*obs, Observation(index=5, status="ok", objective=float(guide.objective_raw[5]), step_time_s=1.0, number=8)]
    proposal, why = guide.propose(ran, best=float(guide.objective_raw[5]), budget_left=5)
    assert proposal is None or not proposal.gamble, why
    assert guide.fit_probability(ran, *_mean_sd(guide, ran))[5] > guide.fit_probability(obs, *_mean_sd(guide, obs))[5]
