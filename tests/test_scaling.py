"""The scaling study (issue 45): `autotune scale RUN_DIR` on the simulator (the table, the JSON,
the files, MLflow, resuming without probing again, the input it refuses) and its parts: the sizes a
config runs at, the efficiency and its interval, the projection anchored on a measurement."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.objectives.scaling import efficiency_interval, scaling_efficiency
from autotune.scaling.measure import Reading, ReadingLog
from autotune.guide.projection import ModelPoint, projected_step
from autotune.scaling.sizes import ScalingInputError, Size, config_at, default_sizes, parse_sizes
from autotune.scaling.summary import summarise
from autotune.spec.load import load_spec
from support import TINY_TRAIN, mlflow_runs

EIGHT = TINY_TRAIN.replace("devices_per_node: 2", "devices_per_node: 8").replace(
    "global_batch_size: 8", "global_batch_size: 32"
)


@pytest.fixture()
def simulated_run(write_spec, tmp_path):
    """A finished simulated study of the tiny Llama on one 8-device CPU node, tracked in MLflow."""
    spec = write_spec(EIGHT)
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run), "--json"])
    assert result.exit_code == 0, result.output
    return spec, run


def test_scale_prints_efficiency_per_size_and_writes_the_files(simulated_run):
    spec, run = simulated_run
    result = CliRunner().invoke(app, ["scale", str(run), "--devices", "1,2,4,8", "--mode", "both", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["source"] == "simulated" and payload["modes"] == ["strong", "weak"]
    points = payload["points"]
    assert {(p["mode"], p["devices"]) for p in points} == {(m, d) for m in ("strong", "weak") for d in (1, 2, 4, 8)}
    for mode in ("strong", "weak"):
        curve = sorted(
            (p for p in points if p["mode"] == mode and p["tokens_per_s_per_device"]), key=lambda p: p["devices"]
        )
        assert len(curve) >= 2
        assert curve[0]["scaling_efficiency"] == pytest.approx(1.0)
        for p in curve:  # efficiency is throughput per device against the smallest size's
            assert p["scaling_efficiency"] == pytest.approx(
                p["tokens_per_s_per_device"] / curve[0]["tokens_per_s_per_device"]
            )
            assert p["readings"] == 1 and p["source"] == "simulated"
            assert 0.0 <= p["comm_fraction"] < 1.0
        assert curve[-1]["comm_fraction"] > curve[0]["comm_fraction"]  # more devices, more gradient reduction
    weak8 = next(p for p in points if p["mode"] == "weak" and p["devices"] == 8)
    weak1 = next(p for p in points if p["mode"] == "weak" and p["devices"] == 1)
    assert weak1["tokens_per_s_per_device"] and weak8["projected_tokens_per_s_per_device"]
    assert abs(weak8["projection_error"]) < 0.02  # the simulator projected from itself: rounding only
    files = {f.rsplit("/", 1)[-1] for f in payload["files"]}
    assert files == {"scaling.json", "scaling.png"}
    assert (run / "scaling" / "scaling.png").stat().st_size > 5_000
    on_disk = json.loads((run / "scaling" / "scaling.json").read_text())
    assert on_disk["points"] == points
    # the study's MLflow parent run holds the figures and the files
    parents, _ = mlflow_runs(run, "tiny")
    assert len(parents) == 1
    metrics = parents[0].data.metrics
    assert metrics["scaling_efficiency_weak_8"] == pytest.approx(weak8["scaling_efficiency"])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    artifacts = {a.path for a in client.list_artifacts(parents[0].info.run_id, "scaling")}
    assert artifacts == {"scaling/scaling.json", "scaling/scaling.png"}


def test_the_table_says_simulated_and_a_rerun_probes_nothing_again(simulated_run):
    _, run = simulated_run
    args = ["scale", str(run), "--devices", "2,4,8", "--no-tracking"]
    first = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert first.exit_code == 0, first.output
    assert "scaling, simulated: the analytical model's predictions" in first.stdout
    assert "tokens/s/device" in first.stdout and "n=1 sim" in first.stdout
    lines = (run / "scaling" / "readings.jsonl").read_text().splitlines()
    assert len(lines) == 3
    again = CliRunner().invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    assert (run / "scaling" / "readings.jsonl").read_text().splitlines() == lines  # nothing measured twice
    more = CliRunner().invoke(app, args + ["--repeats", "2", "--json"])
    assert more.exit_code == 0
    assert len((run / "scaling" / "readings.jsonl").read_text().splitlines()) == 6  # only the second readings


@pytest.mark.parametrize(
    "options, field",
    [
        (["--devices", "0,2"], "--devices: expected a comma-separated list of positive integers"),
        (["--devices", "4"], "--devices: a scaling study needs at least two sizes"),
        (["--devices", "2,16"], "--devices: [16] exceed the 8 devices per node"),
        (["--devices", "1,2", "--nodes", "1,2"], "--nodes/--devices: give node counts or device counts"),
        (["--nodes", "1,2"], "--nodes: sizes of more than one node run on a Ray cluster"),
        (["--mode", "sideways", "--devices", "1,2"], "--mode: expected strong, weak or both"),
        (["--repeats", "0", "--devices", "1,2"], "--repeats: expected >= 1"),
    ],
)
def test_bad_sizes_are_refused_with_the_option_named(simulated_run, options, field):
    spec, run = simulated_run
    text = spec.read_text() + "ray: {enabled: false}\n"
    spec.write_text(text)
    (run / "autotune_spec.path").write_text(str(spec) + "\n")
    result = CliRunner().invoke(app, ["scale", str(run), *options])
    assert result.exit_code == 2, result.output
    assert field in " ".join(result.stderr.split())


def test_a_run_directory_with_no_successful_trial_is_refused(write_spec, tmp_path):
    text = TINY_TRAIN.replace(
        "backend: simulate",
        f"backend: {{kind: command, argv: [{sys.executable}, -c, 'import sys; sys.exit(3)'], timeout_s: 30}}\n"
        "ray: {enabled: false}\ntarget: none",
    ).replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 2, seed: 1, sampler: random}")
    spec = write_spec(text)
    run = tmp_path / "run"
    done = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run), "--no-tracking", "--backend", "command"])
    assert done.exit_code == 1, done.output
    result = CliRunner().invoke(app, ["scale", str(run), "--devices", "1,2"])
    assert result.exit_code == 2, result.output
    assert "the study has no successful trial to scale" in " ".join(result.stderr.split())


def test_a_layout_that_runs_at_fewer_than_two_sizes_is_refused(write_spec):
    from autotune.scaling.study import ScalingPlan, plan_points

    spec = _spec(write_spec)
    config = {"tp": 2, "pp": 2, "micro_batch_size": 1, "zero_stage": 0, "recompute": "none", "dp": 2, "grad_accum": 16}
    plan = ScalingPlan([(3, config)], [Size(1, 1), Size(1, 2), Size(1, 4)], ["weak"], 1)
    with pytest.raises(ScalingInputError, match=r"trial 3's config \(tp 2, pp 2, cp 1\) runs at fewer than two"):
        plan_points(spec, plan, profile_step=False)
    plan.sizes.append(Size(1, 8))
    assert [s.size.devices for _, s in plan_points(spec, plan, False) if s.spec is not None] == [4, 8]


# ---- the parts -------------------------------------------------------------------------------
def _spec(write_spec, text=EIGHT):
    return load_spec(write_spec(text))


def test_weak_scaling_keeps_each_ranks_work_and_strong_scaling_the_global_batch(write_spec):
    spec = _spec(write_spec)
    config = {"tp": 2, "pp": 1, "micro_batch_size": 2, "zero_stage": 0, "recompute": "none", "dp": 4, "grad_accum": 4}
    weak = config_at(spec, config, Size(1, 4), "weak")
    assert weak.config["dp"] == 2 and weak.config["grad_accum"] == 4
    assert weak.spec.workload.global_batch_size == 2 * 2 * 4 and weak.spec.cluster.devices_per_node == 4
    strong = config_at(spec, config, Size(1, 4), "strong")
    assert strong.spec.workload.global_batch_size == 32 and strong.config["grad_accum"] == 8
    odd = config_at(spec, config, Size(1, 3), "weak")
    assert odd.spec is None and "tp*pp*cp = 2 does not divide 3 devices" in odd.why_not
    assert config_at(spec, config, Size(1, 8), "weak", profile_step=True).spec.workload.profile_step


def test_default_sizes_double_up_to_the_cluster(write_spec):
    spec = _spec(write_spec)
    assert [s.devices for s in default_sizes(spec, None, None)] == [1, 2, 4, 8]
    multi = _spec(write_spec, EIGHT.replace("nodes: 1", "nodes: 6"))
    assert [(s.nodes, s.devices_per_node) for s in default_sizes(multi, None, None)] == [(1, 8), (2, 8), (4, 8), (6, 8)]
    assert parse_sizes("4, 1,2", "--nodes") == [1, 2, 4]
    with pytest.raises(ScalingInputError, match="--nodes"):
        parse_sizes("1,x", "--nodes")


def test_efficiency_and_its_interval():
    assert scaling_efficiency(80.0, 100.0) == pytest.approx(0.8)
    low, high = efficiency_interval(80.0, (76.0, 84.0), 100.0, (97.0, 103.0))
    assert low < 0.8 < high and (high - low) / 2 / 0.8 == pytest.approx((0.05**2 + 0.03**2) ** 0.5)
    assert efficiency_interval(80.0, None, 100.0, (97.0, 103.0)) is None
    with pytest.raises(ValueError):
        scaling_efficiency(1.0, 0.0)


def test_the_projection_anchors_on_the_measurement():
    ref, target = ModelPoint(0.8, 0.2, 1000.0, 2), ModelPoint(0.8, 0.6, 4000.0, 8)
    # a host 1.5x slower than the model everywhere: the projection is 1.5x the model at the target
    assert projected_step(1.5, None, ref, target) == pytest.approx(1.5 * target.step_s)
    # a measured communication share unlike the model's: each part scales by its own ratio
    assert projected_step(1.0, 0.5, ref, target) == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)
    # no communication at the reference (one device): the model's absolute figure, anchored
    alone = ModelPoint(1.0, 0.0, 1000.0, 1)
    assert projected_step(2.0, 0.0, alone, target) == pytest.approx(2.0 * 0.8 + 0.6 * 2.0)


def test_the_summary_compares_the_projection_with_what_was_measured():
    small, large = Size(1, 1), Size(4, 1)
    readings = [
        Reading(0, "weak", small, k, "ok", "measured", {"tokens_per_s_per_device": v, "step_time_s": 1000.0 / v})
        for k, v in enumerate((100.0, 110.0))
    ] + [
        Reading(0, "weak", large, 0, "ok", "measured", {"tokens_per_s_per_device": 84.0, "step_time_s": 1000.0 / 84.0}),
        Reading(0, "weak", Size(8, 1), 0, "oom", "measured", {}, "out of memory"),
    ]
    models = {
        (0, "weak", small.label): ModelPoint(10.0, 0.0, 1000.0, 1),
        (0, "weak", large.label): ModelPoint(10.0, 2.5, 4000.0, 4),
    }
    planned = [
        (0, "weak", small, ""),
        (0, "weak", large, ""),
        (0, "weak", Size(8, 1), ""),
        (0, "weak", Size(3, 1), "no"),
    ]
    summary = summarise(planned, readings, models)
    by = {p.size: p for p in summary.points}
    assert by[small].readings == 2 and by[small].tokens_per_s_per_device == pytest.approx(105.0)
    assert by[small].interval is not None and by[small].efficiency == pytest.approx(1.0)
    assert by[large].efficiency == pytest.approx(84.0 / 105.0)
    step_ref = (1000.0 / 100.0 + 1000.0 / 110.0) / 2
    expected = 4000.0 / (step_ref * 1.0 + 2.5 * step_ref / 10.0) / 4
    assert by[large].projected_tokens_per_s_per_device == pytest.approx(expected)
    assert by[large].projection_error == pytest.approx(expected / 84.0 - 1.0)
    assert by[Size(8, 1)].failed.startswith("oom") and by[Size(8, 1)].projected_tokens_per_s_per_device is None
    assert by[Size(3, 1)].skipped == "no"
    assert summary.to_json()["projection"]["compared"] == 1


def test_a_cut_line_in_the_readings_file_loses_only_itself(tmp_path):
    log = ReadingLog(tmp_path)
    log.append(Reading(0, "weak", Size(1, 1), 0, "ok", "measured", {"tokens_per_s_per_device": 1.0}))
    with log.path.open("a") as f:
        f.write('{"trial": 0, "mode": "we')
    assert [r.status for r in log.load()] == ["ok"]
