"""MLflow: one parent run per study invocation, one child run per trial, artifacts on the parent.

All MLflow calls of the project live here and run in the driver only (probes never import MLflow).
The client API (``MlflowClient``) is used rather than the fluent one so that concurrent trials can
be logged without a global "active run", and every write is a single batch call.

Writes go through one background thread, in order: a child run costs MLflow ~30 ms on SQLite
(more through a server), which would otherwise stall the search loop between probes. The loop
only queues a finished trial; the parent-run calls wait for the queue, and ``finish_parent``
drains it, so nothing queued is dropped. Should the process die with trials still queued, they
are in Optuna storage already and the next run logs them (``StudyRunner._reconcile_tracking``).

Defaults keep a study self-contained: the tracking store is a SQLite file in the run directory and
the experiment's artifact location is in the run directory too (MLflow would otherwise write
``./mlruns`` into whatever directory the user happened to be in).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "default_tracking_uri", "mlflow_ui_command"]

log = logging.getLogger(__name__)

_MAX_PARAM = 6000  # MLflow's limit on a param value


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def mlflow_ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://", "databricks")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


class Tracker:
    """Writes one study's runs. ``parent_run_id`` is kept by the caller (in Optuna storage) so a
    resumed study continues the same parent run instead of starting a second one."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_dir: Path):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            artifact_dir.mkdir(parents=True, exist_ok=True)
            location = artifact_dir.resolve().as_uri() if "://" not in tracking_uri or tracking_uri.startswith("sqlite") else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id
        self.experiment = experiment
        self.parent_run_id: str | None = None
        # one writer: MLflow calls stay ordered and never hit the store concurrently
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-writer")
        self._queued: list[Future] = []

    def flush(self) -> None:
        """Wait until every queued write is done; a write that failed is logged, not raised
        (the trial is safe in Optuna storage and is logged again by the next run)."""
        queued, self._queued = self._queued, []
        for future in queued:
            try:
                future.result()
            except Exception as exc:
                log.warning("MLflow write failed (the trial is in Optuna storage; the next run logs it): %s", exc)

    # ---- parent ------------------------------------------------------------------------------
    def start_parent(self, run_name: str, params: dict[str, Any], tags: dict[str, str],
                     resume_run_id: str | None = None) -> str:
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
                   artifacts: list[Path] | None = None, artifact_path: str | None = None, step: int = 0) -> None:
        """Metrics (at ``step``: a history such as the refit after each measurement), tags and
        artifacts on the parent run, after every queued trial."""
        self.flush()
        self._writer.submit(self._log_parent, metrics, tags, artifacts, artifact_path, step).result()

    def _log_parent(self, metrics: dict[str, float] | None, tags: dict[str, str] | None,
                    artifacts: list[Path] | None, artifact_path: str | None, step: int) -> None:
        assert self.parent_run_id
        self._log_batch(self.parent_run_id, tags=tags or {},
                        step_metrics=[(k, float(v), step) for k, v in (metrics or {}).items()
                                      if isinstance(v, (int, float)) and not isinstance(v, bool)])
        for path in artifacts or []:
            if path.is_dir():
                self.client.log_artifacts(self.parent_run_id, str(path), artifact_path)
            elif path.exists():
                self.client.log_artifact(self.parent_run_id, str(path), artifact_path)

    def finish_parent(self, status: str = "FINISHED") -> None:
        self.flush()
        if self.parent_run_id:
            self._writer.submit(self.client.set_terminated, self.parent_run_id, status=status).result()

    # ---- children ----------------------------------------------------------------------------
    def log_trial(self, number: int, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                  steps: list[dict[str, Any]] | None = None, artifacts: list[Path] | None = None,
                  failed: bool = False) -> Future:
        """Queue one finished trial as a child run; returns the future of its run id."""
        assert self.parent_run_id
        future = self._writer.submit(self._log_trial, number, params, metrics, tags, steps, artifacts, failed)
        self._queued.append(future)
        return future

    def _log_trial(self, number: int, params: dict[str, Any], metrics: dict[str, float], tags: dict[str, str],
                   steps: list[dict[str, Any]] | None, artifacts: list[Path] | None, failed: bool) -> str:
        """One finished trial as a child run (created and closed in one go)."""
        run = self.client.create_run(
            self.experiment_id, run_name=f"trial-{number:04d}",
            tags={"mlflow.parentRunId": self.parent_run_id, "autotune.trial": str(number), **tags},
        )
        run_id = run.info.run_id
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
        return run_id

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
        """Child runs of the current parent (for reconciliation after a crash)."""
        assert self.parent_run_id
        self.flush()
        return self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}'", max_results=50000
        )
