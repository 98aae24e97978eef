"""The ``autotune`` command line end to end: validate, plan, run, report, export, MLflow contents,
the command backend through Ray, and resuming after SIGKILL (issue #2's acceptance lines)."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import REPO, TINY_TRAIN, command_spec as _command_spec, mlflow_runs, probe_log as _probe_log

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def _run_json(spec: Path, run_dir: Path):
    """``autotune run SPEC --run-dir D --json``: the result (stderr inside) and its JSON payload."""
    result = _invoke("run", str(spec), "--run-dir", str(run_dir), "--json")
    assert result.exit_code == 0, result.output
    return result, json.loads(result.stdout)


def _mlflow_runs(run_dir: Path, experiment: str):
    return mlflow_runs(run_dir, experiment)


# ----------------------------------------------------------------------------------------- validate
def test_validate_ok_and_errors(write_spec):
    good = write_spec(TINY_TRAIN)
    result = _invoke("validate", str(good))
    assert result.exit_code == 0
    assert result.stdout.startswith("ok  tiny:")

    bad = write_spec(TINY_TRAIN.replace("pp: [1, 2]", "pp: [1, 2]\n  tensor_parallel: [2]"), "bad.yaml")
    result = _invoke("validate", str(bad))
    assert result.exit_code == 2
    assert "bad.yaml" in result.stderr and "space.tensor_parallel" in result.stderr


def test_missing_spec_file_is_exit_2(tmp_path):
    result = _invoke("validate", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "nope.yaml" in result.stderr


# --------------------------------------------------------------------------------------------- plan
def test_plan_json_counts_and_top(write_spec):
    result = _invoke("plan", str(write_spec(TINY_TRAIN)), "--json", "--top", "3")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["space_size"] == 2 * 2 * 3 * 3 * 2
    assert 0 < payload["fit"] <= payload["valid"] <= payload["space_size"]
    assert len(payload["top"]) == 3
    first = payload["top"][0]
    assert set(first) == {"params", "metrics", "undistinguished", "roomiest"}  # knobs priced alike, per layout
    assert first["params"]["dp"] * first["params"]["tp"] * first["params"]["pp"] == 2
    values = [t["metrics"]["tokens_per_s_per_device"] for t in payload["top"]]
    assert values == sorted(values, reverse=True)


def test_plan_table_shows_each_config_on_one_line(write_spec):
    result = _invoke("plan", str(write_spec(TINY_TRAIN)), "--top", "3")
    assert result.exit_code == 0
    assert "predicted top 3" in result.stdout
    assert result.stdout.count("tiny:") == 1  # the summary line names the study once
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith(("1 ", "2 ", "3 "))]
    assert len(rows) == 3 and all("tp=" in row and "mbs=" in row for row in rows)


# ------------------------------------------------------------------------------ run (simulator)
def test_run_simulated_report_export_and_mlflow(write_spec, tmp_path):
    spec = write_spec(
        TINY_TRAIN.replace(
            "search: {n_trials: 6, seed: 1}",
            "search: {n_trials: 6, seed: 1}\nbaseline: {tp: 2, pp: 1, micro_batch_size: 1, "
            "zero_stage: 0, recompute: full}",
        )
    )
    run_dir = tmp_path / "study"
    result, payload = _run_json(spec, run_dir)
    assert "backend: simulate" in result.stderr
    assert payload["source"] == "simulated" and payload["probes"] == 6
    assert payload["best"] and "vs baseline" in payload["improvement"]

    parents, children = _mlflow_runs(run_dir, "tiny")
    assert len(parents) == 1 and len(children) == 6
    assert {c.data.tags["autotune.source"] for c in children} == {"simulated"}
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    assert {"tp", "pp", "dp", "micro_batch_size", "grad_accum"} <= set(children[0].data.params)
    assert parents[0].info.status == "FINISHED"
    assert "vs baseline" in parents[0].data.tags["autotune.improvement"]

    report = _invoke("report", str(spec), "--run-dir", str(run_dir), "--json")
    assert report.exit_code == 0, report.output
    data = json.loads(report.stdout)
    probed = [t for t in data["trials"] if t["probed"]]
    assert len(probed) == 6
    # the before/after view: baseline vs best per metric with the gain, importances, memory breakdown
    summary = data["summary"]
    row = next(r for r in summary["before_after"] if r["metric"] == "tokens_per_s_per_device")
    assert row["gain_pct"] == pytest.approx((row["best"] - row["baseline"]) / row["baseline"] * 100)
    assert summary["best_trial"] == data["best"][0]["number"]
    mem = summary["memory"]
    assert sum(mem["predicted_gib"].values()) == pytest.approx(mem["predicted_peak_gib"], rel=1e-6)
    text = _invoke("report", str(run_dir)).stdout  # the run directory works in place of the spec
    assert "before/after" in text and "memory of the best config" in text
    assert (run_dir / "summary.md").exists()
    assert "gain_pct_tokens_per_s_per_device" in parents[0].data.metrics
    assert {"number", "state", "params", "metrics", "source", "failure"} <= set(data["trials"][0])
    assert data["best"][0]["number"] == payload["best"][0]["number"]
    assert sum(t["baseline"] for t in data["trials"]) == 1

    out = tmp_path / "exported"
    export = _invoke("export", str(spec), "--run-dir", str(run_dir), "--out", str(out))
    assert export.exit_code == 0, export.output
    import yaml

    best = yaml.safe_load((out / "best_config.yaml").read_text())
    assert best["params"]["tp"] == data["best"][0]["params"]["tp"]
    assert (run_dir / "ranking.csv").exists() and (run_dir / "results.csv").exists()


def test_rerun_of_a_finished_study_probes_nothing_more(write_spec, tmp_path):
    spec = write_spec(TINY_TRAIN)
    run_dir = tmp_path / "study"
    first = _invoke("run", str(spec), "--run-dir", str(run_dir))
    assert first.exit_code == 0 and "resuming the study" not in first.stderr
    result, payload = _run_json(spec, run_dir)
    assert payload["probes"] == 6
    said = " ".join(result.stderr.split())  # the rerun says it resumed, and what the study had spent
    assert f"resuming the study in {run_dir.resolve()}: 6 trial(s) so far, 6 of the budget's 6" in said, said
    parents, children = _mlflow_runs(run_dir, "tiny")
    assert len(parents) == 1 and len(children) == 6


def test_report_without_a_study_is_exit_2(write_spec, tmp_path):
    result = _invoke("report", str(write_spec(TINY_TRAIN)), "--run-dir", str(tmp_path / "empty"))
    assert result.exit_code == 2
    assert "no study" in result.stderr


# -------------------------------------------------------------------------- run (command + Ray)
def test_command_backend_through_ray_in_parallel_with_oom(write_spec, tmp_path):
    spec = _command_spec(write_spec, tmp_path, n_trials=8, parallel=2, ray="ray: {num_cpus: 2}")
    run_dir = tmp_path / "study"
    result, _ = _run_json(spec, run_dir)
    assert "backend: command" in result.stderr

    events = _probe_log(tmp_path)
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 8  # the script ran once per trial
    keys = [json.dumps(e["params"], sort_keys=True) for e in starts]
    assert len(set(keys)) == 8
    # at most parallel_trials at once, and the two slots were really used together
    timeline = sorted(
        [(e["t"], 1) for e in events if e["event"] == "start"] + [(e["t"], -1) for e in events if e["event"] == "end"]
    )
    running = peak = 0
    for _, delta in timeline:
        running += delta
        peak = max(peak, running)
    assert peak == 2

    report = json.loads(_invoke("report", str(spec), "--run-dir", str(run_dir), "--json").stdout)
    probed = [t for t in report["trials"] if t["probed"]]
    assert len(probed) == 8 and all(t["source"] == "measured" for t in probed)
    for t in probed:
        p = t["params"]
        if p["micro_batch_size"] == 4 and p["recompute"] == "none":
            assert t["status"] == "oom" and "out of memory" in t["failure"]
        else:
            assert t["status"] == "ok"
            expected = 1000.0 * p["micro_batch_size"] / (1.3 if p["recompute"] == "full" else 1.0) / p["tp"]
            assert t["metrics"]["tokens_per_s_per_device"] == pytest.approx(expected)
    ok = [t for t in probed if t["status"] == "ok"]
    assert report["best"][0]["metrics"]["tokens_per_s_per_device"] == max(
        t["metrics"]["tokens_per_s_per_device"] for t in ok
    )

    # an OOM is an infeasible config for the sampler, not a silently ignored failure
    from autotune.study.storage import open_study
    from autotune.spec.load import load_spec

    study = open_study(load_spec(spec), run_dir, create=False)
    for t in study.trials:
        if t.user_attrs.get("autotune.status") == "oom":
            assert t.state.name == "COMPLETE" and t.constraints and all(v > 0 for v in t.constraints.values())


# -------------------------------------------------------------------------------- SIGKILL resume
def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        env=env,
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


@pytest.mark.parametrize(
    "ray, sig",
    [
        ("ray: {num_cpus: 2}", signal.SIGTERM),
        # CI time: without Ray the same save-and-resume path; the opt-in step
        pytest.param("ray: {enabled: false}", signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param(  # SIGINT through Ray: the same save-and-resume path as SIGTERM; the opt-in step
            "ray: {num_cpus: 2}", signal.SIGINT, marks=pytest.mark.slow
        ),
    ],
    ids=["term-ray", "term-subprocess", "int-ray"],
)
def test_sigterm_saves_the_study_exits_143_and_resumes(write_spec, tmp_path, ray, sig):
    """SIGTERM (a scheduler's stop) behaves like Ctrl-C (SIGINT): the study is saved, the MLflow
    parent is closed, exit 143 (130), and the same command completes the budget (Ray used to
    abort on SIGTERM: exit 134)."""
    spec = _command_spec(write_spec, tmp_path, n_trials=6, parallel=2, ray=ray, sleep=0.6)
    run_dir = tmp_path / "study"
    first = _cli("run", str(spec), "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len([e for e in _probe_log(tmp_path) if e["event"] == "end"]) < 2:
            time.sleep(0.05)
        first.send_signal(sig)
        _, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == (143 if sig == signal.SIGTERM else 130), stderr.decode()[-2000:]
    assert ("SIGTERM" if sig == signal.SIGTERM else "interrupted") in stderr.decode() and "resume" in stderr.decode()
    parents, _ = _mlflow_runs(run_dir, "tiny")
    assert parents and parents[0].info.status == "KILLED"

    second = _cli("run", str(spec), "--run-dir", str(run_dir), "--json")
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr.decode()[-2000:]
    report = json.loads(_invoke("report", str(spec), "--run-dir", str(run_dir), "--json").stdout)
    finished = [t for t in report["trials"] if t["probed"] and t["status"] in ("ok", "oom")]
    assert len(finished) == 6 and len({json.dumps(t["params"], sort_keys=True) for t in finished}) == 6


def test_sigkill_mid_study_then_rerun_completes_the_budget(write_spec, tmp_path):
    spec = _command_spec(write_spec, tmp_path, n_trials=8, parallel=2, ray="ray: {enabled: false}", sleep=0.6)
    run_dir = tmp_path / "study"
    first = _cli("run", str(spec), "--run-dir", str(run_dir))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once some trials finished and others run
            ends = [e for e in _probe_log(tmp_path) if e["event"] == "end"]
            if len(ends) >= 3:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the first run finished no trial in 60 s: " + first.stderr.read1().decode())
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
    time.sleep(0.5)  # the probes' watchdog kills the orphaned probe groups

    second = _cli("run", str(spec), "--run-dir", str(run_dir), "--json")
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr.decode()
    assert "resuming" in stderr.decode() or "re-queued" in stderr.decode()

    report = json.loads(_invoke("report", str(spec), "--run-dir", str(run_dir), "--json").stdout)
    finished = [t for t in report["trials"] if t["probed"] and t["status"] in ("ok", "oom")]
    statuses = [(t["number"], t["status"], t["probed"], t["failure"]) for t in report["trials"]]
    assert len(finished) == 8, "\n".join(map(str, statuses))  # the budget is complete (every trial shown)
    keys = [json.dumps(t["params"], sort_keys=True) for t in finished]
    assert len(set(keys)) == 8  # no config measured twice
    interrupted = [t for t in report["trials"] if t["status"] == "interrupted" and t["probed"]]
    # every interrupted probe's config was measured by the second run: no trial lost
    for t in interrupted:
        assert json.dumps(t["params"], sort_keys=True) in keys
    events = _probe_log(tmp_path)
    params_of = {e["pid"]: json.dumps(e["params"], sort_keys=True) for e in events if e["event"] == "start"}
    completed = [params_of[e["pid"]] for e in events if e["event"] == "end"]
    # a config whose result was recorded is never run again; only an interrupted trial's config
    # is (its probe may even have finished, unrecorded, in the instant before the kill)
    rerun = {json.dumps(t["params"], sort_keys=True) for t in interrupted}
    for key in set(completed) - rerun:
        assert completed.count(key) == 1

    parents, children = _mlflow_runs(run_dir, "tiny")
    assert len(parents) == 1
    logged = sorted(int(c.data.tags["autotune.trial"]) for c in children)
    assert len(logged) == len(set(logged))  # each trial logged once
    # MLflow holds exactly the probed trials (the interrupted ones measured nothing)
    assert set(logged) == {t["number"] for t in report["trials"] if t["probed"] and t["status"] != "interrupted"}
    assert all(c.info.status in ("FINISHED", "FAILED") for c in children)


def test_several_objectives_give_a_pareto_front(write_spec, tmp_path):
    spec = write_spec(
        TINY_TRAIN.replace(
            "objectives: [tokens_per_s_per_device]",
            "objectives:\n  - {metric: tokens_per_s_per_device}\n  - {metric: peak_memory_gib, direction: minimize}",
        )
    )
    run_dir = tmp_path / "study"
    best = _run_json(spec, run_dir)[1]["best"]
    assert best  # the Pareto front: no member is dominated by another
    for a in best:
        for b in best:
            better_or_equal = (
                b["metrics"]["tokens_per_s_per_device"] >= a["metrics"]["tokens_per_s_per_device"]
                and b["metrics"]["peak_memory_gib"] <= a["metrics"]["peak_memory_gib"]
            )
            strictly = (
                b["metrics"]["tokens_per_s_per_device"] > a["metrics"]["tokens_per_s_per_device"]
                or b["metrics"]["peak_memory_gib"] < a["metrics"]["peak_memory_gib"]
            )
            assert not (better_or_equal and strictly)
    assert (run_dir / "plots" / "pareto_front.html").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {p["trial"] for p in summary["pareto_front"]} == {b["number"] for b in best}


def test_shipped_command_backend_example_runs_from_anywhere(tmp_path, monkeypatch):
    """examples/command_backend: the launcher is found relative to the spec, not the cwd."""
    monkeypatch.chdir(tmp_path)
    result, payload = _run_json(REPO / "examples" / "command_backend" / "spec.yaml", tmp_path / "study")
    assert payload["source"] == "measured" and payload["probes"] == 8
    report = json.loads(
        _invoke(
            "report",
            str(REPO / "examples" / "command_backend" / "spec.yaml"),
            "--run-dir",
            str(tmp_path / "study"),
            "--json",
        ).stdout
    )
    statuses = {t["status"] for t in report["trials"] if t["probed"]}
    assert statuses <= {"ok", "oom", "pruned"} and "ok" in statuses  # pruned: a config 1.5x slower than the best


@pytest.mark.slow
def test_real_torch_study_on_two_cpu_processes(tmp_path):
    """`autotune run` with the torch backend: real probes (2 gloo processes each) recorded in
    MLflow as measured, with predicted next to measured (issue #4's end-to-end line)."""
    pytest.importorskip("torch")
    import yaml

    data = yaml.safe_load((REPO / "search_spaces" / "tiny_llama_cpu.yaml").read_text())
    data["workload"].update({"seq_len": 64, "warmup_steps": 1, "measured_steps": 2})
    data["space"] = {"tp": [1, 2], "micro_batch_size": [1, 2], "precision": ["fp32"]}
    data["search"].update({"n_trials": 3, "sampler": "auto"})
    data.pop("baseline")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "study"
    result, payload = _run_json(spec, run_dir)
    assert payload["source"] == "measured" and payload["probes"] == 3 and payload["failed"] == 0
    report = json.loads(_invoke("report", str(spec), "--run-dir", str(run_dir), "--json").stdout)
    probed = [t for t in report["trials"] if t["probed"]]
    assert len(probed) == 3
    for t in probed:
        assert t["status"] == "ok" and t["source"] == "measured"
        assert t["metrics"]["tokens_per_s_per_device"] > 0 and t["metrics"]["loss_finite"] == 1
        assert t["predicted"]["tokens_per_s_per_device"] > 0
    _, children = _mlflow_runs(run_dir, data["name"])
    assert len(children) == 3 and {c.data.tags["autotune.source"] for c in children} == {"measured"}
    assert all("prediction_error_pct" in c.data.metrics for c in children)
    assert "refit after trial" in result.stderr


@pytest.mark.parametrize("name", ["llama2_7b_8npu.yaml", "llama2_7b_infer_8npu.yaml"])
def test_plan_breaks_ties_toward_memory_headroom(name):
    """Configs the model prices the same (an env var, a KV-cache dtype) are ranked safer first;
    each printed config names every setting, so no two lines read the same."""
    spec = REPO / "search_spaces" / name
    payload = json.loads(_invoke("plan", str(spec), "--json", "--top", "30").stdout)
    first = payload["objectives"][0]["metric"]
    top = payload["top"]
    for a, b in zip(top, top[1:]):
        if a["metrics"][first] == b["metrics"][first]:
            assert a["metrics"]["memory_headroom_gib"] >= b["metrics"]["memory_headroom_gib"]
    table = _invoke("plan", str(spec), "--top", "10").stdout
    # a training config starts "tp=", an inference one with its instances ("8 x tp1")
    found = (re.search(r"tp=|\d+ x tp", line) for line in table.splitlines() if line[:5].strip().isdigit())
    rows = [m.string[m.start() :] for m in found if m]
    assert len(rows) == 10 and len(set(rows)) == 10


# A launcher whose tp=2 configs are 10x slower per step; it logs when it finishes all its steps.
# Their 200 steps last 10 s, so the pruner stops them first even on a loaded 2-core machine (with
# 25 steps, 1.25 s, a Ray study under the full test suite's load once finished one unpruned).
SLOW_TP2_PROBE = r"""
import json, os, sys, time
p = json.load(open(sys.argv[sys.argv.index("--trial") + 1]))["params"]
step_time = 1.0 if p["tp"] == 2 else 0.1
steps = 200 if p["tp"] == 2 else 3
for i in range(steps):
    time.sleep(0.05)
    print(json.dumps({"event": "step", "step": i, "phase": "measure", "step_time_s": step_time}), flush=True)
with open(os.environ["PROBE_LOG"], "a") as f:
    f.write(json.dumps({"event": "end", "params": p}) + "\n")
print(json.dumps({"metrics": {"step_time_s": step_time, "tokens_per_s_per_device": 100.0 / step_time}}))
"""


@pytest.mark.parametrize(
    "ray",
    [
        pytest.param("ray: {num_cpus: 2}", marks=pytest.mark.slow),  # ~35 s: the same pruning through Ray
        "ray: {enabled: false}",
    ],
)
def test_losing_probes_are_stopped_early(write_spec, tmp_path, ray):
    script = tmp_path / "probe.py"
    script.write_text(SLOW_TP2_PROBE)
    text = TINY_TRAIN.replace(
        "backend: simulate",
        f"""backend:
  kind: command
  argv: [{sys.executable}, {script}, --trial, "{{trial_file}}"]
  resources: {{num_cpus: 1}}
  env: {{PROBE_LOG: "{tmp_path / "probe_log.jsonl"}"}}""",
    ).replace(
        "search: {n_trials: 6, seed: 1}",
        f"search: {{n_trials: 4, seed: 1, sampler: random}}\n{ray}\n"
        "baseline: {tp: 1, pp: 1, micro_batch_size: 1, zero_stage: 0, recompute: none}",
    )
    text = text.replace("  tp: [1, 2]\n  pp: [1, 2]\n", "  tp: [1, 2]\n  pp: [1]\n")
    spec = write_spec(text, "prune.yaml")
    run_dir = tmp_path / "study"
    result, _ = _run_json(spec, run_dir)
    report = json.loads(_invoke("report", str(spec), "--run-dir", str(run_dir), "--json").stdout)
    probed = [t for t in report["trials"] if t["probed"]]
    slow = [t for t in probed if t["params"]["tp"] == 2]
    assert slow, "the random sampler proposed no tp=2 config"
    for t in slow:
        assert t["status"] == "pruned" and t["state"] == "PRUNED"
        assert "stopped early" in t["failure"] and "10.00x the best's" in t["failure"]
        assert t["metrics"]["step_time_s"] == pytest.approx(1.0)  # the partial measurement is kept
    finished = [e["params"]["tp"] for e in _probe_log(tmp_path)]
    assert 2 not in finished  # no tp=2 probe ran its 200 steps
    assert all(t["status"] == "ok" for t in probed if t["params"]["tp"] == 1)
    assert "pruned stopped early" in result.stderr


def test_reuse_cache_answers_configs_measured_by_an_earlier_study(write_spec, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "cache.sqlite"))
    spec = _command_spec(write_spec, tmp_path, n_trials=6, parallel=1, ray="ray: {enabled: false}", sleep=0.0)

    def starts() -> int:
        return len([e for e in _probe_log(tmp_path) if e["event"] == "start"])

    _run_json(spec, tmp_path / "first")
    # six, or one more where an OOM ended early enough to give back what it did not run (a busy machine's
    # walls: the budget counts an OOM's wall against a full probe's)
    first_runs = starts()
    assert first_runs in (6, 7)

    # a second study of the same spec elsewhere: without --reuse-cache it probes again ...
    _run_json(spec, tmp_path / "second")
    second_runs = starts()
    assert second_runs - first_runs >= 6
    # ... with it, every config measured before is answered from the cache, with its origin
    result = _invoke("run", str(spec), "--run-dir", str(tmp_path / "third"), "--json", "--reuse-cache")
    assert result.exit_code == 0, result.output
    assert starts() == second_runs  # no new probe
    report = json.loads(_invoke("report", str(spec), "--run-dir", str(tmp_path / "third"), "--json").stdout)
    probed = [t for t in report["trials"] if t["probed"]]
    assert len(probed) == 6
    assert all("answered from the result cache" in t["chosen_because"] for t in probed)
    assert {t["status"] for t in probed} <= {"ok", "oom"}


def test_result_cache_keeps_only_outcomes_that_repeat(tmp_path):
    from autotune.study.cache import ResultCache, cache_key
    from autotune.workers.protocol import ProbeResult

    cache = ResultCache(tmp_path / "c.sqlite")
    model, work, cluster, backend = {"arch": "llama"}, {"seq_len": 8}, {"accelerator": "cpu"}, {"kind": "command"}
    key = cache_key("tp=1", model, work, cluster, backend)
    assert cache_key("tp=2", model, work, cluster, backend) != key
    assert cache_key("tp=1", model, {"seq_len": 16}, cluster, backend) != key
    assert (
        cache_key("tp=1", model, {"seq_len": 8, "timeout_s": 5}, cluster, backend) == key
    )  # a deadline is not the config
    for status in ("timeout", "crash", "pruned"):
        assert not cache.put(key, ProbeResult(status), "s", 0)
    assert not cache.put(key, ProbeResult("ok", metrics={"x": 1.0}, source="simulated"), "s", 0)
    assert cache.get(key) is None
    assert cache.put(key, ProbeResult("ok", metrics={"x": 1.0}), "study-a", 7)
    result, origin = cache.get(key)
    assert result.metrics == {"x": 1.0} and origin["study"] == "study-a" and origin["trial"] == 7
    assert len(cache) == 1
