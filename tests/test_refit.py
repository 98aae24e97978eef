"""Refitting the performance model from measured probes (autotune.guide.refit) and in the search loop."""

from __future__ import annotations

import pytest

from autotune.dispatch.backends import BackendChoice
from autotune.dispatch.dispatcher import InProcessDispatcher
from autotune.guide.refit import Refit, fit_refit
from autotune.cli.assembly import study_runner
from autotune.spec.load import load_spec
from autotune.workers.protocol import ProbeResult
from support import TINY_TRAIN, MessageObserver


def _pred(compute: float, comm: float) -> dict[str, float]:
    return {
        "time_gemm": compute * 0.7,
        "time_elementwise": compute * 0.3,
        "time_dp_comm": comm,
        "step_time_s": compute + comm,
        "tokens_per_s_per_device": 1000.0 / (compute + comm),
        "mfu": 0.5,
    }


def test_groups_cover_every_time_component_once():
    from autotune.guide.refit import COMPONENTS, GROUPS

    grouped = [k for names in GROUPS.values() for k in names]
    assert sorted(grouped) == sorted(COMPONENTS) and len(set(grouped)) == len(grouped)


def test_a_profiled_step_splits_the_error_between_compute_and_communication():
    """One probe, step time 2x the prediction: from the step alone the ridge spreads the miss; with
    the probe's measured communication time (profile_step) the fit puts it where it was."""
    predicted = {"time_gemm": 0.6, "time_elementwise": 0.2, "time_tp_comm": 0.2, "step_time_s": 1.0}
    # measured: compute as predicted (0.8 s), communication 6x (1.2 s)
    alone = fit_refit([(predicted, 2.0)])
    split = fit_refit([(predicted, 2.0, 1.2)])
    assert split.n == alone.n == 1
    assert split.factors["tp"] > 4.0 and split.factors["compute"] < 1.3
    assert alone.factors["tp"] < split.factors["tp"] and alone.factors["compute"] > split.factors["compute"]
    # a config without communication is priced by the compute factor the split found
    compute_only = {"time_gemm": 0.6, "time_elementwise": 0.2, "step_time_s": 0.8}
    assert split.apply(compute_only)["refit_step_time_s"] == pytest.approx(0.8, rel=0.3)
    # a breakdown with nothing to say (no communication predicted, or none measured) changes nothing
    assert fit_refit([(compute_only, 1.6, 0.5)]) == fit_refit([(compute_only, 1.6)])
    assert fit_refit([(predicted, 2.0, None)]) == alone


def test_no_measurement_is_the_identity():
    assert fit_refit([]) == Refit()
    assert Refit().apply(_pred(1.0, 0.5)) == {}


def test_recovers_separate_compute_and_comm_factors():
    truth_compute, truth_comm = 1.8, 0.6
    configs = [(1.0, 0.2), (2.0, 1.0), (0.5, 0.8), (1.5, 0.1), (3.0, 2.0)]
    pairs = [(_pred(c, m), truth_compute * c + truth_comm * m) for c, m in configs]
    refit = fit_refit(pairs)
    assert refit.n == 5
    # compute and memory always move together here (a 0.7/0.3 split): their blend is what is fitted
    blend = 0.7 * refit.factors["compute"] + 0.3 * refit.factors["memory"]
    assert blend == pytest.approx(truth_compute, rel=0.03)
    assert refit.factors["dp"] == pytest.approx(truth_comm, rel=0.1)
    assert refit.mape_after < 2 and refit.mape_before > 10
    adjusted = refit.apply(_pred(2.0, 1.0))
    assert adjusted["refit_step_time_s"] == pytest.approx(1.8 * 2.0 + 0.6 * 1.0, rel=0.03)
    # throughput and MFU scale with the inverse of the step time
    step = adjusted["refit_step_time_s"]
    assert adjusted["refit_tokens_per_s_per_device"] == pytest.approx(1000.0 / 3.0 * 3.0 / step)
    assert adjusted["refit_mfu"] == pytest.approx(0.5 * 3.0 / step)


def _layout(tp_comm: float, bubble: float = 0.0) -> dict[str, float]:
    pred = {"time_gemm": 1.0, "time_elementwise": 0.2, "time_tp_comm": tp_comm, "time_pp_bubble": bubble}
    step = sum(pred.values())
    return {**pred, "step_time_s": step, "tokens_per_s_per_device": 1000.0 / step}


def test_one_slow_tp_probe_corrects_tp_configs_and_leaves_tp1_alone():
    """The model priced tensor parallelism nearly free; the machine's small collectives are 8x
    slower. Two tp = 1 probes and one tp = 2 probe: the other tp = 2 configs are corrected, the
    tp = 1 ones are not dragged down with them (one global factor would do both wrong)."""
    truth = {"compute": 1.1, "memory": 1.1, "tp": 8.0, "pipeline": 1.1, "dp": 1.0}

    def measured(pred):
        return (
            truth["compute"] * pred["time_gemm"]
            + truth["memory"] * pred["time_elementwise"]
            + truth["tp"] * pred["time_tp_comm"]
            + truth["pipeline"] * pred["time_pp_bubble"]
        )

    probes = [_layout(0.0), _layout(0.0, bubble=0.3), _layout(0.1)]
    refit = fit_refit((p, measured(p)) for p in probes)
    assert refit.factors["tp"] > 5.0
    for held_out in (_layout(0.05), _layout(0.2), _layout(0.0, bubble=0.1), _layout(0.0)):
        got = refit.apply(held_out)["refit_step_time_s"]
        assert got == pytest.approx(measured(held_out), rel=0.05), (held_out, refit.describe())
    # one common factor (the mean ratio) would have put tp = 1 configs too slow, tp = 2 too fast
    common = sum(measured(p) / p["step_time_s"] for p in probes) / len(probes)
    assert common * _layout(0.0)["step_time_s"] > 1.10 * measured(_layout(0.0))
    assert common * _layout(0.2)["step_time_s"] < 0.85 * measured(_layout(0.2))


