"""Answers a team can act on (issue 40): an inference study decides a deployment (instances x tp,
ranked per device, every config measured at the workload's batch sizes), a serving study shows the
figures a serving decision reads (p99s against the SLO, attainment, max rate, replicas x tp, cost),
the headroom rule of a serving engine is its own memory setting, "not distinguished" is said only of
knobs the model prices alike, and a finished study re-run says it ran nothing."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.finish.run_output import WIDTH
from autotune.spec.load import load_spec
from support import REPO

runner = CliRunner()
INFER = REPO / "search_spaces" / "llama2_7b_infer_8npu.yaml"
SERVE = REPO / "search_spaces" / "llama2_7b_serve_8npu.yaml"


@pytest.fixture(scope="module")
def serve_study(tmp_path_factory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("serve") / "run"
    result = runner.invoke(app, ["run", str(SERVE), "--run-dir", str(run_dir), "--no-tracking"])
    assert result.exit_code == 0, result.output
    return run_dir, result


# --- inference: a deployment, ranked per device --------------------------------------------------------


def test_inference_batch_sizes_are_measurement_points_not_a_knob(tmp_path):
    from autotune.spec.space import Space

    spec = load_spec(INFER)
    assert "batch_size" not in Space(spec).choices
    bad = tmp_path / "bad.yaml"
    bad.write_text(INFER.read_text().replace("  tp: [1, 2, 4, 8]\n", "  tp: [1, 2, 4, 8]\n  batch_size: [1, 4]\n"))
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "space.batch_size: batch_size is not a knob of an inference study" in " ".join(result.output.split())


def test_inference_ranks_instances_per_device_where_the_model_says_so():
    """Per instance tp8 decodes fastest, but 8 x tp1 or 4 x tp2 on the same 8 devices does more per
    device: the study's objective ranks the deployment, not one instance."""
    payload = json.loads(runner.invoke(app, ["plan", str(INFER), "--json", "--top", "30"]).stdout)
    rows = [(t["params"], t["metrics"]) for t in payload["top"]]
    per_device = {}
    per_instance = {}
    for params, metrics in rows:
        key = (params["tp"], params["kv_cache_dtype"], params["quantization"])
        assert params["replicas"] * params["tp"] == 8  # the instances fill the node
        per_device[key] = metrics["decode_tokens_per_s_per_device"]
        per_instance[key] = metrics["decode_tokens_per_s"]
        # per device is the instance's figure over the devices it occupies, at the largest batch
        assert metrics["decode_tokens_per_s_per_device"] == pytest.approx(metrics["decode_tokens_per_s"] / params["tp"])
        assert metrics["decode_tokens_per_s"] == metrics["decode_tokens_per_s_bs16"]
        assert metrics["ttft_ms"] == metrics["ttft_ms_bs1"]  # latency at the smallest batch
    key8, key1, key2 = (8, "int8", "w8a8"), (1, "int8", "w8a8"), (2, "int8", "w8a8")
    assert per_instance[key8] >= per_instance[key2]  # one tp8 instance is the fastest instance
    assert max(per_device[key1], per_device[key2]) > per_device[key8]
    assert payload["top"][0]["params"]["tp"] in (1, 2)


