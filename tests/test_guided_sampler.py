"""The guide as an Optuna sampler (autotune/guide/sampler.py): Optuna's own sampler contract
suites, and the guide's behaviour in a plain Optuna study (no autotune runner): proposals,
OOM evidence from the error text, fixed parameters, stopping, resuming."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.testing.pytest_samplers import BasicSamplerTestCase, RelativeSamplerTestCase, SingleOnlySamplerTestCase

from autotune.spec.resolve import objectives_of, probe_context
from autotune.guide.guided import GuideSettings
from autotune.guide.sampler import OUTCOME_ATTR, GuidedSampler, report_failure
from autotune.guide.ranking import rank_space
from autotune.spec.space import Space, config_key
from autotune.spec.schema import Spec
from autotune.workers.simulate import TRAIN_MEM_COMPONENTS, TRAIN_TIME_COMPONENTS, columns_from_params, simulate_configs
from support import GUIDED_SPEC

ROOT = Path(__file__).resolve().parents[1]
SPEC = dict(GUIDED_SPEC, name="guided-sampler")
OBJECTIVE = ("tokens_per_s_per_device", "maximize")


@pytest.fixture(scope="module")
def ranked():
    spec = Spec.model_validate(SPEC)
    space = Space(spec)
    return rank_space(space.enumerate(), probe_context(spec), objectives_of(spec)), space, spec


@pytest.fixture(scope="module")
def world(ranked):
    """A machine unlike the model: tensor-parallel communication 2.5x slower, activations 25 % larger."""
    ranking, space, spec = ranked
    ctx = probe_context(spec)
    p = simulate_configs(
        ctx.model, ctx.workload, ctx.hardware, ctx.cluster, columns_from_params(ranking.enumeration.configs)
    )
    step = sum(np.nan_to_num(p[f"time_{k}"]) * (2.5 if k == "tp_comm" else 1.0) for k in TRAIN_TIME_COMPONENTS)
    mem = sum(np.nan_to_num(p[f"mem_{k}"]) * (1.25 if k == "activations" else 1.0) for k in TRAIN_MEM_COMPONENTS)
    capacity = float(p["memory_limit_gib"][0])
    return {config_key(c): (float(s), float(m)) for c, s, m in zip(ranking.enumeration.configs, step, mem)}, capacity


def _objective(sampler: GuidedSampler, world, seen: list[str]):
    truth, capacity = world

    def objective(trial: optuna.Trial) -> float:
        config = sampler.suggest_config(trial)
        key = config_key(config)
        seen.append(key)
        step, mem = truth[key]
        if mem > capacity:
            report_failure(
                trial,
                RuntimeError(
                    f"NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; {capacity:.2f} GiB total capacity; "
                    f"{capacity - 1:.2f} GiB already allocated; 1.00 GiB free; {capacity - 1:.2f} GiB reserved in total by PyTorch)"
                ),
            )
            raise RuntimeError("out of memory")
        trial.set_user_attr("peak_memory_gib", mem)
        trial.set_user_attr("step_time_s", step)
        return 64 * 4096 / 8 / step

    return objective


def _best_possible(world) -> float:
    truth, capacity = world
    return max(64 * 4096 / 8 / s for s, m in truth.values() if m <= capacity)


# ---- Optuna's own contract suites ------------------------------------------------------------------
class TestOptunaSamplerContract(BasicSamplerTestCase, RelativeSamplerTestCase, SingleOnlySamplerTestCase):
    """Optuna's tests for every sampler (optuna.testing.pytest_samplers): float/int/categorical
    parameters outside the spec, conditional and dynamic spaces, NaN objectives, partially fixed
    parameters, relative sampling on foreign spaces, and the refusal of multi-objective studies.
    Optuna's studies minimise by default, so this sampler guides the step time."""

    @pytest.fixture
    def sampler(self, ranked):
        ranking, space, _ = ranked
        return lambda: GuidedSampler(ranking, space, ("step_time_s", "minimize"), seed=0)


