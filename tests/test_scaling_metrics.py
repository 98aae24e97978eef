"""Scaling figures a study can name (issue 45, item 2): ``scaling_efficiency`` and
``comm_fraction`` as metrics of every training trial (the simulator's; a measured trial's read
by the calibrated model from its measurement), and constraints on metrics
(``scaling_efficiency >= 0.8``) that judge each result, prescreen the ranking and keep a result
that misses them from being the best."""

from __future__ import annotations

import pytest

from autotune.cli.assembly import study_runner
from autotune.dispatch.backends import BackendChoice
from autotune.dispatch.dispatcher import InProcessDispatcher
from autotune.guide.projection import reference_devices, scaling_figures
from autotune.guide.ranking import rank_space
from autotune.spec.checks import semantic_problems
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec
from autotune.spec.resolve import objectives_of, probe_context
from autotune.spec.space import Space
from autotune.study.records import best_records
from autotune.workers.protocol import ProbeResult, TrialRequest
from autotune.workers.simulate import simulate_trial
from support import TINY_TRAIN

FOUR_NODES = TINY_TRAIN.replace("nodes: 1, devices_per_node: 2", "nodes: 4, devices_per_node: 2")


def _spec(write_spec, text: str, constraints: list[str], **search):
    settings = {"n_trials": 10, "seed": 1, **search}
    text = text.replace(
        "search: {n_trials: 6, seed: 1}",
        "search: {" + ", ".join(f"{k}: {v}" for k, v in settings.items()) + "}\n"
        "constraints: [" + ", ".join(repr(c) for c in constraints) + "]",
    )
    return load_spec(write_spec(text))


def _request(spec, config: dict) -> TrialRequest:
    context = probe_context(spec)
    return TrialRequest(
        params=config, model=context.model, workload=context.workload, cluster=context.cluster, study="t", number=0
    )


def _config(spec, **params):
    resolved = Space(spec).resolve(params)
    assert resolved.valid, resolved.violations
    return resolved.config


# ---- the simulator ------------------------------------------------------------------------------
def test_the_simulator_reports_both_figures_and_one_replica_scales_linearly(write_spec):
    spec = _spec(write_spec, FOUR_NODES, [])
    spread = simulate_trial(_request(spec, _config(spec, tp=1, pp=1, micro_batch_size=1, zero_stage=0)))
    assert spread.ok and 0.0 < spread.metrics["comm_fraction"] < 1.0
    assert 0.0 < spread.metrics["scaling_efficiency"] < 1.0  # dp 8 over 4 nodes against one node's dp 2
    one_node = _spec(write_spec, TINY_TRAIN, [])
    alone = simulate_trial(_request(one_node, _config(one_node, tp=2, pp=1, micro_batch_size=1, zero_stage=0)))
    assert alone.metrics["scaling_efficiency"] == pytest.approx(1.0)  # dp 1: the reference itself


def test_reference_size_is_one_node_across_nodes_else_one_replica(write_spec):
    spec = _spec(write_spec, FOUR_NODES, [])
    cluster = probe_context(spec).cluster
    assert reference_devices(_config(spec, tp=1, pp=1, micro_batch_size=1), cluster) == 2  # one node: dp 2
    assert reference_devices(_config(spec, tp=2, pp=2, micro_batch_size=1), cluster) == 4  # one replica, 2 nodes
    one = probe_context(_spec(write_spec, TINY_TRAIN, []))
    assert reference_devices({"tp": 1, "pp": 1, "cp": 1, "dp": 2}, one.cluster) == 1


# ---- a measured trial's figures ----------------------------------------------------------------
def test_a_measurement_at_the_models_own_step_reads_the_models_efficiency(write_spec):
    """Anchoring cancels what the model gets uniformly wrong: a measured step that is the model's
    own (or any multiple of it, with the model's share) gives the model's efficiency back."""
    spec = _spec(write_spec, FOUR_NODES, [])
    request = _request(spec, _config(spec, tp=1, pp=1, micro_batch_size=1, zero_stage=0))
    simulated = simulate_trial(request).metrics
    for factor in (1.0, 3.0):
        figures = scaling_figures({"step_time_s": simulated["step_time_s"] * factor}, request, request)
        assert figures["scaling_efficiency"] == pytest.approx(simulated["scaling_efficiency"], rel=1e-6)
        assert figures["comm_fraction"] == pytest.approx(simulated["comm_fraction"], rel=1e-6)
    measured_share = scaling_figures({"step_time_s": 2.0, "comm_fraction": 0.3}, request, request)
    assert measured_share["comm_fraction"] == 0.3  # the profiled step's, at full size
    assert scaling_figures({}, request, request) == {}  # no step time: nothing to read


