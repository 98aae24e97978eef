"""Phases a user waits on announce themselves and keep moving; off a terminal, a study's
trials leave lines while a probe runs (rich draws no bar into a pipe)."""

from __future__ import annotations

import io
import threading
import time

from rich.console import Console

from autotune.tracking.progress import PROGRESS_EVERY_ENV, ProgressObserver, phase
from autotune.study.records import TrialRecord


def _plain() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200), buf


def test_a_phase_announces_itself_moves_and_says_when_it_ended():
    console, buf = _plain()
    with phase(console, "opening the MLflow store", every_s=0.05) as step:
        time.sleep(0.2)
        step.update("creating the schema")
        time.sleep(0.2)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "opening the MLflow store"
    still = [line for line in lines if line.startswith("  … still opening the MLflow store (")]
    assert len(still) >= 2  # more than one sign of life while it ran
    assert "  opening the MLflow store: creating the schema" in lines
    assert any(line.startswith("  … creating the schema (") for line in lines)  # the detail moves too
    assert lines[-1].startswith("  opening the MLflow store: done in ")


def test_a_quick_phase_is_one_line():
    console, buf = _plain()
    with phase(console, "ranking the space", every_s=5.0):
        pass
    assert buf.getvalue().splitlines() == ["ranking the space"]


def test_a_phase_on_a_terminal_keeps_a_ticking_status_and_leaves_no_spinner_behind():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with phase(console, "writing the results", every_s=0.05):
        time.sleep(0.7)
    text = buf.getvalue()
    assert "writing the results (0.5 s)" in text or "writing the results (0.6 s)" in text  # the seconds tick
    assert "done in" in text


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0.05")
    console, buf = _plain()
    with phase(console, "asking the nodes"):
        time.sleep(0.2)
    assert "  … still asking the nodes (" in buf.getvalue()
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "soon")  # unreadable: the default, no crash
    with phase(console, "again"):
        pass


def _record(number: int, value: float) -> TrialRecord:
    return TrialRecord(
        number=number,
        state="COMPLETE",
        config={},
        status="ok",
        source="measured",
        metrics={"tokens_per_s_per_device": value},
        predicted={},
        reason="",
        probed=True,
        baseline=False,
        chosen_because="",
        values=[value],
        feasible=True,
    )


def test_off_a_terminal_a_long_probe_leaves_lines_and_instant_predictions_do_not(monkeypatch):
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0.05")
    console, buf = _plain()
    observer = ProgressObserver(console, [("tokens_per_s_per_device", "maximize")])
    with observer:
        observer.on_start(3, 0)
        observer.on_trial_started(0, {}, "baseline")
        observer.on_trial_finished(_record(0, 10.0), _record(0, 10.0), 0)  # instant: a prediction
        observer.on_trial_started(1, {}, "guide")
        time.sleep(1.1)  # a probe
        observer.on_trial_finished(_record(1, 20.0), _record(1, 20.0), 0)
    lines = buf.getvalue().splitlines()
    assert not any(line.startswith("trial 0 ok") for line in lines)
    assert any(line.startswith("trial 1 ok: tokens_per_s_per_device 20 (2/3 done") for line in lines)
    heartbeats = [line for line in lines if line.startswith("  … 1 running, 1/3 done")]
    assert len(heartbeats) >= 3


def test_the_heartbeat_stops_with_the_study(monkeypatch):
    monkeypatch.setenv(PROGRESS_EVERY_ENV, "0.05")
    console, _ = _plain()
    before = threading.active_count()
    with ProgressObserver(console, [("m", "maximize")]):
        assert threading.active_count() == before + 1
    assert threading.active_count() == before
