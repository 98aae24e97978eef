"""What MLflow refuses, kept out of the way of the study (issue #31).

Item 5, names: a probe's metric named with over 250 characters, a newline, ``$`` or an escape
character made MLflow refuse the trial's whole write, and the trial's child run (the best trial's
too) was missing on every run. Every name is now made acceptable by MLflow's own rule, the same way
each time, and the run lists what was renamed.

Item 10, a store that stops taking writes mid-study (disk full, directory turned read-only):
MLflow's logger printed two raw SQLAlchemy tracebacks to the terminal; they now go to autotune's
debug log and the user reads autotune's one-line message."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.tracking.tracker import RENAMED_TAG, Tracker, mlflow_key

LONG = "throughput_" + "x" * 290
BAD_METRICS = {
    LONG: 1.0,
    "loss\nafter": 2.0,
    "cost$": 3.0,
    "esc\x1b[31mred": 4.0,
    "../up": 5.0,
    "a//b": 6.0,
    "tokens_per_s": 7.0,
}


def _accepted_by_mlflow(name: str, kind: str = "metric") -> None:
    """Raises as MLflow's server-side validation would (``mlflow.utils.validation``)."""
    from mlflow.utils import validation as v

    {"metric": v._validate_metric_name, "param": v._validate_param_name, "tag": v._validate_tag_name}[kind](name)
    assert len(name) <= v.MAX_ENTITY_KEY_LENGTH
    assert "\n" not in name


@pytest.fixture
def tracker(tmp_path: Path):
    t = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "names", tmp_path / "mlartifacts")
    t.start_parent("study", {"model": "tiny"}, {"autotune.study": "names"})
    yield t
    t.flush(timeout=30)


def _children(t: Tracker) -> dict[int, object]:
    return {int(r.data.tags["autotune.trial"]): r for r in t.child_runs()}


def test_a_trial_with_names_mlflow_refuses_keeps_its_child_run(tracker):
    tracker.log_trial(
        0,
        {"tp": 1, "env.X$Y": "v", "p\n": 2},
        dict(BAD_METRICS),
        {"autotune.status": "ok", "probe.note\x1b": "x"},
        steps=[{"event": "step", "step": 0, "loss": 1.5}],
    )
    tracker.log_trial(1, {"tp": 2}, {"cost$": 9.0, "tokens_per_s": 8.0}, {"autotune.status": "ok"})
    assert tracker.finish_parent() == 0
    assert tracker.failed_writes == []  # nothing refused
    children = _children(tracker)
    assert sorted(children) == [0, 1]  # was: trial 0 missing ("'Metric name' exceeds the maximum length")
    run = children[0]
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert len(metrics) == len(BAD_METRICS) + 1  # every metric kept (and the step's loss)
    assert metrics["tokens_per_s"] == 7.0 and metrics["step/loss"] == 1.5
    assert metrics[mlflow_key("cost$")] == 3.0 and metrics[mlflow_key("loss\nafter")] == 2.0
    assert metrics[mlflow_key(LONG)] == 1.0 and mlflow_key(LONG).startswith("throughput_xxx")
    for name in metrics:
        _accepted_by_mlflow(name)
    assert run.data.params[mlflow_key("env.X$Y")] == "v" and run.data.params["tp"] == "1"
    assert run.data.tags[mlflow_key("probe.note\x1b")] == "x"
    # the run says which names were changed, and to what
    renamed = run.data.tags[RENAMED_TAG]
    for original in ("cost$", "loss\nafter", "esc\x1b[31mred", "../up", "a//b", "env.X$Y", "probe.note\x1b"):
        assert f"{original!r} -> {mlflow_key(original)!r}" in renamed, original
    assert "tokens_per_s" not in renamed and "'tp'" not in renamed
    # the same name is logged under the same key in every trial (comparable across trials)
    assert children[1].data.metrics[mlflow_key("cost$")] == 9.0
    assert children[1].data.tags[RENAMED_TAG] == f"metric 'cost$' -> {mlflow_key('cost$')!r}"


