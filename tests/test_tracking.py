"""MLflow as a view of Optuna storage (issue #13): one rule for what is logged, on a first run and
on every resume; half-written children replaced; a tracking server that dies mid-study neither
stops the study nor loses a write (a real ``mlflow server`` on loopback, killed and restarted)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.tracking.tracker import TERMINAL_STATUSES, Tracker
from support import TINY_TRAIN, command_spec, free_port, mlflow_runs, probe_log

RANDOM_TINY = TINY_TRAIN.replace("search: {n_trials: 6, seed: 1}", "search: {n_trials: 8, sampler: random, seed: 5}")


def _children(tracking_uri: str | Path, experiment: str) -> list:
    return mlflow_runs(tracking_uri, experiment)[1]


def _report(spec: Path, run_dir: Path) -> dict:
    import json

    result = CliRunner().invoke(app, ["report", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_one_logging_rule_and_half_written_children_are_replaced(write_spec, tmp_path):
    from mlflow.tracking import MlflowClient

    spec = write_spec(RANDOM_TINY)
    run_dir = tmp_path / "study"
    cli = CliRunner()
    assert cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)]).exit_code == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    trials = _report(spec, run_dir)["trials"]
    tracked = {t["number"] for t in trials if t["probed"] and t["status"] not in ("duplicate", "interrupted")}
    rejected = {t["number"] for t in trials if t["status"] == "invalid" and not t["probed"]}
    assert rejected, "the random sampler proposed no config the rules reject: the test checks nothing"
    first = {int(c.data.tags["autotune.trial"]): c.info.run_id for c in _children(run_dir, "tiny")}
    assert set(first) == tracked  # rule rejections are not logged on the first run ...

    # a write broken half-way (child left RUNNING) and one lost with the process (no child)
    half, lost = sorted(first)[:2]
    client.update_run(first[half], status="RUNNING")
    client.delete_run(first[lost])
    assert cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)]).exit_code == 0
    children = _children(run_dir, "tiny")
    second = {int(c.data.tags["autotune.trial"]): c.info.run_id for c in children}
    assert len(children) == len(second) == len(tracked)  # ... nor on a resume; one child per trial
    assert set(second) == tracked
    assert all(c.info.status in TERMINAL_STATUSES for c in children)
    assert second[half] != first[half] and second[lost] != first[lost]
    assert {n: second[n] for n in tracked - {half, lost}} == {n: first[n] for n in tracked - {half, lost}}

    # a no-op re-run of the finished study changes nothing in MLflow
    assert cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir)]).exit_code == 0
    third = {int(c.data.tags["autotune.trial"]): c.info.run_id for c in _children(run_dir, "tiny")}
    assert third == second


# ------------------------------------------------------------------------ a real tracking server
class MlflowServer:
    """``mlflow server`` on loopback with a SQLite store, started and killed as a process group."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, within_s: float = 90.0) -> None:
        import urllib.request

        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{self.root / 'db.sqlite'}",
                "--default-artifact-root",
                str(self.root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "server.log", "ab"),
            start_new_session=True,
        )
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.skip(
                    f"mlflow server exited with {self.proc.returncode}: {(self.root / 'server.log').read_text()[-500:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.kill()
        pytest.skip(f"mlflow server did not answer within {within_s:.0f} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def mlflow_server(tmp_path):
    root = tmp_path / "mlflow-server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    yield server
    server.kill()


def test_a_tracking_server_killed_mid_study_loses_nothing(mlflow_server, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    caplog.set_level(logging.WARNING, logger="autotune.tracking")
    tracker = Tracker(mlflow_server.url, "served", tmp_path / "art", retry_after_s=1.0, drain_timeout_s=120.0)
    tracker.start_parent("served", {"n_trials": 4}, {"autotune.study": "served"})
    artifact = tmp_path / "result.json"
    artifact.write_text("{}")

    def trial(number: int) -> None:
        tracker.log_trial(
            number,
            {"tp": number},
            {"tokens_per_s_per_device": 100.0 + number},
            {"autotune.status": "ok"},
            steps=[{"step": 0, "step_time_s": 0.1}],
            artifacts=[artifact],
        )

    trial(0)
    assert tracker.flush(timeout=120) == 0

    mlflow_server.kill()
    for number in (1, 2):
        trial(number)
    tracker.log_parent(metrics={"refit_compute": 1.5}, step=1)
    # the writes cannot happen: flush returns (it does not wait on a dead server) with them queued
    assert tracker.flush(timeout=120) == 3
    assert tracker.offline_since is not None
    trial(3)  # offline: queued without touching the network
    assert tracker.pending_writes == 4
    warnings = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]  # one warning, not one per write

    mlflow_server.start()
    left = tracker.finish_parent("FINISHED")
    assert left == 0 and tracker.failed_writes == []
    assert any("answers again" in r.getMessage() for r in caplog.records)

    client = MlflowClient(tracking_uri=mlflow_server.url)
    children = _children(mlflow_server.url, "served")
    numbers = sorted(int(c.data.tags["autotune.trial"]) for c in children)
    assert numbers == [0, 1, 2, 3]  # none lost, none twice
    assert all(c.info.status == "FINISHED" for c in children)
    assert all(
        c.data.metrics["tokens_per_s_per_device"] == 100.0 + int(c.data.tags["autotune.trial"]) for c in children
    )
    parent = client.get_run(tracker.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["refit_compute"] == 1.5


def test_an_unreachable_tracking_server_at_start_is_named_and_a_clear_exit(write_spec, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = write_spec(TINY_TRAIN.replace("backend: simulate", f"backend: simulate\ntracking: {{mlflow_uri: '{url}'}}"))
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "study")])
    assert result.exit_code == 3, result.output
    assert url in result.stderr and "tracking.mlflow_uri" in result.stderr and "--no-tracking" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.slow  # ~22 s; a tracking server killed mid-study stays in CI
def test_a_study_outlives_its_tracking_server_and_a_rerun_logs_what_it_missed(mlflow_server, write_spec, tmp_path):
    """The command backend's probes run while the server is killed: the study finishes (exit 0,
    one warning), and re-running it after the server is back logs the missing trials: Optuna and
    MLflow then hold the same trials, each once."""
    spec = command_spec(write_spec, tmp_path, n_trials=6, parallel=1, ray="ray: {enabled: false}", sleep=0.5)
    text = spec.read_text().replace(
        "backend:", f"tracking: {{mlflow_uri: '{mlflow_server.url}', experiment: cmd}}\nbackend:", 1
    )
    spec.write_text(text)
    run_dir = tmp_path / "study"
    first = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "run", str(spec), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        deadline = time.monotonic() + 120
        while len([e for e in probe_log(tmp_path) if e["event"] == "end"]) < 2:
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        mlflow_server.kill()
        _, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    stderr_text = stderr.decode()
    assert first.returncode == 0, stderr_text[-3000:]
    assert stderr_text.count("does not answer") == 1 and "Traceback" not in stderr_text
    assert "run the same command again" in stderr_text

    mlflow_server.start()
    again = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "run", str(spec), "--run-dir", str(run_dir)],
        capture_output=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert len([e for e in probe_log(tmp_path) if e["event"] == "start"]) == 6  # nothing probed again
    trials = _report(spec, run_dir)["trials"]
    tracked = sorted(t["number"] for t in trials if t["probed"] and t["status"] not in ("duplicate", "interrupted"))
    children = _children(mlflow_server.url, "cmd")
    assert sorted(int(c.data.tags["autotune.trial"]) for c in children) == tracked and len(tracked) == 6
    assert all(c.info.status in TERMINAL_STATUSES for c in children)