def test_a_measured_profile_keeps_one_noisy_probe_from_distorting_the_groups():
    """Three probes, each the only one with its communication group; the first ran 45 % slow
    (noise). Trusting the profile as little as a data sheet, the fit bends the groups it can move
    freely to explain the miss (a pipeline 6x cheaper than predicted, from probes whose pipeline
    was predicted right); with a measured profile's ridge every factor stays a modest correction."""
    from autotune.guide.refit import RIDGE_DATA_SHEET, RIDGE_MEASURED

    noisy = {"time_gemm": 0.39, "time_dp_comm": 0.004}
    tp = {"time_gemm": 0.40, "time_tp_comm": 0.8}
    pp = {"time_gemm": 0.40, "time_pp_bubble": 0.1}
    pairs = [(noisy, 1.45 * 0.394), (tp, 1.2), (pp, 0.5)]
    loose = fit_refit(pairs, ridge=RIDGE_DATA_SHEET).factors
    assert min(loose.values()) < 0.25
    trusted = fit_refit(pairs, ridge=RIDGE_MEASURED).factors
    assert all(0.5 < f < 2.0 for f in trusted.values()), trusted


def test_few_measurements_or_no_communication_give_one_common_factor():
    two = fit_refit([(_pred(1.0, 0.5), 3.0), (_pred(2.0, 1.0), 6.0)])
    assert all(v == pytest.approx(2.0) for v in two.factors.values())
    silent = fit_refit([(_pred(c, 0.0), 0.5 * c) for c in (1.0, 2.0, 3.0, 4.0)])
    assert all(v == pytest.approx(0.5) for v in silent.factors.values())


def test_pairs_without_a_breakdown_or_measurement_are_ignored():
    refit = fit_refit([({"step_time_s": 1.0}, 2.0), (_pred(1.0, 0.0), float("nan")), (_pred(1.0, 0.0), 3.0)])
    assert refit.n == 1 and refit.compute == pytest.approx(3.0)


@pytest.mark.parametrize("sampler", ["random", "auto"])  # auto: configs queued from the ranking up front
def test_the_search_loop_refits_after_each_measurement(write_spec, tmp_path, sampler):
    """Probes that run 3x slower than predicted: after the first measurement every later
    prediction carries a refit_ value close to what is then measured."""
    spec = load_spec(
        write_spec(
            TINY_TRAIN.replace(
                "search: {n_trials: 6, seed: 1}", f"search: {{n_trials: 6, seed: 1, sampler: {sampler}}}"
            )
        )
    )
    runner_holder: dict = {}

    def probe(request):
        predicted = runner_holder["runner"].resolver.prediction(request.params)
        step = 3.0 * predicted["step_time_s"]
        return ProbeResult("ok", metrics={"step_time_s": step, "tokens_per_s_per_device": 1.0 / step})

    observer = MessageObserver()
    messages = observer.messages

    runner = study_runner(
        spec,
        tmp_path / "run",
        BackendChoice("command", "test"),
        observer=observer,
        dispatcher=InProcessDispatcher(probe),
    )
    runner_holder["runner"] = runner
    outcome = runner.run()
    probed = sorted((r for r in outcome.records if r.probed), key=lambda r: r.number)
    assert "refit_step_time_s" not in probed[0].predicted  # nothing measured yet
    for r in probed[1:]:
        assert r.predicted["refit_step_time_s"] == pytest.approx(r.metrics["step_time_s"], rel=1e-6)
    assert runner.refit.n == 6 and runner.refit.compute == pytest.approx(3.0)
    assert any(m.startswith("refit after trial") for m in messages)


def test_a_factor_pinned_at_its_range_end_leaves_the_others_at_their_optimum():
    """Projected Gauss-Newton: a group whose measurements ask for more than the factor range allows
    is held at the range's end, and the other groups are fitted given that (their gradient is zero),
    not left cycling to the step cap (what the loop's no-op benchmark probes did, 19 ms a refit)."""
    import numpy as np

    from autotune.guide.refit import _LOG_RANGE, _fit_log_factors

    rng = np.random.default_rng(3)
    a = np.column_stack([np.full(12, 0.015), rng.uniform(0.001, 0.005, 12), rng.uniform(0.001, 0.003, 12)])
    ridge = 0.05
    u = _fit_log_factors(a, ridge)
    assert u[0] == pytest.approx(_LOG_RANGE)  # the rows ask ~66x of it, the range allows 50x
    scale = np.exp(u)
    gradient = 2 * (a * scale).T @ (a @ scale - 1.0) + 2 * ridge * u
    assert np.abs(gradient[1:]).max() < 1e-6, gradient
    assert gradient[0] < 0  # the pinned one still pushes outward: held, not at an interior optimum
