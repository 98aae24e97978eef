"""MLflow: one parent run per study invocation, one child run per trial, artifacts on the parent.

All MLflow calls of the project live here and run in the driver only (probes never import MLflow).
The client API (``MlflowClient``) is used rather than the fluent one so that concurrent trials can
be logged without a global "active run", and every write is a single batch call.

Why one module of over 500 lines: it is the one place that talks to MLflow, and its parts (the
write queue, its bounds and retries, MLflow-valid names, the relocation of a moved store) guard
the same writes; what is written is decided elsewhere (:mod:`autotune.tracking.study_tracking`).

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
  (``StudyTracking.reconcile``, at the study's start) replaces any child still ``RUNNING`` and logs every
  trial MLflow lacks, so a write lost with the process is not lost for good;
- ``finish_parent`` waits for the queue while it moves, at most ``drain_timeout_s`` without progress,
  and returns what is still unwritten.

Defaults keep a study self-contained: the tracking store is a SQLite file in the run directory and
the experiment's artifact location is in the run directory too (MLflow would otherwise write
``./mlruns`` into whatever directory the user happened to be in).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "Tracker",
    "TERMINAL_STATUSES",
    "default_tracking_uri",
    "error_line",
    "seed_sqlite_store",
    "SCHEMA_CACHE_ENV",
]

# what a step event may carry, as the child run's metric history (``step/<key>``): a training
# step's figures, and a serving probe's per-rate ones (one step per rate tried, in the order tried)
STEP_KEYS = (
    "step_time_s",
    "loss",
    "tokens_per_s",
    "memory_gib",
    "rate",
    "goodput_rps",
    "slo_attainment",
    "ttft_p99_ms",
    "tpot_p99_ms",
    "e2e_p99_ms",
    "output_tokens_per_s",
)

log = logging.getLogger(__name__)

_MAX_PARAM = 6000  # MLflow's limit on a param value
_MAX_TAG = 5000  # a tag value is cut here (MLflow's own limit is higher; a UI cell needs less)
# The tag of a run whose metric, param or tag names MLflow refuses: each such name as it was and as
# it was logged (``mlflow_key``), one per line
RENAMED_TAG = "autotune.renamed_keys"
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow's own defaults (120 s timeout, 7 retries with backoff) block a call for minutes when the
# server is gone; the tracker retries whole writes itself, so each call may give up quickly
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


# the experiment tag MLflow 3's UI once read to open an experiment on its runs table rather than its
# GenAI traces page (ExperimentKind "custom_model_development"; mlflow/demo/generators/traces.py
# sets "genai_development"). MLflow 3.17's UI ignores it: its workflow switcher is always on
# (server/js/build/static/js/main.*.js: the experiment kind comes from the ``workflowType`` URL
# parameter, else the browser's localStorage ``mlflow.workflowType``, default "genai"), so the
# links autotune prints carry ``workflowType=machine_learning`` (autotune.tracking.mlflow_ui). Kept for
# the MLflow 3 releases that read it.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# the description MLflow's UI shows on a run's and an experiment's page (mlflow.utils.mlflow_tags)
NOTE_TAG = "mlflow.note.content"


def default_tracking_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


# ---- a new SQLite store from a cached schema ---------------------------------------------------
# Where the empty MLflow schema is kept, one file per MLflow version: a directory (default
# ``$XDG_CACHE_HOME/autotune``, else ``~/.cache/autotune``); "off" (or "0", "false", "none") turns
# the cache off and every new store runs MLflow's migrations.
SCHEMA_CACHE_ENV = "AUTOTUNE_MLFLOW_SCHEMA_CACHE"


def _schema_cache_dir() -> Path | None:
    value = os.environ.get(SCHEMA_CACHE_ENV, "").strip()
    if value.lower() in ("off", "0", "false", "none", "no"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "autotune"


def _schema_revision(db: Path) -> str | None:
    """The Alembic revision a SQLite file's schema is at; None when it is not a readable MLflow
    store (read-only: a damaged file is never changed here)."""
    import sqlite3

    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            if conn.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return None
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except Exception:
        return None
    return row[0] if row and {"experiments", "runs", "metrics", "params", "tags"} <= tables else None


def _build_schema(path: Path) -> None:
    """MLflow's own initialisation of an empty SQLite store (its tables, then every Alembic
    migration: the 1.7-5 s a new store costs), written to ``path``."""
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()


def seed_sqlite_store(db: Path) -> str:
    """Give a new SQLite tracking store (``db`` does not exist yet) MLflow's schema by copying a
    cached empty store made once per MLflow version, instead of letting MLflow run its ~60
    Alembic migrations on every new run directory (1.7 s on an idle machine, 5-20 s on a loaded
    one: most of the silence after "opening the MLflow store"). MLflow then finds its tables at
    the latest revision and opens the copy as it opens any existing store (``SqlAlchemyStore``:
    ``_all_tables_exist``, then ``_verify_schema``). The cache is written once, atomically (a
    temporary file renamed); a cached file whose revision is not this MLflow's latest, or that
    fails SQLite's check, is rebuilt. Any problem (no writable cache, a full disk) leaves ``db``
    absent and MLflow creates the store itself, as before.

    Returns what happened: "exists", "copied", "built" (the cache was made, then copied), or
    "skipped: <why>"."""
    if db.exists():
        return "exists"
    cache = _schema_cache_dir()
    if cache is None:
        return f"skipped: {SCHEMA_CACHE_ENV} is off"
    try:
        import mlflow
        from mlflow.store.db.utils import _get_latest_schema_revision

        head = _get_latest_schema_revision()
        template = cache / f"mlflow-{mlflow.__version__}-{head}.db"
        how = "copied"
        if _schema_revision(template) != head:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f".{template.name}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                _build_schema(tmp)
                if _schema_revision(tmp) != head:
                    return "skipped: MLflow's migrations did not reach their latest revision"
                os.replace(tmp, template)
            finally:
                tmp.unlink(missing_ok=True)
            how = "built"
        db.parent.mkdir(parents=True, exist_ok=True)
        part = db.with_name(f".{db.name}.{os.getpid()}.part")
        try:
            import shutil

            shutil.copyfile(template, part)
            if _schema_revision(part) != head:
                return "skipped: the copy of the cached schema does not read back"
            if db.exists():  # made meanwhile by someone else: theirs stands
                return "exists"
            os.replace(part, db)
        finally:
            part.unlink(missing_ok=True)
        return how
    except Exception as exc:
        log.debug("no cached MLflow schema for %s", db, exc_info=True)
        return f"skipped: {error_line(exc)}"


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
        rows = conn.execute(
            "SELECT artifact_location FROM experiments WHERE artifact_location LIKE '%/mlartifacts'"
        ).fetchall()
        old = next((r[0] for r in rows if r[0] != new), None)
        if old is None:
            return None
        conn.execute(
            "UPDATE experiments SET artifact_location = ? || substr(artifact_location, ?) "
            "WHERE substr(artifact_location, 1, ?) = ?",
            (new, len(old) + 1, len(old), old),
        )
        conn.execute(
            "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE substr(artifact_uri, 1, ?) = ?",
            (new, len(old) + 1, len(old), old),
        )
    return f"the run directory moved: its MLflow artifact paths now point at {new} (were {old})"


@functools.lru_cache(maxsize=4096)
def mlflow_key(name: str) -> str:
    """``name`` as a metric, param or tag key MLflow accepts; a valid name is returned unchanged.

    Why: MLflow refuses a whole batch for one name it does not accept (over 250 characters, a
    newline, ``$``, an escape character, a path such as ``a//b`` or ``../x``), and the tracker then
    deletes the trial's half-written child run: a probe printing one such metric name made its
    trial, the best one included, vanish from MLflow on every run. The rule is MLflow's own
    (``mlflow.utils.validation``: ``validate_param_and_metric_name`` character by character,
    ``path_not_unique``, ``MAX_ENTITY_KEY_LENGTH``), not a guess of it: a character it refuses
    becomes ``_``, empty and ``.``/``..`` path segments are dropped or replaced, and a name that
    is still too long is cut and given an 8-character hash of the original, so two long names
    sharing a prefix stay apart. The same name always gives the same key (comparable across
    trials); which names were changed is said on the run (``RENAMED_TAG``)."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, path_not_unique, validate_param_and_metric_name

    def chars_ok(key: str) -> bool:  # MLflow's regex ends in "$", which also matches before a final newline
        return bool(validate_param_and_metric_name(key)) and "\n" not in key

    def valid(key: str) -> bool:
        return chars_ok(key) and not path_not_unique(key) and len(key) <= MAX_ENTITY_KEY_LENGTH

    if valid(name):
        return name

    def as_path(key: str) -> str:  # what posixpath.normpath leaves alone
        parts = [{".": "_", "..": "__"}.get(part, part) for part in key.split("/") if part]
        key = "/".join(parts) or "_"
        return "_" + key[1:] if key.startswith("..") else key

    key = as_path("".join(c if chars_ok(c) else "_" for c in str(name)))
    if len(key) > MAX_ENTITY_KEY_LENGTH:
        key = as_path(key[: MAX_ENTITY_KEY_LENGTH - 9].rstrip("/") + "_" + _digest(name))
    return key if valid(key) else f"renamed_{_digest(name)}"


def _digest(name: str) -> str:
    return hashlib.sha1(str(name).encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _mlflow_names(kind: str, keys: Any) -> tuple[dict[str, str], list[str]]:
    """Each of ``keys`` (one batch's metric, param or tag names) -> the key it is logged under
    (``mlflow_key``), and one line per key changed: ``kind 'original' -> 'logged'``. Valid keys
    keep their names; a changed key that lands on another key of the batch (MLflow refuses a batch
    with a param or tag twice) gets the original's hash appended."""
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH

    keys = list(dict.fromkeys(keys))
    names = {k: str(k) for k in keys if mlflow_key(str(k)) == str(k)}
    taken = set(names.values())
    renamed: list[str] = []
    for key in keys:
        if key in names:
            continue
        new = mlflow_key(str(key))
        if new in taken:
            new = mlflow_key(new[: MAX_ENTITY_KEY_LENGTH - 9] + "_" + _digest(str(key)))
        taken.add(new)
        names[key] = new
        text = str(key)
        shown = repr(text) if len(text) <= 300 else f"{text[:300]!r}... ({len(text)} characters)"
        renamed.append(f"{kind} {shown} -> {new!r}")
        if (kind, text) not in _WARNED:  # repr: a name's escape characters never reach the terminal
            _WARNED.add((kind, text))
            brief = repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters)"
            log.warning(
                "MLflow does not accept the %s name %s: logged as %r (the run's tag %s lists each such name)",
                kind,
                brief,
                new if len(new) <= 80 else new[:80] + "...",
                RENAMED_TAG,
            )
    return names, renamed


_WARNED: set[tuple[str, str]] = set()  # names already warned about: once per process, not per trial


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

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        artifact_dir: Path,
        *,
        retry_after_s: float = 30.0,
        drain_timeout_s: float = 60.0,
    ):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        if tracking_uri.startswith(("http://", "https://")):
            for key, value in _HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        _store_logs_to_debug()

        self.tracking_uri = tracking_uri
        self.retry_after_s = retry_after_s
        self.drain_timeout_s = drain_timeout_s
        if tracking_uri.startswith("sqlite:///") and "?" not in tracking_uri:
            db = Path(tracking_uri[len("sqlite:///") :])
            if not db.exists():  # a new store: MLflow's schema from the cache, not its migrations
                log.debug("new MLflow store %s: %s", db, seed_sqlite_store(db))
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            artifact_dir.mkdir(parents=True, exist_ok=True)
            location = (
                artifact_dir.resolve().as_uri()
                if "://" not in tracking_uri or tracking_uri.startswith("sqlite")
                else None
            )
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
        self._renamed: dict[str, list[str]] = {}  # run id -> its RENAMED_TAG lines (the parent's, mostly)
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
                log.debug("MLflow refused %s", write.what, exc_info=True)
                self.failed_writes.append(f"{write.what}: {error_line(exc, 300)}")
                if write.run_id is not None:  # no half-written child left behind
                    try:
                        self.client.delete_run(write.run_id)
                    except Exception:
                        pass
                log.warning("MLflow refused %s (the trial stays in Optuna storage): %s", write.what, error_line(exc))
            self._backlog.popleft()
            self._attempts += 1
            self._settle(write)
        if self.offline_since is not None:
            log.warning(
                "MLflow at %s answers again after %.0f s: the queued writes are done",
                self.tracking_uri,
                time.monotonic() - self.offline_since,
            )
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
            log.warning(
                "MLflow at %s does not answer (%s). The study goes on: every trial is in Optuna "
                "storage, and the %d queued write(s) are sent when it answers again (asked every "
                "%.0f s)",
                self.tracking_uri,
                error_line(exc),
                len(self._backlog),
                self.retry_after_s,
            )
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
            while self._unfinished and not (
                self.offline_since is not None and self._jobs.empty() and (not retry_now or self._attempts > attempts)
            ):
                if timeout is not None:
                    left = max(start, self._last_progress) + timeout - time.monotonic()
                    if left <= 0:
                        break
                    self._idle.wait(timeout=min(left, 1.0))
                else:
                    self._idle.wait(timeout=1.0)
            return self._unfinished

    # ---- parent ------------------------------------------------------------------------------
    def start_parent(
        self, run_name: str, params: dict[str, Any], tags: dict[str, str], resume_run_id: str | None = None
    ) -> str:
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
        names, renamed = _mlflow_names("tag", tags.keys())
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, tags={names[k]: str(v)[:_MAX_TAG] for k, v in tags.items()}
        )
        self.parent_run_id = run.info.run_id
        self._log_batch(self.parent_run_id, params=params, renamed=renamed)
        return self.parent_run_id

    def log_parent(
        self,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
        artifacts: list[Path] | None = None,
        artifact_path: str | None = None,
        step: int = 0,
        params: dict[str, Any] | None = None,
    ) -> None:
        """Queue metrics (at ``step``: a history such as the refit after each measurement), tags,
        params and artifacts for the parent run, after every trial queued before. MLflow never
        changes a logged param: one that already has another value (a resumed study found a
        better config) is set as the tag ``<name>.latest`` instead."""
        assert self.parent_run_id
        parent = self.parent_run_id
        step_metrics = [
            (k, float(v), step)
            for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        files = list(artifacts or [])
        # compared with what the run holds under the names MLflow keeps (mlflow_key)
        names, renamed = _mlflow_names("param", (params or {}).keys())
        new_params = {names[k]: str(v)[:_MAX_PARAM] for k, v in (params or {}).items()}

        def write(_: _Write) -> None:
            all_tags = dict(tags or {})
            fresh = new_params
            if new_params:
                logged = self.client.get_run(parent).data.params
                fresh = {k: v for k, v in new_params.items() if k not in logged}
                all_tags.update({f"{k}.latest": v for k, v in new_params.items() if k in logged and logged[k] != v})
            self._log_batch(parent, params=fresh, tags=all_tags, step_metrics=step_metrics, renamed=renamed)
            for path in files:
                if path.is_dir():
                    self.client.log_artifacts(parent, str(path), artifact_path)
                elif path.exists():
                    self.client.log_artifact(parent, str(path), artifact_path)

        self._submit(
            f"the parent run's {', '.join(sorted((metrics or {}) | (tags or {}))) or 'artifacts'}"[:120], write
        )

    def set_experiment_tags(self, tags: dict[str, str]) -> None:
        """Queue tags of the experiment itself (its description, the study's saved view), after
        every write queued before."""
        experiment_id = self.experiment_id

        def write(_: _Write) -> None:
            for key, value in tags.items():
                self.client.set_experiment_tag(experiment_id, key, value)

        self._submit(f"the experiment's {', '.join(sorted(tags))}"[:120], write)

    def finish_parent(self, status: str = "FINISHED") -> int:
        """Close the parent run after every queued write; waits at most ``drain_timeout_s``
        without progress (the server may be gone) and returns the number of writes left undone,
        which the next run of the same study writes (it reconciles MLflow with Optuna storage)."""
        if self.parent_run_id:
            parent = self.parent_run_id
            self._submit(
                f"the parent run's status {status}", lambda _: self.client.set_terminated(parent, status=status)
            )
        return self.flush(timeout=self.drain_timeout_s, retry_now=True)

    # ---- children ----------------------------------------------------------------------------
    def log_trial(
        self,
        number: int,
        params: dict[str, Any],
        metrics: dict[str, float],
        tags: dict[str, str],
        steps: list[dict[str, Any]] | None = None,
        artifacts: list[Path] | None = None,
        failed: bool = False,
    ) -> None:
        """Queue one finished trial as a child run."""
        assert self.parent_run_id
        parent = self.parent_run_id

        def write(attempt: _Write) -> None:
            self._log_trial(attempt, parent, number, params, metrics, tags, steps, artifacts, failed)

        self._submit(f"trial {number}", write)

    def _log_trial(
        self,
        attempt: _Write,
        parent: str,
        number: int,
        params: dict[str, Any],
        metrics: dict[str, float],
        tags: dict[str, str],
        steps: list[dict[str, Any]] | None,
        artifacts: list[Path] | None,
        failed: bool,
    ) -> None:
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
        names, renamed = _mlflow_names("tag", tags.keys())
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{number:04d}",
            tags={
                "mlflow.parentRunId": parent,
                "autotune.trial": str(number),
                **{names[k]: str(v)[:_MAX_TAG] for k, v in tags.items()},
            },
        )
        attempt.run_id = run_id = run.info.run_id
        step_metrics: list[tuple[str, float, int]] = []
        for i, event in enumerate(steps or []):
            for key in STEP_KEYS:
                value = event.get(key)
                if isinstance(value, (int, float)):
                    step_metrics.append((f"step/{key}", float(value), int(event.get("step", i))))
        self._log_batch(run_id, params=params, metrics=metrics, step_metrics=step_metrics, renamed=renamed, fresh=True)
        for path in artifacts or []:
            if path.exists():
                self.client.log_artifact(run_id, str(path))
        self.client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")
        attempt.run_id = None  # complete: nothing to clean up

    def _log_batch(
        self,
        run_id: str,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, str] | None = None,
        step_metrics: list[tuple[str, float, int]] | None = None,
        renamed: list[str] | None = None,
        fresh: bool = False,
    ) -> None:
        """One run's params, metrics and tags, every name made acceptable to MLflow (``mlflow_key``:
        one refused name would lose the whole write, and with it the trial's child run). The names
        changed, here or by the caller (``renamed``), are added to the run's ``RENAMED_TAG``, which
        keeps those of earlier writes (read from the run once, unless ``fresh``: a run just made)."""
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        p_names, p_renamed = _mlflow_names("param", (params or {}).keys())
        m_names, m_renamed = _mlflow_names(
            "metric", [*(metrics or {}).keys(), *(k for k, _, _ in (step_metrics or []))]
        )
        tags = dict(tags or {})
        t_names, t_renamed = _mlflow_names("tag", tags.keys())
        lines = [*(renamed or []), *p_renamed, *m_renamed, *t_renamed]
        tags = {t_names[k]: v for k, v in tags.items()}
        merged: list[str] | None = None
        if lines:
            known = [] if fresh else self._renamed.get(run_id)
            if known is None:
                known = self._renames_logged(run_id)
            merged = known + [line for line in lines if line not in known]
            if merged != known:
                text = "\n".join(merged)
                tags[RENAMED_TAG] = text if len(text) <= _MAX_TAG else text[: _MAX_TAG - 4] + "\n..."
        p = [Param(p_names[k], str(v)[:_MAX_PARAM]) for k, v in (params or {}).items()]
        m = [
            Metric(m_names[k], float(v), now, 0)
            for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        ]
        m += [Metric(m_names[k], v, now, s) for k, v, s in (step_metrics or []) if v == v]
        t = [RunTag(k, str(v)[:_MAX_TAG]) for k, v in tags.items()]
        # MLflow caps one batch at 100 params, 100 tags and 1000 metrics: split to stay inside
        chunks = max((len(p) + 99) // 100, (len(t) + 99) // 100, (len(m) + 999) // 1000, 1)
        for i in range(chunks):
            self.client.log_batch(
                run_id,
                metrics=m[i * 1000 : (i + 1) * 1000],
                params=p[i * 100 : (i + 1) * 100],
                tags=t[i * 100 : (i + 1) * 100],
            )
        if merged is not None and not fresh:  # written: later writes of this run only add to it
            self._renamed[run_id] = merged

    def _renames_logged(self, run_id: str) -> list[str]:
        """The lines of the run's ``RENAMED_TAG`` as stored (a resumed parent run's earlier names)."""
        try:
            text = self.client.get_run(run_id).data.tags.get(RENAMED_TAG, "")
        except Exception as exc:  # listed again by the next write that renames a name
            log.debug("reading %s of run %s failed: %s", RENAMED_TAG, run_id, exc)
            return []
        return [line for line in text.splitlines() if line and line != "..."]

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
    responses and retry histories, a warning needs what failed. A database error (SQLAlchemy's,
    wrapped by MLflow) is its driver's own message, e.g. ``sqlite3.OperationalError: database or
    disk is full``: SQLAlchemy's first line is often "(raised as a result of Query-invoked
    autoflush ...)", and the rest is the SQL statement."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:  # MlflowException(...) from sqlalchemy.exc.DBAPIError
        seen.add(id(cause))
        orig = getattr(cause, "orig", None)
        if isinstance(orig, BaseException) and str(orig).strip():
            first = str(orig).strip().splitlines()[0]
            text = f"{type(orig).__module__}.{type(orig).__name__}: {first}".removeprefix("builtins.")
            return text if len(text) <= limit else text[:limit] + "..."
        cause = cause.__cause__
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


