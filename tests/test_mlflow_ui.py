"""What a user meets in MLflow's UI (issues #34, #40): the link to the study's runs table (the view
the study saves as an experiment tag, read by MLflow 3.17's UI: the trials and the parent run, a
serving study's decision columns), links that open MLflow's "Machine learning" layout, the
descriptions of the parent run and the experiment, rounded display figures on the parent, exact
figures on the trials, a server restarted at once on the same port, and a new SQLite store made
from a cached schema instead of MLflow's migrations. The real browser is in
``test_mlflow_ui_browser.py`` (slow)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.tracking.mlflow_ui import (
    STUDY_FILTER,
    VIEW_TAG,
    NoMlflowStore,
    _port_taken,
    parent_run_ui_url,
    running_ui,
    study_ui_url,
    study_view_state,
)
from autotune.tracking.tracker import NOTE_TAG, SCHEMA_CACHE_ENV, Tracker, seed_sqlite_store
from support import TINY_TRAIN, free_port, mlflow_runs


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
    assert view["orderByKey"] == "metrics.`tokens_per_s_per_device`" and view["orderByAsc"] is False
    # the table holds the trials and, last (it has no trial figures), the parent run with the
    # study's description and plots: what MLflow's server answers the UI for the view's facets
    assert view["searchFilter"] == STUDY_FILTER
    shown = client.search_runs(
        [experiment.experiment_id], view["searchFilter"], order_by=["metrics.`tokens_per_s_per_device` DESC"]
    )
    assert {r.info.run_id for r in shown} == {parent.info.run_id} | {c.info.run_id for c in children}
    assert shown[-1].info.run_id == parent.info.run_id
    assert shown[0].data.metrics["tokens_per_s_per_device"] == max(
        c.data.metrics["tokens_per_s_per_device"] for c in children
    )
    columns = view["selectedColumns"]
    assert columns[:2] == ["metrics.`tokens_per_s_per_device`", "tags.`autotune.status`"]
    searched = ["tp", "pp", "micro_batch_size", "recompute", "zero_stage"]  # the spec's order of fields
    assert columns[2:] == [f"params.`{p}`" for p in searched] and view["columnOrder"] == columns
    assert all(p in children[0].data.params for p in searched)  # the columns name what the children hold
    first = view["compareRunCharts"][0]
    assert first["type"] == "BAR" and first["metricKey"] == "tokens_per_s_per_device"
    assert view["compareRunSections"][0]["isReordered"] and view["isAccordionReordered"]
    note = experiment.tags[NOTE_TAG]
    assert "autotune study `tiny`" in note
    # links to the view and to the parent run, in MLflow's "Machine learning" layout (the page's URL
    # decides it; MLflow's own links to a run carry none)
    table = f"(#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=autotune)"
    run = f"(#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning)"
    assert table in note and run in note


def test_the_parent_run_link_opens_the_machine_learning_layout(tiny_study):
    (parent,), _ = mlflow_runs(tiny_study, "tiny")
    url = parent_run_ui_url(tiny_study, "http://127.0.0.1:5000")
    route, query = _fragment_query(url)
    assert route.endswith(f"/runs/{parent.info.run_id}") and query == {"workflowType": ["machine_learning"]}


def test_the_trials_keep_their_exact_figures(tiny_study):
    # MLflow 3.17's runs table cannot round (no format in the view state; the metric columns'
    # formatter map is empty in its build): the trials' figures are logged as measured, no
    # rounded copies beside them
    _, children = mlflow_runs(tiny_study, "tiny")
    for child in children:
        result = json.loads(
            (tiny_study / "trials" / f"{int(child.data.tags['autotune.trial']):04d}" / "result.json").read_text()
        )
        for k, v in result["metrics"].items():
            if k in child.data.metrics:
                assert child.data.metrics[k] == v
        assert not [k for k in child.data.metrics if k.startswith(("rounded_", "display_"))]


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
    view = study_view_state([("ttft_p99_ms", "minimize"), ("goodput_rps", "maximize")], ["max_num_seqs"])
    assert view["orderByKey"] == "metrics.`ttft_p99_ms`" and view["orderByAsc"] is True
    assert view["selectedColumns"][:3] == ["metrics.`ttft_p99_ms`", "metrics.`goodput_rps`", "tags.`autotune.status`"]
    kinds = [c["type"] for c in view["compareRunCharts"]]
    assert kinds == ["BAR", "BAR", "SCATTER", "PARALLEL"]
    scatter = view["compareRunCharts"][2]
    assert scatter["yaxis"]["key"] == "ttft_p99_ms" and scatter["xaxis"]["key"] == "goodput_rps"
    many = study_view_state([("m", "maximize")], [f"p{i}" * 300 for i in range(100)])
    assert len(json.dumps(many)) <= 20000  # MLflow's limit on an experiment tag


SERVING_DECISION = ["max_rate_rps", "slo_attainment", "ttft_p99_ms", "tpot_p99_ms"]


def test_a_serving_study_view_shows_the_serving_decision_first():
    searched = ["max_num_seqs", "tp", "replicas", "enable_chunked_prefill"]
    view = study_view_state([("goodput_rps_per_device", "maximize")], searched, workload="serve", priced=True)
    metrics = ["goodput_rps_per_device", *SERVING_DECISION, "cost_per_million_output_tokens"]
    expected = [f"metrics.`{m}`" for m in metrics] + ["params.`replicas`", "params.`tp`", "tags.`autotune.status`"]
    expected += ["params.`max_num_seqs`", "params.`enable_chunked_prefill`"]
    assert view["selectedColumns"] == expected and view["columnOrder"] == expected
    assert view["orderByKey"] == "metrics.`goodput_rps_per_device`" and view["orderByAsc"] is False
    assert set(view["columnWidths"]) == {f"metrics.`{m}`" for m in metrics}  # the headers read in full
    assert view["compareRunCharts"][0]["metricKey"] == "goodput_rps_per_device"
    # no cost column when the cluster has no price (the metric is never logged); another first objective
    view = study_view_state([("ttft_p99_ms", "minimize")], ["max_num_seqs"], workload="serve")
    assert view["selectedColumns"][:7] == [
        "metrics.`ttft_p99_ms`",
        "metrics.`goodput_rps_per_device`",
        "metrics.`max_rate_rps`",
        "metrics.`slo_attainment`",
        "metrics.`tpot_p99_ms`",
        "params.`replicas`",
        "params.`tp`",
    ]
    assert "metrics.`cost_per_million_output_tokens`" not in view["selectedColumns"]
    # a training study's view stays as it was
    train = study_view_state([("tokens_per_s_per_device", "maximize")], ["tp", "pp"], workload="train", priced=True)
    assert train["selectedColumns"] == [
        "metrics.`tokens_per_s_per_device`",
        "tags.`autotune.status`",
        "params.`tp`",
        "params.`pp`",
    ]
    assert train["columnWidths"] == {"metrics.`tokens_per_s_per_device`": 190}


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


# ------------------------------------------------------------------ the server's port
def _time_wait_on(port: int) -> None:
    """Leave a connection in TIME_WAIT on the port, as a stopped server does: the server's side
    closes first (HTTP's ``Connection: close``), then its listening socket goes."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()
        client.recv(1)  # the server's FIN
        client.close()
        assert _port_taken("127.0.0.1", port)  # listening: taken
    time.sleep(0.05)


def test_a_port_left_in_time_wait_is_free_and_a_listening_one_is_taken():
    port = free_port()
    _time_wait_on(port)
    assert not _port_taken("127.0.0.1", port)
    with socket.socket() as other:  # what a server does: it binds with SO_REUSEADDR, and listens
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen(1)
        assert _port_taken("127.0.0.1", port)
    assert not _port_taken("127.0.0.1", port)


def _time_waits(port: int) -> int:
    """Connections in TIME_WAIT on the local port (Linux's /proc/net/tcp; -1 elsewhere)."""
    table = Path("/proc/net/tcp")
    if not table.exists():
        return -1
    rows = [line.split() for line in table.read_text().splitlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "06")


def _closed_by_the_server(base: str) -> None:
    """A request the server answers and closes first (``Connection: close``; the client waits
    for the server's FIN): what leaves a stopped server's port in TIME_WAIT."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")


@pytest.mark.slow
def test_the_ui_restarts_at_once_on_the_port_it_stopped_on(tiny_study):
    port = free_port()
    for attempt in range(2):
        with running_ui(tiny_study, port=port) as (base, proc):
            assert base == f"http://127.0.0.1:{port}"
            _closed_by_the_server(base)
        assert proc.returncode is not None
        assert _time_waits(port) != 0  # the stopped server's connection holds the port's TIME_WAIT
    assert not _port_taken("127.0.0.1", port)


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
