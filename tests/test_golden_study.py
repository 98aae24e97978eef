"""The study loop's behaviour, pinned (issue #32): a seeded simulated study of the shipped
``llama2_7b_8npu.yaml``, a seeded ``command``-backend study and a seeded profiled training study
(``search.memory_profiles`` through the command backend: memory profiles before full probes, issue
#35) produce the same trials, statuses, metrics and MLflow content (params, metrics, tags, artifact
names) as the golden record in ``tests/fixtures/golden_study/``, taken before the trial lifecycle
was restructured (issue #43). A seeded serving study (``workload: {kind: serve}``, the real serving
probe against the fake engine) is pinned too, without its timed figures (its test says what is kept).

What varies from run to run is left out of the record: times, durations, run ids, paths, host
and software names. Floats are rounded to 6 significant digits (the simulator's arithmetic is
deterministic; the command probe's figures are computed from the config).

A deliberate behaviour change regenerates the record: ``AUTOTUNE_REGOLD=1 pytest tests/test_golden_study.py``,
and the diff of the fixture is reviewed with the change.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import REPO, command_spec, fake_vllm

GOLDEN = Path(__file__).parent / "fixtures" / "golden_study"

# tags and params whose values are times, ids, paths, hosts or versions
_VOLATILE = re.compile(
    r"^mlflow\.(user|source\.|runName|parentRunId|log-model|note\.content)|"
    r"resumed|_s$|seconds|wall|time|duration|software|host|path|uri|run_id|calibrated|written"
)


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def _stable(items: dict[str, Any]) -> dict[str, Any]:
    return {k: _round(v) for k, v in sorted(items.items()) if not _VOLATILE.search(k)}


def _artifacts(client: Any, run_id: str, path: str = "") -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path or None):
        out += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return sorted(out)


def study_record(run_dir: Path, experiment: str, metrics: Callable[[dict[str, Any]], Any] = _stable) -> dict[str, Any]:
    """Trials as ``autotune report --json`` gives them, and the study's MLflow runs; ``metrics``
    gives what is kept of a trial's or run's metrics (default: their stable values)."""
    from mlflow.tracking import MlflowClient

    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    trials = [
        {
            "number": t["number"],
            "status": t["status"],
            "params": t["params"],
            "probed": t["probed"],
            "baseline": t["baseline"],
            "source": t["source"],
            "metrics": metrics(t["metrics"]),
            "failure": re.sub(r"/\S+", "PATH", t.get("failure") or ""),
        }
        for t in report["trials"]
    ]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted(
        (r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.data.tags.get("autotune.trial", "")
    )
    mlflow_runs = [
        {
            "name": r.data.tags.get("mlflow.runName", "")
            if not r.data.tags.get("autotune.trial")
            else f"trial {r.data.tags['autotune.trial']}",
            "status": r.info.status,
            "params": _stable(r.data.params),
            "metrics": metrics(r.data.metrics),
            "tags": _stable(r.data.tags),
            "artifacts": _artifacts(client, r.info.run_id),
        }
        for r in [*parents, *children]
    ]
    return {"trials": trials, "mlflow": mlflow_runs}


def _compare(name: str, record: dict[str, Any]) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if os.environ.get("AUTOTUNE_REGOLD") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        pytest.skip(f"golden record {path.name} rewritten")
    golden = json.loads(path.read_text())
    assert record["trials"] == golden["trials"]
    assert len(record["mlflow"]) == len(golden["mlflow"])
    for got, want in zip(record["mlflow"], golden["mlflow"]):
        assert got == want, got["name"]


@pytest.mark.timeout(600)
def test_a_seeded_simulated_study_of_the_shipped_spec_is_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    spec = REPO / "search_spaces" / "llama2_7b_8npu.yaml"
    result = CliRunner().invoke(
        app, ["run", str(spec), "--run-dir", str(run_dir), "--n-trials", "12", "--seed", "7", "--json"]
    )
    assert result.exit_code == 0, result.output
    _compare("llama2_7b_8npu_simulated", study_record(run_dir, "llama2-7b-8npu"))


@pytest.mark.timeout(600)
def test_a_seeded_command_backend_study_is_unchanged(write_spec, tmp_path):
    spec = command_spec(write_spec, tmp_path, n_trials=6, parallel=1, ray="ray: {enabled: false}", sleep=0.0)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    _compare("command_backend", study_record(run_dir, "tiny"))


# A launcher that honours ``--num-layers`` (a memory profile runs it with fewer layers): its peak
# grows with the layers per stage and the activations kept; above 1.7 GiB it runs out of memory.
PROFILED_PROBE = r"""
import json, sys
trial = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))
layers = int(sys.argv[sys.argv.index("--num-layers") + 1])
p = trial["params"]
per_stage = layers / p["pp"]
kept = p["micro_batch_size"] * (0.25 if p["recompute"] == "full" else 1.0)
peak = 0.30 + per_stage * 0.05 * kept / p["tp"] + 0.02 * per_stage
if peak > 1.7:
    print(f"RuntimeError: CUDA out of memory. Tried to allocate {peak - 1.7:.2f} GiB", flush=True)
    sys.exit(1)