def test_inference_run_reports_every_batch_point_of_the_best(tmp_path):
    result = runner.invoke(app, ["run", str(INFER), "--run-dir", str(tmp_path / "run"), "--no-tracking"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "at batch 1 / 4 / 16 (the workload's measurement points, per instance)" in text
    assert re.search(r"TTFT [\d.,]+ / [\d.,]+ / [\d.,]+ ms; 100 tokens in", text)
    assert "bs=" not in result.stdout  # batch size is no part of a config
    assert re.search(r"\d+ x tp\d", result.stdout)


def test_a_metric_at_a_batch_the_workload_does_not_measure_is_a_spec_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(INFER.read_text().replace("metric: ttft_ms ", "metric: ttft_ms_bs8 "))
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "not one of the workload's batch_sizes" in " ".join(result.output.split())
    ok = tmp_path / "ok.yaml"
    ok.write_text(INFER.read_text().replace("metric: ttft_ms ", "metric: ttft_ms_bs4 "))
    assert runner.invoke(app, ["validate", str(ok)]).exit_code == 0


def test_latency_bound_throughput_takes_the_largest_batch_meeting_the_bound():
    from autotune.objectives import infer_headline

    points = {
        1: {"ttft_ms": 20.0, "time_for_100_tokens_s": 1.0, "decode_tokens_per_s": 100.0},
        4: {"ttft_ms": 60.0, "time_for_100_tokens_s": 1.2, "decode_tokens_per_s": 360.0},
        16: {"ttft_ms": 400.0, "time_for_100_tokens_s": 2.0, "decode_tokens_per_s": 1200.0},
    }
    out = infer_headline(points, 2.0, {"ttft_bound_ms": 100.0})
    assert out["decode_tokens_per_s_per_device_in_bound"] == pytest.approx(180.0)  # batch 4
    assert out["decode_tokens_per_s_per_device"] == pytest.approx(600.0)  # batch 16, unbounded
    assert infer_headline(points, 2.0, {"ttft_bound_ms": 10.0})["decode_tokens_per_s_per_device_in_bound"] == 0.0


# --- serving: the figures a serving engineer reads ------------------------------------------------------


def test_a_serving_report_fits_120_columns_its_long_figure_names_staggered_whole(serve_study):
    """Seven serving figures' names (cost_per_million_output_tokens) made its lines 152 columns: they
    now alternate over two header lines, each whole (a spec's metric name stays searchable), each
    ending where its column's figures end."""
    report = runner.invoke(app, ["report", str(serve_study[0])], env={"COLUMNS": "200"})
    assert report.exit_code == 0, report.output
    lines = report.stdout.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    at = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    upper, lower, row = lines[at - 1], lines[at], lines[at + 1]
    names = ("goodput_rps_per_device", "max_rate_rps", "slo_attainment", "cost_per_million_output_tokens")
    for name in names:
        line = upper if name in upper else lower
        end = line.index(name) + len(name)
        assert name in upper + lower and row[end - 1] != " " and row[end : end + 1] in (" ", ""), (name, line, row)


def test_serving_run_and_report_show_the_decision_figures(serve_study):
    run_dir, result = serve_study
    text = " ".join(result.stdout.split())
    for column in ("max_rate_rps", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "cost_per_million_output_tokens"):
        assert column in result.stdout
    assert re.search(r"\d x tp\d: goodput [\d.]+ req/s/device \([\d.]+ req/s that met every SLO target\)", text)
    assert re.search(r"p99 TTFT [\d.,]+ ms \(SLO 2,000\), TPOT [\d.,]+ ms \(SLO 80\)", text)
    assert re.search(r"SLO attainment [\d.]+ % of the requests", text)
    assert re.search(r"cost [\d.]+ per million output tokens", text)
    report = runner.invoke(app, ["report", str(run_dir), "--top", "5"])
    assert report.exit_code == 0, report.output
    for column in ("max_rate_rps", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms", "cost_per_million_output_tokens"):
        assert column in report.stdout
    assert "p99 TTFT" in report.stdout and re.search(r"\d x tp\d", report.stdout)


def test_the_cost_per_million_output_tokens_is_in_the_run_directory(serve_study):
    """The spec sets cluster.cost_per_device_hour: the simulated trials carry the cost too (it was
    derived for measured results only)."""
    run_dir, _ = serve_study
    rows = list(csv.DictReader((run_dir / "results.csv").open()))
    spec = load_spec(SERVE)
    for row in rows:
        if row["status"] != "ok":
            continue
        cost = float(row["cost_per_million_output_tokens"])
        devices = int(row["replicas"]) * int(row["tp"]) * int(row["pp"])
        assert cost > 0 and devices == 8
        assert spec.cluster.cost_per_device_hour == 2.0


def test_the_serving_headroom_rule_is_the_engines_memory_setting():
    from autotune.study.recommend import recommend
    from autotune.study.records import TrialRecord

    def rec(n: int, goodput: float, util: float) -> TrialRecord:
        return TrialRecord(
            number=n,
            state="COMPLETE",
            config={"tp": 2, "replicas": 4, "memory_utilization": util},
            status="ok",
            source="simulated",
            metrics={"goodput_rps_per_device": goodput, "peak_memory_gib": 63.0},  # the engine fills its share
            predicted={},
            reason="",
            probed=True,
            baseline=False,
            chosen_because="",
            values=[goodput],
            feasible=True,
        )

    best, roomy = rec(0, 2.0, 0.95), rec(1, 1.99, 0.85)
    choice = recommend([best, roomy], [best], [("goodput_rps_per_device", "maximize")], 64.0, 4.0, None, True)
    assert choice.chosen is roomy  # 0.85 leaves 9.6 GiB outside the engine, whatever its peak
    assert choice.best_headroom_gib == pytest.approx(64.0 * 0.05)
    assert "memory_utilization 0.95" in choice.sentence and "outside the engine's share" in choice.sentence


# --- "not distinguished" is true ------------------------------------------------------------------------


def test_undistinguished_knobs_are_priced_alike_and_layouts_are_not_merged():
    """A knob is called undistinguished only where changing it alone leaves every prediction (the
    objectives and the peak) equal; 1 x tp8 and 4 x tp2 are never one layout."""
    from autotune.spec.resolve import objectives_of, probe_context
    from autotune.guide.ranking import rank_space
    from autotune.spec.space import Space, config_key

    spec = load_spec(SERVE)
    space = Space(spec)
    ranking = rank_space(space.enumerate(), probe_context(spec), objectives_of(spec))
    layouts = ranking.distinct_layouts()
    metric = objectives_of(spec)[0][0]
    for layout in layouts:
        assert "tp" not in layout.undistinguished and "replicas" not in layout.undistinguished
        first = ranking.enumeration.configs[layout.index]
        assert (
            len(
                {
                    (ranking.enumeration.configs[j]["tp"], ranking.enumeration.configs[j]["replicas"])
                    for j in layout.members
                }
            )
            == 1
        )
        for name, values in layout.undistinguished.items():
            for v in values:
                j = ranking.index_of(config_key({**first, name: v}))
                if j is not None:
                    a, b = ranking.metrics_of(layout.index), ranking.metrics_of(j)
                    assert a["peak_memory_gib"] == pytest.approx(b["peak_memory_gib"], abs=1e-3)
                    assert a[metric] == pytest.approx(b[metric], rel=0.011)
    pricing = ranking.knob_pricing(list(space.choices))
    assert set(pricing) == set(space.choices) and pricing["tp"] == "speed"


def test_exports_of_a_simulated_serving_study_mark_what_the_evidence_did_not_choose(serve_study):
    run_dir, _ = serve_study
    script = (run_dir / "export" / "serve_vllm.sh").read_text()
    assert not re.search(r"(?<!not )\bmeasured\b", script)
    assert "not chosen by evidence" in script


# --- consistency ----------------------------------------------------------------------------------------


def test_a_finished_study_run_again_says_it_ran_nothing(tmp_path):
    args = ["run", str(INFER), "--run-dir", str(tmp_path / "run"), "--no-tracking"]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "already complete, nothing run" in again.stderr


def test_report_marks_the_baseline_with_its_own_legend(tmp_path):
    spec = REPO / "search_spaces" / "llama2_7b_8npu.yaml"
    run_dir = tmp_path / "run"
    assert (
        runner.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking", "--n-trials", "4"]).exit_code
        == 0
    )
    report = runner.invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    lines = report.stdout.splitlines()
    assert any(re.match(r"^\d+B ", line) for line in lines)
    assert "B: the spec's baseline" in report.stdout
    assert not any(re.match(r"^\d+\* ", line) for line in lines)  # * marks a front, never the baseline
    assert "(* the baseline of the spec)" not in report.stdout
    assert "optuna-dashboard's (" not in report.stdout  # its importances are its own, not ours


def test_an_fp16_recommendation_carries_a_numerical_stability_note():
    from autotune.finish.run_output import precision_note

    assert "overflow" in precision_note({"precision": "fp16"}, "train")
    assert "65,504" in precision_note({"precision": "fp16"}, "infer")
    assert precision_note({"precision": "bf16"}, "train") == ""
