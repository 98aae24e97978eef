"""How a command fails, for a person and for a script: ``--json`` gives one object on stdout even when
the command fails (its exit code and the lines it said on stderr), an option's bad value is said as
the option, and an input that cannot be used is refused before any slow work (a host calibration)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import REPO

SPEC = REPO / "search_spaces" / "llama2_7b_8npu.yaml"


def _invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _failure(result, code: int) -> dict:
    """The ``--json`` failure object: the only thing on stdout, its exit code the process's."""
    assert result.exit_code == code, result.output
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["exit_code"] == code
    return payload


def test_a_failing_command_given_json_writes_one_object_saying_why(write_spec, tmp_path):
    bad = write_spec(SPEC.read_text().replace("n_trials: 20", "n_trials: 0"), "bad.yaml")
    payload = _failure(_invoke("plan", bad, "--json"), 2)
    assert any("bad.yaml" in e and "search.n_trials" in e for e in payload["errors"]), payload
    payload = _failure(_invoke("report", tmp_path / "nowhere", "--json"), 2)
    assert any("nowhere" in e for e in payload["errors"]), payload
    # an option error stops the parse before any value is read: click's message is kept
    payload = _failure(_invoke("plan", SPEC, "--json", "--no-such-option"), 2)
    assert any("--no-such-option" in e for e in payload["errors"]), payload
    # validate keeps its own object (no second one), and without --json stdout stays empty
    result = _invoke("validate", bad, "--json")
    assert result.exit_code == 2 and set(json.loads(result.stdout)) == {"ok", "errors"}
    result = _invoke("plan", bad)
    assert result.exit_code == 2 and result.stdout == ""


def test_a_run_given_json_that_fails_on_an_option_says_so_on_stdout(tmp_path):
    payload = _failure(_invoke("run", SPEC, "--run-dir", tmp_path / "run", "--n-trials", "0", "--json"), 2)
    assert payload["errors"] == ["--n-trials: Input should be greater than 0 (got 0)"]


@pytest.mark.parametrize(
    "option,value,words",
    [
        ("--n-trials", "0", "--n-trials: Input should be greater than 0 (got 0)"),
        ("--parallel", "0", "--parallel: Input should be greater than 0 (got 0)"),
        ("--seed", "-1", "--seed: Input should be greater than or equal to 0 (got -1)"),
    ],
)
def test_a_bad_option_value_is_said_as_the_option(tmp_path, option, value, words):
    result = _invoke("run", SPEC, "--run-dir", tmp_path / "run", option, value, "--no-tracking")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and words in said, result.output
    assert "pydantic" not in said and "\\n" not in said  # no library's error dump


def test_an_option_the_spec_refuses_with_its_own_field_names_both(write_spec, tmp_path):
    spec = write_spec(SPEC.read_text().replace("n_trials: 20", "n_trials: 20\n  confirm_budget: 8"), "cb.yaml")
    result = _invoke("run", spec, "--run-dir", tmp_path / "run", "--n-trials", "4", "--no-tracking")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2, result.output
    assert "cb.yaml: search.confirm_budget with --n-trials 4: 8 re-measurements is above the budget" in said


@pytest.mark.parametrize("command", ["plan", "report"])
@pytest.mark.parametrize("top", ["0", "-2"])
def test_top_below_one_is_an_option_error_not_a_crash(command, top):
    result = _invoke(command, SPEC, "--top", top)
    assert result.exit_code == 2, result.output
    assert "--top" in " ".join(result.output.split())


def test_a_serving_refit_with_no_readings_is_refused_before_the_host_is_calibrated(monkeypatch, tmp_path):
    import autotune.cli.assembly as assembly

    def calibrates(*args, **kwargs):
        raise AssertionError("the host was calibrated before the readings were read")

    monkeypatch.setattr(assembly, "measured_profile", calibrates)
    spec = REPO / "search_spaces" / "tiny_llama_serve_cpu.yaml"
    result = _invoke("calibrate", "--serving", spec, "--readings", tmp_path / "nope", "--out", tmp_path / "p.yaml")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "cannot read the calibration readings" in said, result.output


@pytest.mark.parametrize("text,words", [("", "got an empty file"), ("- tp\n- pp\n", "got list ['tp', 'pp']")])
def test_a_spec_that_is_not_a_mapping_says_what_it_is(write_spec, text, words):
    result = _invoke("validate", write_spec(text, "odd.yaml"))
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "odd.yaml: expected a mapping of sections at the top level" in said
    assert words in said