# ---- the guide in a plain Optuna study ------------------------------------------------------------
def test_plain_optuna_study_finds_the_optimum_and_stops(ranked, world):
    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0, n_trials=40)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    seen: list[str] = []
    study.optimize(
        _objective(sampler, world, seen), n_trials=40, callbacks=[sampler.stop_callback], catch=(RuntimeError,)
    )
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert complete and study.best_value >= 0.98 * _best_possible(world)
    # the first trial is one of the model's best bets among those that surely fit (before any
    # measurement, a config near the limit is not sure); a config is probed twice only as a
    # deliberate second measurement of a close call
    p_fit = sampler.guide.fit_probability([], *sampler.guide._memory_model([]))
    sure = [int(i) for i in ranking.order if p_fit[int(i)] >= sampler.guide.settings.fit_confidence]
    top = [config_key(ranking.enumeration.configs[i]) for i in sure[:5]]
    assert seen[0] in top
    for trial, key in zip(study.trials, seen):
        if seen.index(key) != trial.number:
            assert trial.system_attrs["autotune.guide"]["reason"].startswith("re-measure")
    # the guide told why it chose each config, and stopped before the budget when nothing could win
    assert all(t.system_attrs.get("autotune.guide", {}).get("reason") for t in study.trials)
    assert len(study.trials) < 40 and sampler.stop_reason(study)


def test_oom_text_becomes_evidence_that_lowers_p_fit(ranked, world):
    """after_trial parses the allocator's message into a status and byte counts, stored on the trial."""
    ranking, space, _ = ranked
    truth, capacity = world
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    predicted = np.asarray(ranking.predictions["peak_memory_gib"], float)
    # a surprise: predicted to fit, but over the capacity on this machine
    over = next(
        i
        for i, c in enumerate(ranking.enumeration.configs)
        if truth[config_key(c)][1] > capacity and predicted[i] < capacity
    )
    study.enqueue_trial(ranking.enumeration.params_of(over))
    before = sampler.guide.fit_probability([], *sampler.guide._memory_model([]))
    study.optimize(_objective(sampler, world, []), n_trials=1, catch=(RuntimeError,))
    trial = study.trials[0]
    assert trial.state == optuna.trial.TrialState.FAIL
    outcome = trial.system_attrs[OUTCOME_ATTR]
    assert outcome["status"] == "oom" and outcome["oom"]["needed_at_least"] == pytest.approx(capacity + 1, abs=0.01)
    obs = sampler.observations(study.trials)
    assert obs[0].status == "oom" and obs[0].oom_needed_gib == pytest.approx(capacity + 1, abs=0.01)
    mean, sd = sampler.guide._memory_model(obs)
    after = sampler.guide.fit_probability(obs, mean, sd)
    assert after[over] < min(0.5, before[over])
    tighter = mean >= mean[over]  # every config the model now gives less headroom is at least as doubtful
    assert (after[tighter] <= after[over] + 1e-9).all()


def test_fixed_parameters_narrow_the_choice(ranked):
    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.enqueue_trial({"tp": 8, "recompute": "full"})
    trial = study.ask()
    config = sampler.suggest_config(trial)
    assert config["tp"] == 8 and config["recompute"] == "full"
    # the model's best among the configs with those values
    fits = np.asarray(ranking.predictions["fits"], bool)
    candidates = [
        int(i)
        for i in ranking.order
        if fits[i]
        and ranking.enumeration.configs[i]["tp"] == 8
        and ranking.enumeration.configs[i]["recompute"] == "full"
    ]
    assert config_key(config) == config_key(ranking.enumeration.configs[candidates[0]])


def test_failed_and_pruned_trials_are_not_proposed_again(ranked):
    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0, settings=GuideSettings(stop_early=False))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    keys = []

    def objective(trial):
        config = sampler.suggest_config(trial)
        keys.append(config_key(config))
        if len(keys) == 1:
            raise ValueError("a crash that says nothing about memory")
        if len(keys) == 2:
            raise optuna.TrialPruned()
        return 1000.0

    study.optimize(objective, n_trials=5, catch=(ValueError,))
    assert len(set(keys)) == 5
    assert [o.status for o in sampler.observations(study.trials)][:2] == ["error", "pruned"]


