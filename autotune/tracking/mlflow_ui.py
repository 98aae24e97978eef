"""MLflow's UI on a study: the link that opens its runs table as a user needs it, and the server.

What MLflow 3.17's UI reads, found in its own source (``mlflow/server/js/build/static/js``):

- The layout of every page under an experiment (the GenAI one, or "Machine learning" with its runs
  table; the run pages too) comes from the ``workflowType`` URL parameter (``genai`` |
  ``machine_learning``) of the page itself, else the browser's localStorage
  ``mlflow.workflowType_v1``, default ``genai`` (main.*.js, module 7975, the workflow-type context;
  its switcher is always enabled, module 89511 ``Z0``, so the experiment tag
  ``mlflow.experimentKind`` is not read any more). Only the sidebar's switch writes localStorage;
  the runs table's links to a run (3793.*.chunk.js, ``run_name_link``) carry no ``workflowType``,
  and nothing the server sends sets it. So every link autotune prints or writes carries
  ``workflowType=machine_learning`` (:data:`WORKFLOW`), and a page reached otherwise follows the
  browser's last switch.
- The runs table's state can be loaded from an experiment tag ``mlflow.sharedViewState.<key>``
  (a JSON object; the URL parameter ``viewStateShareKey=<key>``): the search facets
  ``searchFilter``, ``orderByKey``/``orderByAsc`` (a key such as ``metrics.`name```) and the UI state
  ``selectedColumns``, ``columnOrder``, ``columnWidths``, ``compareRunCharts``,
  ``compareRunSections``, ``isAccordionReordered``, ``groupBy``... (3878.*.chunk.js, main.*.js
  module 1395: the list of shareable keys; ``runsExpanded``, ``runsPinned``, ``runsHidden`` are never
  shared). The URL must then carry no search facet of its own, or the shared state is ignored.
- Parent and child runs: the table nests children under their parent only when it is sorted by
  creation time or neither sorted nor filtered (3878.*.chunk.js: ``nestChildren`` is
  ``!orderByKey && !searchFilter || orderByKey === "attributes.start_time"``), and a nested parent
  opens folded (``runsExpanded`` is not shared; the table unfolds by itself only the parents of
  ``mlflow.runType=evaluation`` runs, on a first visit). Sorted by an objective, every run is a
  row of its own.
- Metric cells show the logged value as it is: a metric column's ``valueFormatter`` comes from a
  map compiled into the bundle, empty in MLflow's build (3793.*.chunk.js module 57333 reads
  ``Ue.g[name].valueFormatter``, main.*.js module 13071 is ``const r={}``), and no shareable key
  sets a format or precision. The trials' figures are therefore logged exact, not rounded.
- Charts: the cards of ``compareRunCharts`` are kept in their order; metrics without a card are
  appended to a section marked ``isReordered`` (alphabetically otherwise).
- Descriptions: the tag ``mlflow.note.content`` of a run or of the experiment (Markdown).

So a study writes its view as the experiment tag ``mlflow.sharedViewState.autotune``
(:func:`study_view_state`, written by :mod:`autotune.tracking.study_tracking`) and :func:`study_ui_url`
links to it: the study's runs as rows (its trials, and the parent run with the study's
description, plots and exports, last: it has no trial figures), sorted by the first objective,
the objectives (and a serving study's decision figures and layout), status and searched params as
the first columns, and the objectives as the first charts. MLflow says "You're viewing a shared
view" above the table; its "Exit shared view" returns to the user's own view.

This module imports neither MLflow nor Rich at import time (the CLI imports it inside a command).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlencode

from autotune.objectives import DECISION_METRICS

__all__ = [
    "VIEW_KEY",
    "VIEW_TAG",
    "STUDY_FILTER",
    "SERVING_METRICS",
    "SERVING_PARAMS",
    "NoMlflowStore",
    "study_view_state",
    "study_ui_url",
    "parent_run_ui_url",
    "run_ui_path",
    "serve_ui",
    "running_ui",
    "server_command",
    "server_url",
]

VIEW_KEY = "autotune"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
WORKFLOW = {"workflowType": "machine_learning"}  # the runs table, not the GenAI overview
_SECTION = "autotune-model-metrics"  # the uuid of the charts' first section, "Model metrics"
_MAX_TAG = 20000  # MLflow's limit on an experiment tag's value (mlflow.utils.validation)
_MAX_PARAM_COLUMNS = 24
_PARALLEL_PARAMS = 8  # a parallel-coordinates chart stays readable with this many axes
# the study's runs: its parent and its trials carry the tag (autotune.tracking.study_tracking); MLflow's
# search has no OR, and no other tag is shared by a parent run and its children
STUDY_FILTER = "tags.`autotune.backend` LIKE '%'"
# what a serving study's decision reads (autotune.objectives.DECISION_METRICS["serve"]), and its layout
_COST = "cost_per_million_output_tokens"
SERVING_METRICS = DECISION_METRICS["serve"]
SERVING_PARAMS = ("replicas", "tp")


class NoMlflowStore(FileNotFoundError):
    """The run directory has no MLflow store to show."""


def _key(kind: str, name: str) -> str:
    """MLflow's canonical column and sort key (``metrics.`name```)."""
    return f"{kind}.`{name}`"