def test_a_ray_address_the_simulator_does_not_use_is_said(write_spec, tmp_path):
    data = yaml.safe_load(SPEC.read_text())
    data["search"]["n_trials"] = 2
    spec = write_spec(yaml.safe_dump(data), "small.yaml")
    result = _invoke(
        "run",
        spec,
        "--backend",
        "simulate",
        "--ray-address",
        "10.0.0.1:6379",
        "--run-dir",
        tmp_path / "run",
        "--no-tracking",
    )
    assert result.exit_code == 0, result.output
    assert "--ray-address 10.0.0.1:6379 is not used: the simulator runs in this process" in result.stderr


@pytest.mark.parametrize("signal_name,code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_a_command_interrupted_ends_as_documented(monkeypatch, signal_name, code):
    """typer makes any KeyboardInterrupt in a command exit 130; SIGTERM (a scheduler's stop) is 143."""
    import autotune.cli.commands as commands
    from autotune.cli.exit_status import Terminated

    def stopped(*args, **kwargs):
        raise Terminated() if signal_name == "SIGTERM" else KeyboardInterrupt()

    monkeypatch.setattr(commands, "_load", stopped)
    result = _invoke("plan", SPEC, "--json")
    payload = _failure(result, code)
    assert payload["warnings"] == ["terminated (SIGTERM)" if code == 143 else "interrupted"]


def test_json_is_the_parsed_flag_not_a_word_on_the_line(tmp_path):
    """``--json`` as another option's value, or after ``--``, is no request for JSON."""
    result = _invoke("report", tmp_path / "nowhere", "--run-dir", "--json")
    assert result.exit_code == 2 and result.stdout == "", result.output
    result = _invoke("plna", SPEC, "--json")  # a mistyped command: click's message kept
    assert any("plna" in e for e in _failure(result, 2)["errors"])


def test_plan_given_json_with_nothing_predicted_to_fit_exits_1_with_its_object(write_spec):
    text = SPEC.read_text().replace("  # overrides: {device_memory_gib: 32}", "  overrides: {device_memory_gib: 4}")
    result = _invoke("plan", write_spec(text, "tiny_memory.yaml"), "--json")
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["fit"] == 0  # its own object, not a second one


def test_an_export_of_a_trial_that_did_not_run_is_refused(tmp_path):
    """``export --trial N`` of an out-of-memory or rule-rejected trial wrote its launch files with
    nothing to say it failed; an export launches a config that ran."""
    run = tmp_path / "run"
    spec = REPO / "search_spaces" / "llama3_70b_32npu.yaml"
    assert _invoke("run", spec, "--run-dir", run, "--no-tracking").exit_code == 0
    trials = json.loads(_invoke("report", run, "--json").stdout)["trials"]
    failed = next(t for t in trials if t["status"] == "oom")
    ok = next(t for t in trials if t["status"] == "ok")
    result = _invoke("export", run, "--trial", failed["number"], "--out", tmp_path / "failed")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"--trial {failed['number']} did not run to a result (oom" in said, result.output
    assert not (tmp_path / "failed").exists()
    assert _invoke("export", run, "--trial", ok["number"], "--out", tmp_path / "ok").exit_code == 0


def test_a_simulated_trial_logs_no_prediction_error_of_the_model_against_itself(tmp_path):
    """Its figures are the model's: an error of 0 % beside them would read as the model checked."""
    import mlflow

    data = yaml.safe_load(SPEC.read_text())
    data["search"]["n_trials"] = 3
    run = tmp_path / "run"
    spec = tmp_path / "small.yaml"
    spec.write_text(yaml.safe_dump(data))
    assert _invoke("run", spec, "--run-dir", run).exit_code == 0
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 3
    for child in children:
        assert child.data.tags["autotune.source"] == "simulated" and "tokens_per_s_per_device" in child.data.metrics
        assert not any(k.startswith("predicted_") or "prediction_error" in k for k in child.data.metrics)


def test_a_simulated_study_whose_best_is_the_baseline_shows_its_memory_breakdown(tmp_path):
    """The baseline is queued, not ranked: it carried no prediction, so the report of a study it won
    had no memory breakdown (Llama-3-70B's: the layout MindSpeed-LLM publishes is the spec's baseline)."""
    run = tmp_path / "run"
    assert (
        _invoke("run", REPO / "search_spaces" / "llama3_70b_32npu.yaml", "--run-dir", run, "--no-tracking").exit_code
        == 0
    )
    report = json.loads(_invoke("report", run, "--json").stdout)
    assert report["best"][0]["number"] == report["baseline"]["number"] == 0
    memory = report["summary"]["memory"]
    assert memory["predicted_gib"] and memory["predicted_peak_gib"] == pytest.approx(
        sum(memory["predicted_gib"].values())
    )
