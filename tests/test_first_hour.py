"""What a new user meets first (issue #14): an empty space refused with the rule named, and
Optuna's own log lines formatted like autotune's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from support import TINY_TRAIN

EMPTY = TINY_TRAIN.replace("objectives:", "constraints: ['tp * pp > 4']\nobjectives:")


@pytest.mark.parametrize("command", ["validate", "plan", "run"])
def test_an_empty_space_is_exit_2_naming_the_constraint(write_spec, tmp_path, command):
    spec = write_spec(EMPTY)
    args = [command, str(spec)] + (["--run-dir", str(tmp_path / "run"), "--no-tracking"] if command == "run" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "spec.yaml: constraints: no valid config" in result.stderr
    # the rule that empties the space is named with its count; the others are listed after it
    assert "constraint 'tp * pp > 4' rejects 72 (" in result.stderr
    assert "Fix: loosen constraint 'tp * pp > 4'" in result.stderr
    if command == "run":
        assert not (tmp_path / "run").exists()  # refused before anything is created


def test_validate_json_reports_the_empty_space(write_spec):
    result = CliRunner().invoke(app, ["validate", str(write_spec(EMPTY)), "--json"])
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and "tp * pp > 4" in payload["errors"][0]


def test_a_space_with_configs_still_validates(write_spec):
    result = CliRunner().invoke(app, ["validate", str(write_spec(TINY_TRAIN))])
    assert result.exit_code == 0 and result.stdout.startswith("ok  ")


def test_optuna_warnings_go_through_autotune_logging(capsys):
    """Optuna writes "[W 2026-...] ..." with its own handler; after the CLI's set-up its lines
    reach the user through autotune's handler (propagated, not printed twice)."""
    import logging

    import optuna

    from autotune.cli import _setup_logging

    _setup_logging(False)
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    catcher = Catch()
    logging.getLogger().addHandler(catcher)
    try:
        optuna.logging.get_logger("optuna.study").warning("There are no complete trials.")
    finally:
        logging.getLogger().removeHandler(catcher)
        optuna.logging.disable_propagation()
        optuna.logging.enable_default_handler()
    assert seen == ["There are no complete trials."]
    assert "[W " not in capsys.readouterr().err


def test_mlflow_opens_on_the_study(write_spec, tmp_path):
    """The experiment is marked for model training (MLflow's UI then opens on its runs table);
    the parent carries the best config as params, its effective settings, and every export."""
    from mlflow.tracking import MlflowClient

    from autotune.export import EXPORTERS

    spec = write_spec(TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}",
                                         "search: {n_trials: 6, seed: 1, parallel_trials: 4}"))
    run_dir = tmp_path / "study"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    parent = client.get_run(payload["mlflow_parent_run_id"])
    best = payload["best"][0]["params"]
    for name in ("tp", "pp", "micro_batch_size", "zero_stage", "recompute"):
        assert parent.data.params[f"best.{name}"] == str(best[name])
    assert "best_tokens_per_s_per_device" in parent.data.metrics
    # the effective setting differs from the spec's, and the parent says why
    assert parent.data.params["parallel_trials"] == "1"
    assert "the spec says 4" in parent.data.tags["autotune.parallel_trials_note"]
    exported = {a.path for a in client.list_artifacts(parent.info.run_id, "export")}
    launchable = {name for name in EXPORTERS if (run_dir / "export" / EXPORTERS[name].filename).exists()}
    assert {f"export/{EXPORTERS[n].filename}" for n in launchable} == exported
    assert len(launchable) >= 5, launchable  # every format that can launch the config exactly