# Loggers whose records are routed to autotune's debug log (``_store_logs_to_debug``)
_STORE_LOGGERS = ("mlflow.store", "sqlalchemy", "alembic")


class _DebugLog(logging.Handler):
    """Hands a record of MLflow's store, SQLAlchemy or Alembic to ``autotune.tracking.tracker`` at DEBUG,
    traceback included: wherever autotune's debug records are kept, the details still are."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            log.debug("%s: %s", record.name, record.getMessage(), exc_info=record.exc_info)
        except Exception:  # pragma: no cover - logging must never break a write
            pass


def _store_logs_to_debug() -> None:
    """Keep MLflow's store, SQLAlchemy and Alembic logging off the terminal.

    Why: when the SQLite store's disk fills up or its directory turns read-only mid-study, MLflow's
    ``mlflow.store.db.utils`` logs every failed write with ``logger.exception`` (at ERROR, so the
    CLI's quiet levels do not stop it) through its own stderr handler: two raw SQLAlchemy
    tracebacks with SQL statements, above autotune's own one-line message. Every such failure is
    already an exception the tracker handles (refused: one warning, ``error_line``, listed at the
    end; unreachable: offline), so these records go to autotune's debug log instead, traceback
    included. Idempotent (one handler per logger)."""
    for name in _STORE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _DebugLog) for h in logger.handlers):
            logger.addHandler(_DebugLog())
        logger.propagate = False