def study_view_state(
    objectives: Sequence[tuple[str, str]],
    params: Sequence[str],
    *,
    status_tag: str = "autotune.status",
    second_axis: str | None = None,
    workload: str = "train",
    priced: bool = False,
) -> dict[str, Any]:
    """The runs table and charts of one study, as MLflow's shared view state.

    ``objectives``: (metric, "maximize"|"minimize") pairs, the first sorts the table; ``params``:
    the searched params (MLflow-valid names) in the order the columns should show them;
    ``second_axis``: a metric set against the first objective in a scatter chart when there is
    one objective (with two, they are the scatter's axes). A serving study (``workload`` "serve")
    shows the figures its decision reads (:data:`SERVING_METRICS`, the cost only when ``priced``:
    the cluster has a cost per device hour) and its layout (:data:`SERVING_PARAMS`) after the
    objectives, before the status and the other params."""
    metrics = [m for m, _ in objectives]
    first, direction = objectives[0]
    searched = params = list(dict.fromkeys(params))
    shown = list(metrics)
    layout: list[str] = []
    if workload == "serve":
        shown += [m for m in SERVING_METRICS if m not in shown and (priced or m != _COST)]
        layout = list(SERVING_PARAMS)
        params = [p for p in params if p not in layout]
    params = params[: max(0, _MAX_PARAM_COLUMNS - len(layout))]
    leading = [_key("metrics", m) for m in shown] + [_key("params", p) for p in layout]
    columns = leading + [_key("tags", status_tag)] + [_key("params", p) for p in params]
    widths = {_key("metrics", m): 190 if m in metrics else _width(m) for m in shown}
    charts: list[dict[str, Any]] = []

    def card(uuid: str, kind: str, **fields: Any) -> None:
        charts.append(
            {
                "uuid": f"autotune-{uuid}",
                "type": kind,
                "runsCountToCompare": fields.pop("runsCountToCompare", 10),
                "metricSectionId": _SECTION,
                "deleted": False,
                "isGenerated": True,
                **fields,
            }
        )

    for i, m in enumerate(metrics):
        card(f"objective-{i}", "BAR", metricKey=m, displayName=m)
    y = metrics[1] if len(metrics) > 1 else second_axis
    if y and y != first:
        card(
            "scatter",
            "SCATTER",
            runsCountToCompare=100,
            xaxis={"key": y, "type": "METRIC"},
            yaxis={"key": first, "type": "METRIC"},
        )
    if searched:
        card(
            "parallel",
            "PARALLEL",
            selectedParams=searched[:_PARALLEL_PARAMS],
            selectedMetrics=metrics[:2],
            showAllRuns=True,
        )
    state: dict[str, Any] = {
        # the study's runs, each a row of its own (sorted by a metric, MLflow folds no child
        # under its parent): the trials, and the parent run with the study's plots, last (it has
        # no trial figures, and runs without the sort key come last). Every run autotune writes
        # carries the tag; in a run directory's store the experiment holds this one study.
        "searchFilter": STUDY_FILTER,
        "orderByKey": _key("metrics", first),
        "orderByAsc": direction == "minimize",
        "selectedColumns": columns,
        "columnOrder": columns,
        "columnWidths": widths,
        "compareRunCharts": charts,
        "compareRunSections": [{"uuid": _SECTION, "name": "Model metrics", "display": True, "isReordered": True}],
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
    }
    while len(json.dumps(state)) > _MAX_TAG and len(state["selectedColumns"]) > len(leading) + 1:
        state["selectedColumns"] = state["columnOrder"] = state["selectedColumns"][:-1]
    return state


