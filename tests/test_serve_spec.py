"""A serve workload in the spec, its space and its MLflow content: what the user writes, the rules
a serving layout obeys, and the errors that name the field."""

import json
from pathlib import Path

import pytest

from autotune.cli.output import spec_summary
from autotune.spec.space import Space
from autotune.spec.errors import SpecError
from autotune.spec.load import load_spec
from autotune.spec.resolve import objectives_of

SERVE = """
name: serve-test
model: tiny-llama
workload:
  kind: serve
  traffic:
    rates: [1, 2, 4]
    prompt_len: {low: 64, high: 192}
    output_len: 32
  slo: {ttft_p99_ms: 1000, tpot_p99_ms: 100}
cluster: {accelerator: cpu, profile: cpu, devices_per_node: 4, cost_per_device_hour: 1.5}
target: none
space:
  tp: [1, 2, 4]
  replicas: [1, 2, 4]
  max_num_seqs: [16, 64]
  max_num_batched_tokens: [32, 256]
  enable_chunked_prefill: [true, false]
  kv_cache_dtype: [auto, bf16, fp8]
"""


def _errors(write_spec, text: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(text))
    return str(info.value)


def test_serve_spec_loads_with_resolved_context_and_default_objective(write_spec):
    spec = load_spec(write_spec(SERVE))
    w = spec.workload
    assert w.kind == "serve" and w.max_model_len == 192 + 32
    assert w.traffic.mean() == (128.0, 32.0) and w.traffic.longest() == (192, 32)
    assert objectives_of(spec) == (("goodput_rps_per_device", "maximize"),)
    assert "serve prompt ~128 output ~32 at 1/2/4 req/s" in spec_summary(spec)


def test_the_rate_tolerance_defaults_to_5_percent_and_reaches_the_probe(write_spec):
    from autotune.spec.resolve import probe_context

    assert load_spec(write_spec(SERVE)).workload.rate_tolerance == 0.05
    spec = load_spec(write_spec(SERVE.replace("kind: serve\n", "kind: serve\n  rate_tolerance: 0.02\n")))
    assert spec.workload.rate_tolerance == 0.02
    assert probe_context(spec).workload["rate_tolerance"] == 0.02  # what the trial file tells the probe


def test_one_rate_is_a_ladder_of_one(write_spec):
    spec = load_spec(write_spec(SERVE.replace("rates: [1, 2, 4]", "rates: 3")))
    assert spec.workload.traffic.rates == [3.0]


@pytest.mark.parametrize(
    "change, words",
    [
        (("rates: [1, 2, 4]", "rates: [4, 2]"), "ascend"),
        (("rates: [1, 2, 4]", "rates: [0, 2]"), "> 0"),
        (("    output_len: 32\n", ""), "output_len"),
        (("kind: serve\n", "kind: serve\n  max_model_len: 100\n"), "max_model_len (100) is below"),
        (("  max_num_seqs: [16, 64]", "  micro_batch_size: [1, 2]"), "micro_batch_size is not a serving parameter"),
        (
            ("kind: serve\n", "kind: serve\n  rate_tolerance: 0\n"),
            "workload.rate_tolerance: Input should be greater than 0",
        ),
        (
            ("kind: serve\n", "kind: serve\n  rate_tolerance: -0.1\n"),
            "workload.rate_tolerance: Input should be greater",
        ),
        (
            ("kind: serve\n", "kind: serve\n  rate_tolerance: 1\n"),
            "workload.rate_tolerance: Input should be less than 1",
        ),
        (
            ("kind: serve\n", "kind: serve\n  rate_tolerance: 1.5\n"),
            "workload.rate_tolerance: Input should be less than 1",
        ),
        (("kind: serve\n", "kind: serve\n  rate_tolerance: .nan\n"), "workload.rate_tolerance"),
    ],
)
def test_bad_serving_input_names_the_field(write_spec, change, words):
    assert words in _errors(write_spec, SERVE.replace(*change))


def test_serving_params_are_refused_in_a_training_spec(write_spec):
    from support import TINY_TRAIN

    text = TINY_TRAIN.replace("space:\n", "space:\n  max_num_seqs: [8, 16]\n", 1)
    assert "max_num_seqs is a serving parameter; the workload is train" in _errors(write_spec, text)


def test_lengths_file_is_read_relative_to_the_spec(write_spec, tmp_path: Path):
    (tmp_path / "lengths.jsonl").write_text(
        "\n".join(json.dumps({"prompt_len": p, "output_len": o}) for p, o in [(100, 20), (300, 60)])
    )
    text = SERVE.replace(
        "    prompt_len: {low: 64, high: 192}\n    output_len: 32\n", "    lengths_file: lengths.jsonl\n"
    )
    spec = load_spec(write_spec(text))
    assert spec.workload.traffic.length_pairs == [(100, 20), (300, 60)]
    assert spec.workload.max_model_len == 360
    (tmp_path / "lengths.jsonl").write_text('{"prompt_len": 10}\n')
    assert "record 1: expected prompt_len and output_len" in _errors(write_spec, text)


def test_serving_layouts_obey_the_node_and_the_engine_rules(write_spec):
    spec = load_spec(write_spec(SERVE))
    enum = Space(spec).enumerate()
    for c in enum.configs:
        assert c["replicas"] * c["tp"] * c["pp"] <= 4 and c["world_size"] == c["replicas"] * c["tp"] * c["pp"]
        assert c["max_num_batched_tokens"] >= c["max_num_seqs"]
        assert c["enable_chunked_prefill"] or c["max_num_batched_tokens"] >= 224
        assert c["kv_cache_dtype"] in ("auto", "fp8")  # bf16 KV with bf16 compute is the engine's default
    reasons = " ".join(enum.invalid_reasons)
    assert "replicas*tp*pp exceeds the devices of a node (4)" in reasons
    assert "max_num_batched_tokens below max_num_seqs" in reasons
    assert "without chunked prefill max_num_batched_tokens must hold max_model_len (224)" in reasons
    layouts = {(c["replicas"], c["tp"]) for c in enum.configs}
    assert layouts == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}


