"""MLflow's UI on a study, in a real browser (issues #34, #40): ``serve_ui`` starts ``mlflow server``
on loopback, headless Debian Chromium (Playwright, never a downloaded browser) opens the study's
URL, and the rendered runs table shows the objective column and the trials as rows, the best
first, and the parent run last; the parent run's link opens MLflow's "Machine learning" layout; a
serving study's table shows its decision's columns first. Screenshots are kept under
``$AUTOTUNE_TEST_ARTIFACTS`` (default: the test's tmp_path). Slow: a simulated study, a server
start and a browser take 20-60 s each."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import free_port, mlflow_runs

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
# as root, in a closed network (docs: the machine's notes on Chromium)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OBJECTIVE = "tokens_per_s_per_device"
SPEC = Path(__file__).resolve().parent.parent / "search_spaces" / "llama2_7b_8npu.yaml"
SERVE_SPEC = SPEC.with_name("llama2_7b_serve_8npu.yaml")  # its cluster has a price: cost is logged
SERVING_COLUMNS = [
    "goodput_rps_per_device",
    "max_rate_rps",
    "slo_attainment",
    "ttft_p99_ms",
    "tpot_p99_ms",
    "cost_per_million_output_tokens",
    "replicas",
    "tp",
]


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("AUTOTUNE_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line the process prints on stdout that is a URL (serve_ui's ``on_ready``)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith("http"):
            return line.strip()
    raise AssertionError(f"serve_ui printed no URL (exit code {proc.poll()})")


def _browser_or_skip():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package: apt-get install -y chromium)")
    return pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")


def _study(tmp_path: Path, spec: Path) -> Path:
    run_dir = tmp_path / "study"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    return run_dir


@contextlib.contextmanager
def _served(run_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """``serve_ui`` in a process of its own: yields the study's URL (its stdout) and the parent
    run's (its stderr); stopped as Ctrl-C or a service manager does, it must return 0 and free
    the port."""
    port = free_port()
    code = "import sys; from pathlib import Path; from autotune.tracking.mlflow_ui import serve_ui; "
    code += "sys.exit(serve_ui(Path(sys.argv[1]), port=int(sys.argv[2])))"
    errors = tmp_path / "serve_ui.stderr"
    with errors.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-c", code, str(run_dir), str(port)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            env={**os.environ, "COLUMNS": "400"},
        )
    try:
        url = _first_line(server, timeout_s=180)
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/") and "viewStateShareKey=autotune" in url
        assert "workflowType=machine_learning" in url
        parent = ""
        for _ in range(50):  # printed right after the study's URL
            parent = next((w for w in errors.read_text().split() if w.startswith("http") and "/runs/" in w), "")
            if parent:
                break
            time.sleep(0.1)
        assert parent.endswith("?workflowType=machine_learning"), errors.read_text()
        yield url, parent
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # what Ctrl-C or a service manager sends
        try:
            returncode = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    assert returncode == 0  # serve_ui stopped the server and returned cleanly
    import socket

    with socket.socket() as s:  # the server is gone with it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _launch(p):
    return p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)


def _headers(page) -> list[str]:
    """The runs table's column headers right of its pinned ones (the run's name, its creation
    time), in their order, all of them: the grid renders only the columns in view, so it is
    scrolled across."""
    seen: dict[int, str] = {}
    viewport = page.locator(".ag-body-horizontal-scroll-viewport").first
    width = viewport.evaluate("e => e.scrollWidth")
    for left in range(0, int(width) + 400, 400):
        viewport.evaluate("(e, x) => { e.scrollLeft = x }", left)
        page.wait_for_timeout(200)
        for cell in page.locator(".ag-header-viewport .ag-header-row-column .ag-header-cell").all():
            index, text = cell.get_attribute("aria-colindex"), cell.inner_text().strip()
            if index and text:
                seen[int(index)] = text
    viewport.evaluate("e => { e.scrollLeft = 0 }")
    return [seen[i] for i in sorted(seen)]


def test_the_study_opens_on_its_runs_table_with_the_objective_in_chromium(tmp_path):
    sync_api = _browser_or_skip()
    run_dir = _study(tmp_path, SPEC)
    (parent,), children = mlflow_runs(run_dir, "llama2-7b-8npu")
    best = int(parent.data.tags["autotune.best_trial"])
    shots = _artifacts(tmp_path)
    with _served(run_dir, tmp_path) as (url, parent_url):
        assert (
            parent_url.split("#")[1]
            == f"/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}?workflowType=machine_learning"
        )
        with sync_api.sync_playwright() as p:
            browser = _launch(p)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1400})
                page.goto(url)
                header = page.locator(".ag-header-cell", has_text=OBJECTIVE).first
                header.wait_for(state="visible", timeout=60_000)
                page.locator(".ag-row", has_text="trial-").first.wait_for(state="visible", timeout=60_000)
                page.wait_for_timeout(1000)  # the last cells settle
                page.screenshot(path=str(shots / "mlflow_ui_runs_table.png"))
                names = page.locator(".ag-pinned-left-cols-container .ag-row")
                rows = [t for t in names.all_inner_texts() if "trial-" in t or parent.info.run_name in t]
                assert rows, "no trial row in the runs table"
                # the trials are rows of their own (not folded under the parent), the best first
                first = page.locator('.ag-row[row-index="0"]').all_inner_texts()
                assert any(f"trial-{best:04d}" in t for t in first), first
                # the parent run (the study's description and plots) is in the table too, last
                assert len(rows) == len(children) + 1, rows
                parent_row = names.filter(has_text=parent.info.run_name).first
                assert parent_row.get_attribute("row-index") == str(len(children))
                count = page.get_by_text(f"{len(children) + 1} matching runs")
                assert count.count() >= 1
                # the charts a user opens first: the objective's
                page.goto(url + "&compareRunsMode=CHART")
                page.get_by_text("Model metrics").first.wait_for(state="visible", timeout=60_000)
                page.wait_for_timeout(2000)
                page.screenshot(path=str(shots / "mlflow_ui_charts.png"))
                # the parent run's link opens in the "Machine learning" layout (its sidebar lists
                # the experiment's Runs; the GenAI one lists Overview, Observability, ...), in a
                # fresh browser context (nothing in localStorage)
                fresh = browser.new_context(viewport={"width": 1600, "height": 1000})
                run_page = fresh.new_page()
                run_page.goto(parent_url)
                run_page.get_by_text("About this run").first.wait_for(state="visible", timeout=60_000)
                sidebar = run_page.locator("aside").first.inner_text()
                run_page.screenshot(path=str(shots / "mlflow_ui_parent_run.png"))
                assert "Runs" in sidebar.split() and "Observability" not in sidebar, sidebar
            finally:
                browser.close()


def test_a_serving_study_shows_its_decision_columns_first_in_chromium(tmp_path):
    sync_api = _browser_or_skip()
    run_dir = _study(tmp_path, SERVE_SPEC)
    (parent,), children = mlflow_runs(run_dir, "llama2-7b-serve-8npu")
    assert all("cost_per_million_output_tokens" in c.data.metrics for c in children if c.data.metrics)
    shots = _artifacts(tmp_path)
    with _served(run_dir, tmp_path) as (url, _):
        with sync_api.sync_playwright() as p:
            browser = _launch(p)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.goto(url)
                page.locator(".ag-header-cell", has_text="goodput_rps_per_device").first.wait_for(
                    state="visible", timeout=60_000
                )
                page.locator(".ag-row", has_text="trial-").first.wait_for(state="visible", timeout=60_000)
                page.wait_for_timeout(1000)
                page.screenshot(path=str(shots / "mlflow_ui_serving_runs_table.png"))
                headers = _headers(page)
                # after the run's name and creation time: the decision's figures, then its layout
                assert headers[: len(SERVING_COLUMNS)] == SERVING_COLUMNS, headers
                assert "autotune.status" in headers and "max_num_seqs" in headers
                assert page.get_by_text(f"{len(children) + 1} matching runs").count() >= 1
            finally:
                browser.close()
