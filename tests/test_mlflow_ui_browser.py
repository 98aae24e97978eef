"""MLflow's UI on a study, in a real browser (issue #34): ``serve_ui`` starts ``mlflow server`` on
loopback, headless Debian Chromium (Playwright, never a downloaded browser) opens the study's URL,
and the rendered runs table shows the objective column and the trials as rows, the best first.
Screenshots are kept under ``$AUTOTUNE_TEST_ARTIFACTS`` (default: the test's tmp_path). Slow: a
simulated study, a server start and a browser take 20-40 s."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
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


def test_the_study_opens_on_its_runs_table_with_the_objective_in_chromium(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium package: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

    run_dir = tmp_path / "study"
    result = CliRunner().invoke(app, ["run", str(SPEC), "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    (parent,), children = mlflow_runs(run_dir, "llama2-7b-8npu")
    best = int(parent.data.tags["autotune.best_trial"])

    port = free_port()
    code = "import sys; from pathlib import Path; from autotune.mlflow_ui import serve_ui; "
    code += "sys.exit(serve_ui(Path(sys.argv[1]), port=int(sys.argv[2])))"
    server = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    shots = _artifacts(tmp_path)
    try:
        url = _first_line(server, timeout_s=180)
        assert url.startswith(f"http://127.0.0.1:{port}/#/experiments/") and "viewStateShareKey=autotune" in url
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.goto(url)
                header = page.locator(".ag-header-cell", has_text=OBJECTIVE).first
                header.wait_for(state="visible", timeout=60_000)
                page.locator(".ag-row", has_text="trial-").first.wait_for(state="visible", timeout=60_000)
                page.wait_for_timeout(1000)  # the last cells settle
                page.screenshot(path=str(shots / "mlflow_ui_runs_table.png"))
                names = page.locator(".ag-pinned-left-cols-container .ag-row, .ag-center-cols-container .ag-row")
                rows = [t for t in names.all_inner_texts() if "trial-" in t]
                assert rows, "no trial row in the runs table"
                # the trials are rows of their own (not folded under the parent), the best first
                first = page.locator('.ag-row[row-index="0"]').all_inner_texts()
                assert any(f"trial-{best:04d}" in t for t in first), first
                assert not any(parent.info.run_name in t for t in rows)
                count = page.get_by_text(f"{len(children)} matching runs")
                assert count.count() >= 1
                # the charts a user opens first: the objective's
                page.goto(url + "&compareRunsMode=CHART")
                page.get_by_text("Model metrics").first.wait_for(state="visible", timeout=60_000)
                page.wait_for_timeout(2000)
                page.screenshot(path=str(shots / "mlflow_ui_charts.png"))
            finally:
                browser.close()
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
        s.bind(("127.0.0.1", port))