def test_same_seed_same_sequence_and_a_resumed_study_continues(ranked, world, tmp_path):
    ranking, space, _ = ranked

    def run(storage, n, seen):
        sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=3, settings=GuideSettings(stop_early=False))
        study = optuna.create_study(
            direction="maximize", sampler=sampler, storage=storage, study_name="s", load_if_exists=True
        )
        study.optimize(_objective(sampler, world, seen), n_trials=n, catch=(RuntimeError,))
        return study

    first: list[str] = []
    second: list[str] = []
    run(None, 8, first)
    run(None, 8, second)
    assert first == second
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    resumed: list[str] = []
    run(storage, 4, resumed)
    run(storage, 4, resumed)  # a new process, a new sampler: it reads what was measured from the storage
    assert resumed == first[:8]


def test_conditional_parameters_go_to_the_independent_sampler(ranked):
    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def objective(trial):
        config = sampler.suggest_config(trial)
        lr = trial.suggest_float("lr", 1e-5, 1e-3, log=True)
        assert 1e-5 <= lr <= 1e-3
        return 1000.0 / config["tp"]

    study.optimize(objective, n_trials=3)
    assert all("lr" in t.params for t in study.trials)


def test_direction_mismatch_is_a_clear_error(ranked):
    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    with pytest.raises(ValueError, match="to maximize"):
        sampler.suggest_config(study.ask())


