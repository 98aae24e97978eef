"""What a user meets in MLflow's UI (issue #34): the link to the study's runs table (the view the
study saves as an experiment tag, read by MLflow 3.17's UI), the descriptions of the parent run and
the experiment, rounded display figures, and a new SQLite store made from a cached schema instead
of MLflow's migrations. The real browser is in ``test_mlflow_ui_browser.py`` (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.mlflow_ui import VIEW_TAG, NoMlflowStore, running_ui, study_ui_url, study_view_state
from autotune.tracking import NOTE_TAG, SCHEMA_CACHE_ENV, Tracker, seed_sqlite_store
from support import TINY_TRAIN, mlflow_runs


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ui")
    spec = folder / "tiny.yaml"
    spec.write_text(TINY_TRAIN)
    run_dir = folder / "study"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    return run_dir


def _fragment_query(url: str) -> tuple[str, dict[str, list[str]]]:
    route, _, query = urlsplit(url).fragment.partition("?")
    return route, parse_qs(query)


def test_the_study_url_opens_its_saved_view_of_the_trials(tiny_study):
    from mlflow.tracking import MlflowClient

    url = study_ui_url(tiny_study, "http://127.0.0.1:5000/")
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_study / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    route, query = _fragment_query(url)
    assert url.startswith("http://127.0.0.1:5000/#/")
    assert route == f"/experiments/{experiment.experiment_id}/runs"
    # the runs table of "Model training", not the GenAI overview; the study's view, no facet of its own
    assert query == {"workflowType": ["machine_learning"], "viewStateShareKey": ["autotune"]}
    view = json.loads(experiment.tags[VIEW_TAG])
    (parent,), children = mlflow_runs(tiny_study, "tiny")
    assert view["searchFilter"] == f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    assert view["orderByKey"] == "metrics.`tokens_per_s_per_device`" and view["orderByAsc"] is False
    columns = view["selectedColumns"]
    assert columns[:2] == ["metrics.`tokens_per_s_per_device`", "tags.`autotune.status`"]
    searched = ["tp", "pp", "micro_batch_size", "recompute", "zero_stage"]  # the spec's order of fields
    assert columns[2:] == [f"params.`{p}`" for p in searched] and view["columnOrder"] == columns
    assert all(p in children[0].data.params for p in searched)  # the columns name what the children hold
    first = view["compareRunCharts"][0]
    assert first["type"] == "BAR" and first["metricKey"] == "tokens_per_s_per_device"
    assert view["compareRunSections"][0]["isReordered"] and view["isAccordionReordered"]
    assert "autotune study `tiny`" in experiment.tags[NOTE_TAG]
    assert "viewStateShareKey=autotune" in experiment.tags[NOTE_TAG]  # a link to the view in the description


def test_the_parent_run_says_what_was_tuned_and_what_came_out(tiny_study):
    (parent,), _ = mlflow_runs(tiny_study, "tiny")
    note = parent.data.tags[NOTE_TAG]
    assert "training of tiny-llama on 2 x cpu" in note and "maximize tokens_per_s_per_device" in note
    assert "tp 1|2; pp 1|2; micro_batch_size 1|2|4; recompute none|full; zero_stage 0|1|3" in note
    best = int(parent.data.tags["autotune.best_trial"])
    assert f"- Best: trial {best}, tokens_per_s_per_device " in note and "`tp=" in note
    assert "- Recommended: " in note
    # display figures rounded (5 significant digits), importances exact (read back by the report's tests)
    value = parent.data.metrics["best_tokens_per_s_per_device"]
    assert value == float(f"{value:.5g}")
    assert all(
        len(f"{v:.12g}".replace("-", "").replace(".", "").lstrip("0")) <= 5
        for k, v in parent.data.metrics.items()
        if k.startswith(("best_", "baseline_", "gain_pct_"))
    )


def test_a_study_view_for_two_objectives_sorts_by_the_first_and_plots_them_against_each_other():
    view = study_view_state("abc", [("ttft_p99_ms", "minimize"), ("goodput_rps", "maximize")], ["max_num_seqs"])
    assert view["orderByKey"] == "metrics.`ttft_p99_ms`" and view["orderByAsc"] is True
    assert view["selectedColumns"][:3] == ["metrics.`ttft_p99_ms`", "metrics.`goodput_rps`", "tags.`autotune.status`"]
    kinds = [c["type"] for c in view["compareRunCharts"]]
    assert kinds == ["BAR", "BAR", "SCATTER", "PARALLEL"]
    scatter = view["compareRunCharts"][2]
    assert scatter["yaxis"]["key"] == "ttft_p99_ms" and scatter["xaxis"]["key"] == "goodput_rps"
    many = study_view_state("abc", [("m", "maximize")], [f"p{i}" * 300 for i in range(100)])
    assert len(json.dumps(many)) <= 20000  # MLflow's limit on an experiment tag


def test_no_store_is_a_clear_error_naming_the_run_directory(tmp_path):
    with pytest.raises(NoMlflowStore, match=str(tmp_path)):
        study_ui_url(tmp_path, "http://127.0.0.1:5000")
    with pytest.raises(NoMlflowStore, match="no MLflow store"):
        with running_ui(tmp_path, port=0):
            pass


def test_a_store_without_the_study_view_opens_its_runs_table(tmp_path, monkeypatch):
    monkeypatch.setenv(SCHEMA_CACHE_ENV, str(tmp_path / "cache"))
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "older", tmp_path / "mlartifacts")
    url = study_ui_url(tmp_path, "http://localhost:5001")
    assert url == f"http://localhost:5001/#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning"


# ------------------------------------------------------------------ a new store from a cached schema
def _no_migrations(monkeypatch):
    import mlflow.store.db.utils as db_utils

    def refuse(*args, **kwargs):
        raise AssertionError("MLflow ran its migrations on a store made from the cached schema")

    monkeypatch.setattr(db_utils, "_initialize_tables", refuse)
    monkeypatch.setattr(db_utils, "_upgrade_db", refuse)


def test_a_new_store_is_a_copy_of_the_cached_schema_and_opens_without_migrations(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv(SCHEMA_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert seed_sqlite_store(tmp_path / "a" / "mlflow.db") == "built"
    (template,) = (tmp_path / "xdg" / "autotune").glob("mlflow-*.db")
    assert seed_sqlite_store(tmp_path / "b" / "mlflow.db") == "copied"
    assert seed_sqlite_store(tmp_path / "b" / "mlflow.db") == "exists"  # never overwritten
    _no_migrations(monkeypatch)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    experiment = client.create_experiment("x", artifact_location=(tmp_path / "b" / "art").as_uri())
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "m", 1.5)
    assert client.get_run(run.info.run_id).data.metrics == {"m": 1.5}
    # the Tracker takes the same path for a new store
    tracker = Tracker(f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}", "y", tmp_path / "c" / "mlartifacts")
    assert tracker.client.get_experiment(tracker.experiment_id).name == "y"
    assert template.exists() and not list(template.parent.glob("*.tmp"))


def test_a_damaged_cached_schema_is_rebuilt_and_a_cache_that_cannot_be_written_falls_back(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(SCHEMA_CACHE_ENV, str(cache))
    assert seed_sqlite_store(tmp_path / "a.db") == "built"
    (template,) = cache.glob("mlflow-*.db")
    template.write_bytes(b"not a database" * 100)
    assert seed_sqlite_store(tmp_path / "b.db") == "built"  # rebuilt, not copied as it was
    assert template.read_bytes()[:15] == b"SQLite format 3"

    monkeypatch.setenv(SCHEMA_CACHE_ENV, str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("in the way")
    outcome = seed_sqlite_store(tmp_path / "c" / "mlflow.db")
    assert outcome.startswith("skipped") and not (tmp_path / "c" / "mlflow.db").exists()
    # MLflow makes the store itself, as before
    tracker = Tracker(f"sqlite:///{tmp_path / 'd' / 'mlflow.db'}", "z", tmp_path / "d" / "mlartifacts")
    assert tracker.client.get_experiment(tracker.experiment_id).name == "z"

    monkeypatch.setenv(SCHEMA_CACHE_ENV, "off")
    assert seed_sqlite_store(tmp_path / "e.db") == f"skipped: {SCHEMA_CACHE_ENV} is off"