def _width(metric: str) -> int:
    """A column wide enough for the metric's name in the header (MLflow's default is 100 px)."""
    return max(120, min(280, 8 * len(metric) + 40))


def _connect(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)


def _store(run_dir: Path) -> Path:
    db = Path(run_dir) / "mlflow.db"
    if not db.is_file():
        raise NoMlflowStore(
            f"{run_dir} has no MLflow store (no mlflow.db): it is not a run directory of `autotune run`, "
            "or the study ran with --no-tracking or a tracking server of its own (open that server instead)"
        )
    return db


def _study_experiment(db: Path) -> tuple[str, bool]:
    """The experiment id of the study in ``db`` and whether it carries the study's view: the
    active experiment with the view tag, else the one with the latest run (autotune's runs; not
    MLflow's empty "Default")."""
    with contextlib.closing(_connect(db)) as conn:
        rows = conn.execute(
            "SELECT e.experiment_id, "
            " EXISTS(SELECT 1 FROM experiment_tags t WHERE t.experiment_id = e.experiment_id AND t.key = ?),"
            " (SELECT MAX(r.start_time) FROM runs r WHERE r.experiment_id = e.experiment_id) "
            "FROM experiments e WHERE e.lifecycle_stage = 'active'",
            (VIEW_TAG,),
        ).fetchall()
    if not rows:
        raise NoMlflowStore(f"the MLflow store {db} holds no experiment")
    exp_id, has_view, _ = max(rows, key=lambda r: (bool(r[1]), r[2] or 0, int(r[0])))
    return str(exp_id), bool(has_view)


def study_ui_url(run_dir: Path, base_url: str) -> str:
    """The URL, on the MLflow server at ``base_url``, of the study's runs table: its trials sorted
    by the first objective, with the objectives, status and searched params as columns (the view
    the study saved, :func:`study_view_state`); a store written before such views were saved
    opens on its experiment's runs table. Reads the run directory's store without MLflow."""
    exp_id, has_view = _study_experiment(_store(Path(run_dir)))
    query = {**WORKFLOW, "viewStateShareKey": VIEW_KEY} if has_view else WORKFLOW
    return f"{base_url.rstrip('/')}/#/experiments/{exp_id}/runs?{urlencode(query)}"


def run_ui_path(experiment_id: str, run_id: str) -> str:
    """The path (after ``#``) of a run's page in the "Machine learning" layout."""
    return f"/experiments/{experiment_id}/runs/{run_id}?{urlencode(WORKFLOW)}"


def parent_run_ui_url(run_dir: Path, base_url: str) -> str | None:
    """The URL of the study's parent run (its description, plots and exports) on the MLflow
    server at ``base_url``, in the "Machine learning" layout; None when the store has none.
    Reads the run directory's store without MLflow."""
    db = _store(Path(run_dir))
    exp_id, _ = _study_experiment(db)
    with contextlib.closing(_connect(db)) as conn:
        row = conn.execute(
            "SELECT r.run_uuid FROM runs r WHERE r.experiment_id = ? AND r.lifecycle_stage = 'active'"
            " AND EXISTS(SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'autotune.study')"
            " AND NOT EXISTS(SELECT 1 FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'mlflow.parentRunId')"
            " ORDER BY r.start_time DESC LIMIT 1",
            (exp_id,),
        ).fetchone()
    return f"{base_url.rstrip('/')}/#{run_ui_path(exp_id, row[0])}" if row else None


