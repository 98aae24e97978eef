"""MLflow: one parent run per study invocation, one child run per trial, artifacts on the parent.

All MLflow calls of the project live here and run in the driver only (probes never import MLflow).
The client API (``MlflowClient``) is used rather than the fluent one so that concurrent trials can
be logged without a global "active run", and every write is a single batch call.

Why the writes are queued, bounded and retried: a tracking server is a shared service that
restarts, and a study that waits on it, or dies with it, loses hours of probes. Optuna storage is
the record of the study; MLflow is a view of it. So:

- every write goes through one background (daemon) thread, in order; the study loop only queues;
- each HTTP call is bounded (``MLFLOW_HTTP_REQUEST_TIMEOUT`` 10 s, one retry, unless the user set
  them), and an unreachable server puts the tracker *offline*: one warning, later writes are kept
  in memory without touching the network, and the server is asked again every ``retry_after_s``;
  when it answers, the backlog is written in order and one line says so;
- a child run is complete only once its terminal status is written. A write that broke half-way
  deletes the half-written child before writing it again, and the next run's reconciliation
  (``StudyRunner._reconcile_tracking``) replaces any child still ``RUNNING`` and logs every
  trial MLflow lacks, so a write lost with the process is not lost for good;
- ``finish_parent`` waits for the queue while it moves, at most ``drain_timeout_s`` without progress,
  and returns what is still unwritten.

Defaults keep a study self-contained: the tracking store is a SQLite file in the run directory and
the experiment's artifact location is in the run directory too (MLflow would otherwise write
``./mlruns`` into whatever directory the user happened to be in).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["Tracker", "TERMINAL_STATUSES", "default_tracking_uri", "error_line", "mlflow_ui_command"]

log = logging.getLogger(__name__)

_MAX_PARAM = 6000  # MLflow's limit on a param value
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's own defaults (120 s timeout, 7 retries with backoff) block a call for minutes when the
# server is gone; the tracker retries whole writes itself, so each call may give up quickly
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                  "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


# the experiment tag MLflow 3's UI reads to open an experiment on its runs table rather than its
# GenAI traces page (mlflow 3.17.2: server/js/build main bundle, ExperimentKind
# "custom_model_development"; mlflow/demo/generators/traces.py sets "genai_development")
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def relocate_artifacts(run_dir: Path) -> str | None:
    """Point a moved run directory's MLflow store at its own ``mlartifacts/``.

    MLflow keeps an experiment's artifact location and each run's artifact URI as absolute
    ``file://`` paths, and its API cannot change them; after ``mv`` (or a copy to a laptop) the UI
    shows every run but no artifact. This rewrites the old prefix to the new one in the run
    directory's own SQLite store (the experiments and runs tables), and says what it did; a
    store whose paths are already right, or that is not the run directory's, is left alone."""
    import sqlite3

    db = run_dir / "mlflow.db"
    if not db.is_file():
        return None
    new = (run_dir / "mlartifacts").resolve().as_uri()
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT artifact_location FROM experiments WHERE artifact_location LIKE '%/mlartifacts'"
                            ).fetchall()
        old = next((r[0] for r in rows if r[0] != new), None)
        if old is None:
            return None
        conn.execute("UPDATE experiments SET artifact_location = ? || substr(artifact_location, ?) "
                     "WHERE substr(artifact_location, 1, ?) = ?", (new, len(old) + 1, len(old), old))
        conn.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE substr(artifact_uri, 1, ?) = ?",
                     (new, len(old) + 1, len(old), old))
    return f"the run directory moved: its MLflow artifact paths now point at {new} (were {old})"


def mlflow_ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://", "databricks")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


@dataclass
class _Write:
    """One queued write. ``run_id`` remembers a child run created by an attempt that broke, so
    that the next attempt deletes it instead of leaving a second, half-written child."""

    what: str
    do: Callable[["_Write"], Any]
    run_id: str | None = None