def test_plain_optuna_example_runs(tmp_path):
    """examples/plain_optuna: a plain Optuna script with the guide as its sampler, no runner."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "plain_optuna" / "guided_study.py"),
            str(ROOT / "search_spaces" / "llama2_7b_8npu.yaml"),
            "--simulate",
            "--n-trials",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "best" in out.stdout and "trials" in out.stdout
    assert "the guide's estimate puts first: {" in out.stdout  # GuidedSampler.estimates in plain Optuna


def test_what_a_peak_counts_reaches_the_guide(ranked):
    """A probe says what its peak counts (``peak_memory_counts``, in autotune's trial info or as a
    plain user attribute); the reserved peak beside an allocated one is the closer figure."""
    from autotune.trial_attrs import A

    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    params = [ranking.enumeration.params_of(i) for i in range(4)]
    attrs = [
        {A.STATUS: "ok", A.METRICS: {"peak_memory_gib": 30.0}, A.INFO: {"peak_memory_counts": "allocated"}},
        {
            A.STATUS: "ok",
            A.METRICS: {"peak_memory_gib": 30.0, "peak_reserved_gib": 32.0},
            A.INFO: {"peak_memory_counts": "allocated"},
        },
        {"peak_memory_gib": 31.0, "peak_memory_counts": "reserved"},
        {"peak_memory_gib": 33.0},
        # the device's peak beside the reserved one, and what the allocator could use: compared like with like
        {
            A.STATUS: "ok",
            A.METRICS: {"peak_memory_gib": 36.0, "peak_reserved_gib": 29.0},
            A.INFO: {"usable_memory_gib": 30.5},
        },
        {A.STATUS: "ok", A.METRICS: {"peak_memory_gib": 36.0, "peak_reserved_gib": 29.0}},  # no usable: the device's
    ]
    params = [ranking.enumeration.params_of(i) for i in range(len(attrs))]
    for p, ua in zip(params, attrs):
        study.add_trial(
            optuna.trial.create_trial(
                params=p, distributions={n: sampler._distributions[n] for n in p}, value=1000.0, user_attrs=ua
            )
        )
    obs = sampler.observations(study.trials)
    assert [(o.peak_memory_gib, o.peak_counts) for o in obs] == [
        (30.0, "allocated"),
        (32.0, "reserved"),
        (31.0, "reserved"),
        (33.0, "device"),
        (29.0, "reserved"),
        (36.0, "device"),
    ]


def test_a_probes_step_interval_reaches_the_guide_as_its_readings_noise(ranked):
    """A training probe's within-run interval of its mean step time (``step_time_s_ci_low`` /
    ``_high`` over ``n_steps``, autotune.study.interpret.step_intervals) is the standard error of its
    reading (``Observation.reading_noise``) and sets the floor under the study's noise; a reading
    without steps (a launcher's one figure) leaves the guide's default."""
    from scipy import stats

    from autotune.objectives.intervals import mean_interval
    from autotune.trial_attrs import A

    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    steps = [1.00, 1.01, 0.99, 1.02]
    low, high = mean_interval(steps)
    with_steps = {"tokens_per_s_per_device": 1000.0, "step_time_s": 1.005, "n_steps": 4.0}
    with_steps.update(step_time_s_ci_low=low, step_time_s_ci_high=high)
    for i, metrics in enumerate((with_steps, {"tokens_per_s_per_device": 990.0})):
        params = ranking.enumeration.params_of(i)
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={n: sampler._distributions[n] for n in params},
                value=metrics["tokens_per_s_per_device"],
                user_attrs={A.STATUS: "ok", A.METRICS: metrics},
            )
        )
    first, second = sampler.observations(study.trials)
    se = float(np.std(steps, ddof=1)) / len(steps) ** 0.5 / float(np.mean(steps))
    assert first.reading_noise == pytest.approx(se) and second.reading_noise is None
    assert sampler.guide.noise_floor([first, second]) == pytest.approx(se)
    assert sampler.guide.noise_floor([second]) == pytest.approx(GuideSettings().noise)
    assert stats.t.ppf(0.975, 3) * se * float(np.mean(steps)) == pytest.approx((high - low) / 2)


def test_mindspores_pool_is_what_its_allocator_could_use_not_the_devices_memory(ranked):
    """MindSpore takes its pool from the device once at start ("MindSpore Used memory size") and counts
    an out-of-memory failure within it; HCCL's buffers and the runtime live beside the pool. Read as the
    device's figures, its message put the usable memory a runtime-and-buffers below the truth (7B 8x32
    world 5 of benchmarks/search_efficiency.py: 24.3 GiB believed, 30.0 true; the optimum never probed).
    Read as the pool's, the guide's usable memory is the pool plus what its model puts beside it, and
    the failed config stays over the limit."""
    from autotune.trial_attrs import A
    from autotune.workers.protocol import oom_evidence

    ranking, space, _ = ranked
    sampler = GuidedSampler(ranking, space, OBJECTIVE, seed=0)
    guide = sampler.guide
    i = 0
    nominal = float(guide.limit[i])
    pool, static = nominal - 6.0, 10.0
    text = "\n".join(
        [
            f"Out of Memory!!! Request memory size: {2 * 2**30}B, Memory Statistic:",
            f"Device HBM memory size: {int(nominal * 1024)}M",
            f"MindSpore Used memory size: {int(pool * 1024)}M",
            "MindSpore memory base address: 0x124140000000",
            f"Total Static Memory size: {int(static * 1024)}M",
            f"Total Dynamic memory size: {int((pool - static - 1.0) * 1024)}M",
            f"Dynamic memory size of this graph: {int((pool - static - 1.0) * 1024)}M",
        ]
    )
    evidence = oom_evidence(text)
    assert evidence["allocator_usable"] == pytest.approx(pool, abs=1e-3)
    assert evidence["needed_at_least"] == pytest.approx(pool + 1.0, abs=1e-3)  # within the pool: over it by 1
    study = optuna.create_study(direction="maximize", sampler=sampler)
    params = ranking.enumeration.params_of(i)
    study.add_trial(
        optuna.trial.create_trial(
            params=params,
            distributions={n: sampler._distributions[n] for n in params},
            state=optuna.trial.TrialState.FAIL,
            user_attrs={A.STATUS: "oom", A.INFO: {"oom": evidence}},
        )
    )
    (o,) = sampler.observations(study.trials)
    assert o.oom_counts == "reserved" and o.usable_gib == pytest.approx(pool, abs=1e-3)
    usable, _ = guide.usable_limit([o])
    names = guide.mem_names
    beside = sum(float(guide.mem_components[i, names.index(c)]) for c in ("runtime_reserve", "comm_buffers"))
    assert beside > 1.0
    # not the pool-level figure (pool + 1) taken for the device's: the pool and what lives beside it
    assert usable[i] == pytest.approx(min(nominal, pool + beside), rel=0.05)
    assert usable[i] > pool + 1.0
    # the config that failed needed more than its pool: it stays unlikely to fit
    mean, sd = guide._memory_model([o])
    assert guide.fit_probability([o], mean, sd)[i] < 0.5