def _measured_study(write_spec, tmp_path, constraints, **search):
    spec = _spec(write_spec, FOUR_NODES, constraints, sampler="random", **search)

    def probe(request):
        p = request.params
        return ProbeResult("ok", metrics={"step_time_s": 0.5 * p["micro_batch_size"] * p["grad_accum"] / p["tp"]})

    runner = study_runner(
        spec, tmp_path / "run", BackendChoice("command", "test"), dispatcher=InProcessDispatcher(probe)
    )
    return spec, runner.run()


def test_a_measured_study_judges_each_result_by_its_constraint_on_scaling(write_spec, tmp_path):
    spec, outcome = _measured_study(write_spec, tmp_path, ["scaling_efficiency >= 0.9"])
    ok = [r for r in outcome.records if r.status == "ok" and r.probed]
    assert ok and all("scaling_efficiency" in r.metrics for r in ok)
    assert all(r.info["scaling_figures"]["metrics"] == ["scaling_efficiency"] for r in ok)  # said as the model's
    missed = [r for r in ok if r.metrics["scaling_efficiency"] < 0.9]
    met = [r for r in ok if r.metrics["scaling_efficiency"] >= 0.9]
    assert missed and met  # the seed's trials fall on both sides
    for r in missed:
        assert not r.feasible and "scaling_efficiency >= 0.9" in r.reason and r.to_json()["misses"] == r.reason
    assert all(r.feasible for r in met)
    best = best_records(outcome.records, objectives_of(spec))
    assert best and best[0].metrics["scaling_efficiency"] >= 0.9
    # without the constraint, the faster config that scales worse is the best
    _, free = _measured_study(write_spec, tmp_path / "free", [])
    unconstrained = best_records(free.records, objectives_of(spec))[0]
    assert "scaling_efficiency" not in unconstrained.metrics  # not named: a measured trial keeps what it measured
    fastest = max(r.metrics["tokens_per_s_per_device"] for r in ok)
    assert fastest > best[0].metrics["tokens_per_s_per_device"]


def test_the_ranking_drops_configs_predicted_to_miss_a_constraint_on_a_metric(write_spec):
    spec = _spec(write_spec, FOUR_NODES, ["scaling_efficiency >= 0.85"])
    space = Space(spec)
    assert [e.source for e in space.outcome_constraints] == ["scaling_efficiency >= 0.85"]
    assert not space.user_constraints  # not a rule of the space: every layout is still a config
    ranking = rank_space(space.enumerate(), probe_context(spec), objectives_of(spec))
    efficiency = ranking.predictions["scaling_efficiency"]
    fits = ranking.predictions["fits"]
    assert fits.any() and (efficiency[fits] >= 0.85).all()
    assert ((efficiency < 0.85) & ~fits).any()  # some were dropped for it


@pytest.mark.parametrize(
    "constraint, message",
    [("scaling_efficiency >= 0.8 or tp == 1", "split it in two"), ("scaling_eficiency >= 0.8", "unknown name")],
)
def test_a_constraint_that_mixes_a_metric_and_the_config_is_refused(write_spec, constraint, message):
    with pytest.raises(SpecError) as caught:
        _spec(write_spec, FOUR_NODES, [constraint])
    assert "constraints[0]" in str(caught.value) and message in str(caught.value)


def test_a_constraint_on_a_metric_with_a_constant_is_accepted(write_spec):
    spec = _spec(write_spec, FOUR_NODES, ["scaling_efficiency >= 0.2 * nodes"])
    assert not [p for p in semantic_problems(spec) if p.loc[0] == "constraints"]
    assert Space(spec).outcome_misses({"scaling_efficiency": 0.7}) == [
        "'scaling_efficiency >= 0.2 * nodes' (scaling_efficiency 0.7)"
    ]
    assert Space(spec).outcome_misses({}) == ["'scaling_efficiency >= 0.2 * nodes': no value of scaling_efficiency"]