def test_serving_metrics_derive_per_device_and_cost():
    from autotune.objectives import derive_metrics, get_metric

    out = derive_metrics(
        {"goodput_rps": 8.0, "output_tokens_per_s": 3600.0},
        {},
        {"kind": "serve"},
        {},
        world_size=4,
        precision="bf16",
        cost_per_device_hour=2.0,
    )
    assert out["goodput_rps_per_device"] == 2.0 and out["output_tokens_per_s_per_device"] == 900.0
    # 4 devices x 2/h for 3600 x 3600 tokens/h = 12.96 M tokens
    assert out["cost_per_million_output_tokens"] == pytest.approx(8.0 / 12.96)
    assert get_metric("ttft_p99_ms").direction == "minimize" and get_metric("goodput_rps").workload == "serve"


def test_serving_trial_tags_and_plot(tmp_path: Path):
    from autotune.tracking.serving_plots import latency_vs_rate_plot
    from autotune.tracking.study_tracking import serving_tags

    rates = [
        {"rate": 2.0, "slo_met": True, "goodput_rps": 2.0, "ttft_p99_ms": 300.0, "tpot_p99_ms": 40.0},
        {"rate": 8.0, "slo_met": False, "goodput_rps": 3.0, "ttft_p99_ms": 4000.0, "tpot_p99_ms": 90.0},
        {"rate": 4.0, "slo_met": True, "goodput_rps": 3.9, "ttft_p99_ms": 800.0, "tpot_p99_ms": 60.0},
    ]
    tags = serving_tags({"rates": rates, "operating_rate": 4.0, "slo": {"ttft_p99_ms": 1000.0, "tpot_p99_ms": None}})
    assert tags["autotune.serving.rates_tried"] == "2:met 8:missed 4:met"
    assert tags["autotune.serving.operating_rate"] == "4" and tags["autotune.serving.slo"] == "ttft_p99_ms 1000"
    png = latency_vs_rate_plot(rates, {"ttft_p99_ms": 1000.0}, tmp_path / "plot.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert latency_vs_rate_plot([], {}, tmp_path / "none.png") is None


def test_a_simulated_serving_study_tracks_the_slo_rates_and_plot_and_exports_vllm(write_spec, tmp_path: Path):
    """The 910B serving spec on the simulator: the parent run carries the SLO and the traffic, each
    child its goodput, percentiles, the rates tried and a latency-vs-rate plot; the exports are the
    vLLM launch and never a training one."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from support import REPO, mlflow_runs

    text = (REPO / "search_spaces" / "llama2_7b_serve_8npu.yaml").read_text().replace("n_trials: 16", "n_trials: 3")
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(write_spec(text)), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    parents, children = mlflow_runs(run_dir, "llama2-7b-serve-8npu")
    params = parents[0].data.params
    assert params["slo.ttft_p99_ms"] == "2000.0" and params["slo.tpot_p99_ms"] == "80.0"
    assert params["traffic.rates"] == "2,4,8,12,16,24,32,48" and params["workload"] == "serve"
    assert len(children) == 3
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    for child in children:
        m, tags = child.data.metrics, child.data.tags
        assert m["goodput_rps_per_device"] > 0 and m["ttft_p99_ms"] > 0 and m["tpot_p99_ms"] > 0
        assert tags["autotune.serving.rates_tried"] and tags["autotune.source"] == "simulated"
        assert "ttft_p99_ms 2000" in tags["autotune.serving.slo"]
        names = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert "latency_vs_rate.png" in names
    exported = {p.name for p in (run_dir / "export").iterdir()}
    assert "serve_vllm.sh" in exported and not exported & {"launch_megatron.sh", "deepspeed_config.json"}
    refused = CliRunner().invoke(
        app, ["export", str(write_spec(text)), "--run-dir", str(run_dir), "--format", "megatron"]
    )
    assert refused.exit_code != 0 and "serv" in refused.output


def test_the_workers_records_come_back_in_the_result_and_land_beside_the_study(tmp_path: Path):
    """A probe's folder on a worker is removed after the trial: the records travel in the result
    and are written as trials/NNNN/requests.jsonl, and result.json then names that copy."""
    from autotune.study.records import save_trial_files
    from autotune.workers.protocol import ProbeResult, attach_requests_file

    probe_dir = tmp_path / "worker"
    probe_dir.mkdir()
    (probe_dir / "requests.jsonl").write_text('{"id": 0, "ttft_ms": 12.5}\n')
    result = ProbeResult(
        "ok", {"goodput_rps": 1.0}, info={"serving": {"requests_file": str(probe_dir / "requests.jsonl")}}
    )
    attach_requests_file(result)
    (probe_dir / "requests.jsonl").unlink()  # the worker's temporary folder is gone
    save_trial_files(tmp_path / "run", 3, result)
    folder = tmp_path / "run" / "trials" / "0003"
    assert (folder / "requests.jsonl").read_text() == '{"id": 0, "ttft_ms": 12.5}\n'
    saved = json.loads((folder / "result.json").read_text())["info"]["serving"]
    assert saved == {"requests_file": "requests.jsonl"}