tps = 1000.0 * p["micro_batch_size"] / (1.3 if p["recompute"] == "full" else 1.0) / p["tp"] / (0.9 + 0.1 * p["pp"])
print(json.dumps({"event": "step", "step": 0, "step_time_s": 0.1}))
print(json.dumps({"metrics": {"tokens_per_s_per_device": tps, "step_time_s": 1.0, "peak_memory_gib": peak}}))
"""


@pytest.mark.timeout(600)
def test_a_seeded_profiled_training_study_is_unchanged(write_spec, tmp_path, monkeypatch):
    """Configs the guide is not sure fit run a memory profile first: one whose profile says it fits
    is probed in full, one whose profile says it does not ends as ``oom_predicted``. A profile's
    cost counts against the budget by its wall time over a full probe's, so the walls are made a
    function of the layers run (what a real probe's roughly are) to keep the study the same."""
    import autotune.workers.command as command

    run_probe_process = command.run_probe_process

    def layered_wall(argv, *args, **kwargs):
        result = run_probe_process(argv, *args, **kwargs)
        result.wall_s = 1.0 + 0.25 * int(argv[argv.index("--num-layers") + 1])
        return result

    monkeypatch.setattr(command, "run_probe_process", layered_wall)
    probe = tmp_path / "probe.py"
    probe.write_text(PROFILED_PROBE)
    spec = write_spec(
        f"""
name: tiny-profiled
model:
  {{name: tiny-llama-16, hidden_size: 512, num_hidden_layers: 16, num_attention_heads: 8,
   num_key_value_heads: 4, intermediate_size: 1376, vocab_size: 2048, max_position_embeddings: 1024}}
workload: {{kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}}
cluster: {{accelerator: cpu, nodes: 1, devices_per_node: 2, overrides: {{device_memory_gib: 1.7}}}}
backend:
  kind: command
  argv: [{sys.executable}, {probe}, --num-layers, "{{num_layers}}", --trial, "{{trial_file}}"]
  timeout_s: 60
  resources: {{num_cpus: 1}}
space:
  tp: [1, 2]
  pp: [1, 2]
  micro_batch_size: [1, 4]
  recompute: [none, full]
  precision: [fp32]
objectives: [tokens_per_s_per_device]
search: {{n_trials: 5, seed: 1, memory_profiles: true, prune: false}}
ray: {{enabled: false}}
""",
        "profiled.yaml",
    )
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    record = study_record(run_dir, "tiny-profiled")
    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    for trial, reported in zip(record["trials"], report["trials"]):  # what each profile measured and decided
        trial["memory_profile"] = _stable(reported.get("memory_profile") or {})
        trial["chosen_because"] = reported.get("chosen_because")
    verdicts = {t["memory_profile"].get("verdict") for t in record["trials"]}
    assert {"probe", "oom_predicted"} <= verdicts, verdicts  # a profile that let the probe run, one that did not
    _compare("profiled_training", record)


# MLflow params and tags whose values follow from the timed metrics: which trial measured best
_MEASURED = re.compile(r"^best\.|^autotune\.(best|recommended)_trial$")


def _untimed(items: dict[str, Any]) -> dict[str, Any]:
    return {k: "MEASURED" if _MEASURED.search(k) else v for k, v in items.items()}


@pytest.mark.timeout(600)
def test_a_seeded_serving_study_on_the_fake_engine_is_unchanged(write_spec, tmp_path):
    """A serving study (``workload: {kind: serve}``, ``backend: {kind: vllm}``) through the real
    serving probe (``autotune.workers.serve_probe``: the engine started per trial, ``/health``, the
    warm-up, the closed-loop batch sweep, the open-loop load at each rate, ``/metrics``, the engine
    stopped) against the fake engine in vLLM's place.

    Its figures are timed (goodput, TTFT, TPOT... differ from run to run), so the record keeps what
    does not depend on the clock: the trials in order with their params, statuses, sources, failures
    and why each was chosen, the NAMES of the metrics each trial reports (not their values), and the
    MLflow runs' statuses, metric names, params, tags and artifact names, with the values of the
    params and tags that follow from the measured figures (``best.*``, ``autotune.best_trial``,
    ``autotune.recommended_trial``: which trial measured best) replaced by ``MEASURED`` so that
    their keys are still pinned.

    The proposals must not depend on the timings: the sampler is Optuna's seeded ``random``, which
    proposes without reading what was measured (the ``auto`` guide would react to the measured
    goodput), with ``stop_early: false`` (the whole budget is spent) and ``prune: false``. The SLO
    verdicts (each trial's rates tried by the bisection and its operating rate, in the trial runs'
    ``autotune.serving.*`` tags) are pinned too: the SLO (p99 TTFT 20 s, TPOT 5 s) is far above what
    the fake engine takes (5 ms to the first token, 1 ms a token), so every rate of the ladder meets
    it however loaded the machine is, as every request must come back within the probe's 30 s grace
    for the trial to be ``ok`` at all."""
    fake = fake_vllm(tmp_path)  # vLLM's place taken by the fake engine (tests/support.py)
    spec = write_spec(
        f"""
name: tiny-serve-fake
model: tiny-llama
workload:
  kind: serve
  traffic: {{rates: [2, 4], arrival: poisson, prompt_len: 16, output_len: 4, duration_s: 1, warmup_requests: 1,
            seed: 3}}
  slo: {{ttft_p99_ms: 20000, tpot_p99_ms: 5000}}
  batch_sweep: [1, 2]
  startup_timeout_s: 30
  timeout_s: 60
cluster: {{accelerator: cpu, profile: cpu, nodes: 1, devices_per_node: 1}}
target: vllm
backend: {{kind: vllm, python: {sys.executable}, entry: {fake}}}
space:
  max_num_seqs: [1, 2, 8, 32]
  enable_chunked_prefill: [true, false]
  graph_mode: [eager]
objectives: [goodput_rps_per_device]
search: {{n_trials: 3, sampler: random, seed: 5, stop_early: false, prune: false}}
ray: {{enabled: false}}
""",
        "serve.yaml",
    )
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    record = study_record(run_dir, "tiny-serve-fake", metrics=sorted)  # the metrics' names, not their values
    for run in record["mlflow"]:
        run["params"], run["tags"] = _untimed(run["params"]), _untimed(run["tags"])
    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    for trial, reported in zip(record["trials"], report["trials"]):
        trial["chosen_because"] = reported.get("chosen_because")
    _compare("serving_fake_engine", record)