# ---- the server ---------------------------------------------------------------------------------
def server_command(run_dir: Path, host: str, port: int) -> list[str]:
    """``mlflow server`` on the run directory's store: one worker, no job runner (MLflow's defaults
    start 15 processes and 2.3 GB), artifacts served from the run directory's ``mlartifacts``."""
    from .tracker import default_tracking_uri

    run_dir = Path(run_dir)
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        default_tracking_uri(run_dir),
        "--artifacts-destination",
        str((run_dir / "mlartifacts").resolve()),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def server_url(host: str, port: int) -> str:
    """The base URL a browser on this machine opens for a server listening on ``host``:``port``
    (a wildcard address is reached on loopback; an IPv6 address goes in brackets)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_taken(host: str, port: int) -> bool:
    """Whether a server could not listen on ``host``:``port``. Checked as the server binds
    (uvicorn sets SO_REUSEADDR on POSIX): the connections a stopped server left in TIME_WAIT do not
    hold the port, a socket listening on it does."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        if os.name == "posix":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


@contextlib.contextmanager
def running_ui(
    run_dir: Path,
    host: str = "127.0.0.1",
    port: int = 5000,
    *,
    timeout_s: float = 180.0,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An MLflow server on the run directory's store while the block runs: yields (base URL,
    process) once it answers, stops it on the way out. ``port`` 0 takes a free port.
    ``progress(text)`` is told what it waits for (the server starts in 3-15 s)."""
    run_dir = Path(run_dir)
    _store(run_dir)
    from .tracker import relocate_artifacts

    moved = relocate_artifacts(run_dir)
    if moved and progress:
        progress(moved)
    if port == 0:
        port = _free_port(host)
    elif _port_taken(host, port):
        raise OSError(f"port {port} on {host} is in use (another MLflow UI?): pass another --port")
    base = server_url(host, port)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    fd, name = tempfile.mkstemp(prefix="autotune-mlflow-ui-", suffix=".log")
    log_path = Path(name)
    proc: subprocess.Popen[bytes] | None = None
    try:
        with os.fdopen(fd, "wb") as log_file:
            proc = subprocess.Popen(
                server_command(run_dir, host, port),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: Ctrl-C reaches autotune, which stops it
            )
        started = time.monotonic()
        if progress:
            progress(f"waiting for {base} to answer")
        while not _answers(base):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server stopped (exit code {proc.returncode}) before answering on {base}:\n"
                    f"{_tail(log_path)}"
                )
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(
                    f"mlflow server did not answer on {base} within {timeout_s:.0f} s:\n{_tail(log_path)}"
                )
            time.sleep(0.25)
        yield base, proc
    finally:
        if proc is not None:
            # SIGTERM to its process group (mlflow server runs uvicorn as its child), SIGKILL to
            # what is left after the grace
            from ..workers.process_group import kill_group

            kill_group(proc, grace_s=10.0)
        log_path.unlink(missing_ok=True)


def serve_ui(
    run_dir: Path,
    host: str = "127.0.0.1",
    port: int = 5000,
    open_browser: bool = False,
    on_ready: Callable[[str], None] = print,
) -> int:
    """Start MLflow's UI on the run directory's store, call ``on_ready(url)`` with the study's URL
    (:func:`study_ui_url`) once the server answers, open it in a browser if asked, and block until
    Ctrl-C or SIGTERM; the server is stopped on the way out. Returns 0 after Ctrl-C/SIGTERM, 1 when
    the server stopped by itself. Raises :class:`NoMlflowStore` for a run directory without a
    store, ``OSError`` for a port in use, ``RuntimeError``/``TimeoutError`` for a server that did
    not start."""
    from rich.console import Console

    from .progress import phase

    run_dir = Path(run_dir)
    _store(run_dir)
    previous = None
    if threading.current_thread() is threading.main_thread():

        def _terminate(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        console = Console(stderr=True)
        with contextlib.ExitStack() as stack:
            with phase(console, f"starting MLflow's UI on {host}:{port or 'a free port'}") as p:
                base, proc = stack.enter_context(running_ui(run_dir, host, port, progress=p.update))
            url = study_ui_url(run_dir, base)
            on_ready(url)
            parent = parent_run_ui_url(run_dir, base)
            if parent:
                console.print(
                    f"the study's parent run (description, plots, exports): {parent}", markup=False, soft_wrap=True
                )
            if open_browser:
                import webbrowser

                webbrowser.open(url)
            code = proc.wait()
            console.print(f"mlflow server stopped by itself (exit code {code})", markup=False)
            return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