def test_parent_params_and_metrics_with_refused_names(tracker):
    """``best.<param>`` and ``best_<metric>`` on the parent come from the spec and the probe: the
    same rule, and a changed value of a renamed param still becomes ``<name>.latest``."""
    tracker.log_parent(metrics={"best_cost$": 1.0}, params={"best.a$b": 1})
    tracker.log_parent(params={"best.a$b": 2})  # a resumed study found a better config
    assert tracker.finish_parent() == 0
    assert tracker.failed_writes == []
    run = tracker.client.get_run(tracker.parent_run_id)
    assert run.data.metrics[mlflow_key("best_cost$")] == 1.0
    assert run.data.params[mlflow_key("best.a$b")] == "1"
    assert run.data.tags[mlflow_key("best.a$b") + ".latest"] == "2"
    assert "'best_cost$'" in run.data.tags[RENAMED_TAG] and "'best.a$b'" in run.data.tags[RENAMED_TAG]


def test_renamed_names_that_collide_stay_apart(tracker):
    """``a$`` becomes ``a_``, which the probe also printed: both are kept, under two keys."""
    tracker.log_trial(0, {"k$": 1, "k_": 2}, {"a$": 1.0, "a_": 2.0, "a\n": 3.0}, {"autotune.status": "ok"})
    assert tracker.finish_parent() == 0
    assert tracker.failed_writes == []
    run = _children(tracker)[0]
    assert run.data.metrics["a_"] == 2.0  # a valid name keeps its own
    assert sorted(run.data.metrics.values()) == [1.0, 2.0, 3.0]
    assert sorted(run.data.params.values()) == ["1", "2"] and run.data.params["k_"] == "2"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=0, max_size=400))
def test_every_name_becomes_one_mlflow_accepts(name):
    key = mlflow_key(name)
    for kind in ("metric", "param", "tag"):
        _accepted_by_mlflow(key, kind)
    assert mlflow_key(key) == key  # a logged name is left alone
    assert mlflow_key(name) == key  # the same every time


# ------------------------------------------------------------------ a store that stops taking writes
# The tracker in a process of its own, configured as the CLI configures the terminal, whose file
# size limit drops to 0 after the first trial: every write of the SQLite store then fails
# ("disk I/O error"), as on a full disk. A file size limit holds for root too, where chmod of the
# store's directory would not stop a write (the tests run as root); Python ignores SIGXFSZ, so
# the write fails instead of killing the process. Its stderr is a pipe, which the limit spares.
DISK_FULL = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from autotune.cli.commands import _setup_logging
    from autotune.tracking.tracker import Tracker

    _setup_logging(False)  # the terminal as ``autotune run`` has it
    d = Path(sys.argv[1])
    tracker = Tracker(f"sqlite:///{d / 'mlflow.db'}", "full", d / "mlartifacts", retry_after_s=1, drain_timeout_s=10)
    tracker.start_parent("study", {"model": "tiny"}, {})
    tracker.log_trial(0, {"tp": 1}, {"tokens_per_s": 1.0}, {"autotune.status": "ok"})
    assert tracker.flush(timeout=30) == 0 and not tracker.failed_writes
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    tracker.log_trial(1, {"tp": 2}, {"tokens_per_s": 2.0}, {"autotune.status": "ok"})
    tracker.finish_parent()
    print("FAILED_WRITES", repr(tracker.failed_writes), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_store_that_stops_taking_writes_prints_no_traceback(tmp_path):
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL)
    store = tmp_path / "store"
    store.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(store)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED_WRITES" in proc.stdout, "the store never failed: the test checks nothing"
    err = proc.stderr
    # was: "ERROR mlflow.store.db.utils: SQLAlchemy database error ..." twice, each with its traceback
    assert "Traceback" not in err, err[-3000:]
    assert "SQLAlchemy" not in err and "[SQL:" not in err and "mlflow.store" not in err, err[-3000:]
    flat = " ".join(err.split())
    assert "MLflow refused trial 1" in flat and "disk I/O error" in flat, err[-3000:]
    failed = eval(proc.stdout.split("FAILED_WRITES", 1)[1].strip())
    assert failed and failed[0].startswith("trial 1: ")
    assert all("\n" not in f and "[SQL:" not in f for f in failed)  # what the CLI lists at the end: one line each