class Tracker:
    """Writes one study's runs. ``parent_run_id`` is kept by the caller (in Optuna storage) so a
    resumed study continues the same parent run instead of starting a second one."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_dir: Path, *,
                 retry_after_s: float = 30.0, drain_timeout_s: float = 60.0):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        if tracking_uri.startswith(("http://", "https://")):
            for key, value in _HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.retry_after_s = retry_after_s
        self.drain_timeout_s = drain_timeout_s
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            artifact_dir.mkdir(parents=True, exist_ok=True)
            location = artifact_dir.resolve().as_uri() if "://" not in tracking_uri or tracking_uri.startswith("sqlite") else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        if exp is None or EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            # MLflow 3 opens an experiment without this tag on its GenAI (traces) page
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        self.experiment = experiment
        self.parent_run_id: str | None = None
        self.offline_since: float | None = None
        self.failed_writes: list[str] = []  # rejected by MLflow itself (not a connection problem)
        self._jobs: queue.Queue[_Write | None] = queue.Queue()
        self._backlog: deque[_Write] = deque()
        self._unfinished = 0
        self._idle = threading.Condition()
        self._next_check = 0.0
        self._last_progress = 0.0
        self._attempts = 0  # writes tried (done, refused or found the server gone)
        # a daemon: a write stuck on a dead server must never keep the process from exiting
        self._thread = threading.Thread(target=self._serve, name="mlflow-writer", daemon=True)
        self._thread.start()

    # ---- the writer thread ---------------------------------------------------------------------
    def _submit(self, what: str, do: Callable[[_Write], Any]) -> _Write:
        write = _Write(what, do)
        with self._idle:
            self._unfinished += 1
        self._jobs.put(write)
        return write

    def _serve(self) -> None:
        while True:
            try:
                write = self._jobs.get(timeout=self.retry_after_s if self._backlog else None)
                if write is not None:  # None only wakes the writer up
                    self._backlog.append(write)
            except queue.Empty:  # offline and idle: time to ask the server again
                pass
            try:
                self._replay()
            except Exception:  # never let the writer die: flush() would wait on it for nothing
                log.exception("MLflow writer error (the trials are in Optuna storage)")
            with self._idle:
                self._idle.notify_all()

    def _replay(self) -> None:
        """Write the backlog in order; stop at the first write that cannot reach the server."""
        if self.offline_since is not None and time.monotonic() < self._next_check:
            return
        while self._backlog:
            write = self._backlog[0]
            try:
                write.do(write)
            except Exception as exc:
                if not self._reachable():
                    self._go_offline(exc)
                    self._attempts += 1
                    return
                # the server answers but refuses this write: retrying would fail the same way
                self.failed_writes.append(f"{write.what}: {exc}")
                if write.run_id is not None:  # no half-written child left behind
                    try:
                        self.client.delete_run(write.run_id)
                    except Exception:
                        pass
                log.warning("MLflow refused %s (the trial stays in Optuna storage): %s", write.what, exc)
            self._backlog.popleft()
            self._attempts += 1
            self._settle(write)
        if self.offline_since is not None:
            log.warning("MLflow at %s answers again after %.0f s: the queued writes are done",
                        self.tracking_uri, time.monotonic() - self.offline_since)
            self.offline_since = None

    def _settle(self, write: _Write) -> None:
        self._last_progress = time.monotonic()
        with self._idle:
            self._unfinished -= 1
            self._idle.notify_all()

    def _reachable(self) -> bool:
        try:
            self.client.get_experiment(self.experiment_id)
            return True
        except Exception:
            return False

    def _go_offline(self, exc: Exception) -> None:
        self._next_check = time.monotonic() + self.retry_after_s
        if self.offline_since is None:
            self.offline_since = time.monotonic()
            log.warning("MLflow at %s does not answer (%s). The study goes on: every trial is in Optuna "
                        "storage, and the %d queued write(s) are sent when it answers again (asked every "
                        "%.0f s)", self.tracking_uri, error_line(exc), len(self._backlog), self.retry_after_s)
        with self._idle:  # flush() waits for writes that can still happen, not for a dead server
            self._idle.notify_all()

    @property
    def pending_writes(self) -> int:
        return self._unfinished

    def flush(self, timeout: float | None = None, *, retry_now: bool = False) -> int:
        """Wait until every queued write is done, or the server is found unreachable, or no
        write has completed for ``timeout`` seconds (a long backlog that is being written is
        waited for: only a stall counts); returns the number of writes not done yet.
        ``retry_now``: an offline tracker asks the server once more first (the end of a study)."""
        start = time.monotonic()
        attempts = self._attempts
        if retry_now:
            self._next_check = 0.0
            self._jobs.put(None)  # wake the writer
        with self._idle:
            while self._unfinished and not (self.offline_since is not None and self._jobs.empty()
                                            and (not retry_now or self._attempts > attempts)):
                if timeout is not None:
                    left = max(start, self._last_progress) + timeout - time.monotonic()
                    if left <= 0:
                        break
                    self._idle.wait(timeout=min(left, 1.0))
                else:
                    self._idle.wait(timeout=1.0)
            return self._unfinished

    # ---- parent ------------------------------------------------------------------------------
    def start_parent(self, run_name: str, params: dict[str, Any], tags: dict[str, str],
                     resume_run_id: str | None = None) -> str:
        """Synchronous, at the start: a study whose tracking store cannot be reached at all is
        told so before it probes anything (each call is bounded, see the module docstring)."""
        if resume_run_id:
            try:
                run = self.client.get_run(resume_run_id)
                if run.info.lifecycle_stage == "active":
                    self.parent_run_id = resume_run_id
                    if run.info.status != "RUNNING":
                        self.client.update_run(resume_run_id, status="RUNNING")
                    self.client.set_tag(resume_run_id, "autotune.resumed", time.strftime("%Y-%m-%dT%H:%M:%S"))
                    return resume_run_id
            except Exception:  # deleted or from another store: start a fresh parent run
                log.info("previous parent run %s not found; starting a new one", resume_run_id)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.parent_run_id = run.info.run_id
        self._log_batch(self.parent_run_id, params=params)
        return self.parent_run_id

    def log_parent(self, metrics: dict[str, float] | None = None, tags: dict[str, str] | None = None,
                   artifacts: list[Path] | None = None, artifact_path: str | None = None, step: int = 0,
                   params: dict[str, Any] | None = None) -> None:
        """Queue metrics (at ``step``: a history such as the refit after each measurement), tags,
        params and artifacts for the parent run, after every trial queued before. MLflow never
        changes a logged param: one that already has another value (a resumed study found a
        better config) is set as the tag ``<name>.latest`` instead."""
        assert self.parent_run_id
        parent = self.parent_run_id
        step_metrics = [(k, float(v), step) for k, v in (metrics or {}).items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)]
        files = list(artifacts or [])
        new_params = {k: str(v)[:_MAX_PARAM] for k, v in (params or {}).items()}

        def write(_: _Write) -> None:
            all_tags = dict(tags or {})
            fresh = new_params
            if new_params:
                logged = self.client.get_run(parent).data.params
                fresh = {k: v for k, v in new_params.items() if k not in logged}
                all_tags.update({f"{k}.latest": v for k, v in new_params.items() if k in logged and logged[k] != v})
            self._log_batch(parent, params=fresh, tags=all_tags, step_metrics=step_metrics)
            for path in files:
                if path.is_dir():
                    self.client.log_artifacts(parent, str(path), artifact_path)
                elif path.exists():
                    self.client.log_artifact(parent, str(path), artifact_path)

        self._submit(f"the parent run's {', '.join(sorted((metrics or {}) | (tags or {}))) or 'artifacts'}"[:120], write)

    def finish_parent(self, status: str = "FINISHED") -> int:
        """Close the parent run after every queued write; waits at most ``drain_timeout_s``
        without progress (the server may be gone) and returns the number of writes left undone,
        which the next run of the same study writes (it reconciles MLflow with Optuna storage)."""
        if self.parent_run_id:
            parent = self.parent_run_id
            self._submit(f"the parent run's status {status}", lambda _: self.client.set_terminated(parent, status=status))
        return self.flush(timeout=self.drain_timeout_s, retry_now=True)

    # ---- children ----------------------------------------------------------------------------
    def log_trial(self, number: int, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                  steps: list[dict[str, Any]] | None = None, artifacts: list[Path] | None = None,
                  failed: bool = False) -> None:
        """Queue one finished trial as a child run."""
        assert self.parent_run_id
        parent = self.parent_run_id

        def write(attempt: _Write) -> None:
            self._log_trial(attempt, parent, number, params, metrics, tags, steps, artifacts, failed)

        self._submit(f"trial {number}", write)

    def _log_trial(self, attempt: _Write, parent: str, number: int, params: dict[str, Any], metrics: dict[str, float],
                   tags: dict[str, str], steps: list[dict[str, Any]] | None, artifacts: list[Path] | None,
                   failed: bool) -> None:
        """One finished trial as a child run, created and closed in one go; a child left by an
        attempt that broke half-way is deleted first, so a trial never has two."""
        if attempt.run_id is not None:
            try:
                self.client.delete_run(attempt.run_id)
            except Exception as exc:  # never created server-side, or gone: fine; unreachable: retry later
                if not self._reachable():
                    raise
                log.debug("half-written child %s not deleted: %s", attempt.run_id, exc)
            attempt.run_id = None
        run = self.client.create_run(
            self.experiment_id, run_name=f"trial-{number:04d}",
            tags={"mlflow.parentRunId": parent, "autotune.trial": str(number), **tags},
        )
        attempt.run_id = run_id = run.info.run_id
        step_metrics: list[tuple[str, float, int]] = []
        for i, event in enumerate(steps or []):
            for key in ("step_time_s", "loss", "tokens_per_s", "memory_gib"):
                value = event.get(key)
                if isinstance(value, (int, float)):
                    step_metrics.append((f"step/{key}", float(value), int(event.get("step", i))))
        self._log_batch(run_id, params=params, metrics=metrics, step_metrics=step_metrics)
        for path in artifacts or []:
            if path.exists():
                self.client.log_artifact(run_id, str(path))
        self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
        attempt.run_id = None  # complete: nothing to clean up

    def _log_batch(self, run_id: str, params: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
                   tags: dict[str, str] | None = None, step_metrics: list[tuple[str, float, int]] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        p = [Param(k, str(v)[:_MAX_PARAM]) for k, v in (params or {}).items()]
        m = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
        m += [Metric(k, v, now, s) for k, v, s in (step_metrics or []) if v == v]
        t = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
        # MLflow caps one batch at 100 params, 100 tags and 1000 metrics: split to stay inside
        chunks = max((len(p) + 99) // 100, (len(t) + 99) // 100, (len(m) + 999) // 1000, 1)
        for i in range(chunks):
            self.client.log_batch(run_id, metrics=m[i * 1000:(i + 1) * 1000], params=p[i * 100:(i + 1) * 100],
                                  tags=t[i * 100:(i + 1) * 100])

    def child_runs(self) -> list[Any]:
        """Child runs of the current parent, every status (for reconciliation after a crash);
        synchronous: called at the start of a run, before any trial is queued."""
        assert self.parent_run_id
        self.flush(timeout=self.drain_timeout_s)
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}'", max_results=50000
        )

    def delete_run(self, run_id: str) -> None:
        """Remove a half-written child found by reconciliation (queued, in order)."""
        self._submit(f"half-written run {run_id}", lambda _: self.client.delete_run(run_id))


def error_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an error, at most ``limit`` characters: MLflow's errors quote whole HTTP
    responses and retry histories, a warning needs what failed."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."
