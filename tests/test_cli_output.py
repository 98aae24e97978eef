"""What ``run`` and ``report`` print (issue #34): a two-objective study shows both objectives and
the Pareto front of them, summaries without a baseline say so (no "None", no ``- ->`` rows),
``report`` fits a 120-column terminal with one predicted figure per row, optuna-dashboard gets
the metric names and the report says why its importances differ, and ``best.env`` says which
settings were chosen and which are defaults the model could not tell apart."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import optuna
import pytest
from rich.console import Console
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.study.records import TrialRecord
from autotune.finish.report_table import print_report_table
from autotune.finish.run_output import WIDTH
from support import REPO

runner = CliRunner()
INFER = REPO / "search_spaces" / "llama2_7b_infer_8npu.yaml"  # decode_tokens_per_s_per_device max, ttft_ms min
TRAIN = REPO / "search_spaces" / "llama2_7b_8npu.yaml"  # allocator / HCCL env knobs the model cannot price


@pytest.fixture(scope="module")
def infer_study(tmp_path_factory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("infer") / "run"
    result = runner.invoke(app, ["run", str(INFER), "--run-dir", str(run_dir), "--no-tracking"])
    assert result.exit_code == 0, result.output
    return run_dir, result


@pytest.fixture(scope="module")
def train_study(tmp_path_factory) -> tuple[Path, object]:
    run_dir = tmp_path_factory.mktemp("train") / "run"
    result = runner.invoke(app, ["run", str(TRAIN), "--run-dir", str(run_dir), "--no-tracking", "--n-trials", "8"])
    assert result.exit_code == 0, result.output
    return run_dir, result


def test_two_objectives_show_both_and_their_pareto_front(infer_study):
    run_dir, result = infer_study
    text = result.stdout
    header = next(line for line in text.splitlines() if line.lstrip().startswith("trial "))
    assert "decode_tokens_per_s" in header and "ttft_ms" in header
    assert "Pareto front of decode_tokens_per_s_per_device (higher is better) and ttft_ms (lower is better)" in text
    assert "speed against memory headroom" not in text and "best trial" not in text
    summary = json.loads((run_dir / "summary.json").read_text())
    front = {p["trial"] for p in summary["pareto_front"]}
    assert len(front) >= 2
    marked = {int(line.split()[1]) for line in text.splitlines() if line.startswith("* ")}
    assert marked == front  # every member of the front shown and marked, no other
    assert "Pareto-optimal trials" in text
    listed = {int(m.group(1)) for m in re.finditer(r"^  trial (\d+): ", text, re.M)}
    assert listed == front
    assert "writing the results, plots, exports" in result.stderr  # a phase that announces itself
    # the next steps name the study's journal for optuna-dashboard
    assert f"optuna-dashboard {run_dir / 'optuna.journal'}" in result.stderr


def test_summary_without_a_baseline_says_so(infer_study):
    run_dir, _ = infer_study
    md = (run_dir / "summary.md").read_text()
    assert "None" not in md and "- ->" not in md
    assert "no baseline in the spec" in md
    assert all(len(line) <= WIDTH for line in md.splitlines())


def test_optuna_study_names_its_metrics_and_report_explains_importances(infer_study):
    run_dir, _ = infer_study
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal"))
    )
    study = optuna.load_study(study_name="llama2-7b-infer-8npu", storage=storage)
    assert study.metric_names == ["decode_tokens_per_s_per_device", "ttft_ms"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # no figure is attributed to optuna-dashboard: it computes its own (issue 40)
    assert "importances_dashboard" not in summary
    note = summary["importances_note"]
    assert "variance share over 32 feasible configs" in note and "optuna-dashboard" in note  # batch is no knob
    report = runner.invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 0, report.output
    assert "optuna-dashboard's (" not in report.stdout and "its figures are not these" in " ".join(
        report.stdout.split()
    )
    assert "the model's best bets" in " ".join(report.stdout.split())


def test_metric_names_set_on_a_resumed_study_written_without_them(infer_study, tmp_path):
    from autotune.spec.load import load_spec
    from autotune.study.storage import open_study

    spec = load_spec(INFER)
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "optuna.journal"))
    )
    optuna.create_study(study_name=spec.name, storage=storage, directions=["maximize", "minimize"])
    assert open_study(spec, tmp_path, create=False).metric_names is None  # reading writes nothing
    assert open_study(spec, tmp_path).metric_names == ["decode_tokens_per_s_per_device", "ttft_ms"]
    journal = tmp_path / "optuna.journal"
    assert journal.read_text().count("metric_names") == 1
    open_study(spec, tmp_path)
    assert journal.read_text().count("metric_names") == 1  # named once, not again on every resume


@pytest.mark.parametrize("which", ["infer", "train"])
def test_report_fits_120_columns_and_cuts_no_word(which, infer_study, train_study):
    run_dir, _ = infer_study if which == "infer" else train_study
    report = runner.invoke(app, ["report", str(run_dir)], env={"COLUMNS": "200"})
    assert report.exit_code == 0, report.output
    lines = report.stdout.splitlines()
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    assert sum(line.startswith("trial ") for line in lines) == 1  # one header line where the names fit
    why = [line for line in lines if "why chosen:" in line]
    assert why and all("rank " in line or "baseline from the spec" in line for line in why)
    if which == "train":  # the knobs the model prices alike in speed: said once, not on every row
        assert sum("priced alike in speed by the model, its roomiest" in line for line in lines) == 1


def _record(number: int, metric: float, guided: float | None, why: str) -> TrialRecord:
    predicted = {"tokens_per_s_per_device": 1190.0, "peak_memory_gib": 30.0}
    if guided is not None:
        predicted |= {"guided_tokens_per_s_per_device": guided, "guided_tokens_per_s_per_device_sd": 30.0}
    return TrialRecord(
        number=number,
        state="COMPLETE",
        config={"tp": 2, "pp": 1, "micro_batch_size": 4, "env.HCCL_BUFFSIZE": "200"},
        status="ok",
        source="measured",
        metrics={"tokens_per_s_per_device": metric, "peak_memory_gib": 31.5},
        predicted=predicted,
        reason="",
        probed=True,
        baseline=False,
        chosen_because=why,
        values=[metric],
        feasible=True,
    )


def test_report_shows_one_predicted_figure_per_row():
    why = (
        "exploration: new tp/pp/zero/recompute family (tp=2, pp=1); rank 3 by model refit after 4 measured; "
        "predicted 693.6 ± 30, P(fits) 0.97"
    )
    records = [_record(5, 701.0, 693.6, why), _record(2, 650.0, None, "rank 1 by model")]
    rows = [{"trial": 5}, {"trial": 2}]
    console = Console(record=True, width=300, highlight=False, soft_wrap=True)
    print_report_table(console, rows, records, [("tokens_per_s_per_device", "maximize")], top=20)
    text = console.export_text()
    assert "694 ± 30" in text and "693.6" not in text  # the guide's prediction, in its column only
    assert "P(fits) 0.97" in text and "rank 3 by model refit after 4 measured" in text
    row2 = next(line for line in text.splitlines() if line.startswith("2 "))
    assert "1,190" in row2  # no guide: the model's prediction
    assert all(len(line) <= WIDTH for line in text.splitlines())


def test_a_trial_its_memory_profile_ended_reads_profiled_not_measured():
    """An ``oom_predicted`` trial ran its memory profile only: its row says "profiled" beside the
    guide's predicted figure, where "measured" read like a reading; the record keeps its source."""
    from dataclasses import replace

    ended = replace(_record(7, 0.0, 720.0, "rank 2 by model"), status="oom_predicted", metrics={})
    records = [_record(5, 701.0, 693.6, "rank 1 by model"), ended]
    console = Console(record=True, width=300, highlight=False, soft_wrap=True)
    print_report_table(console, [{"trial": 5}, {"trial": 7}], records, [("tokens_per_s_per_device", "maximize")], 20)
    lines = console.export_text().splitlines()
    assert "profiled" in next(line for line in lines if line.startswith("7 "))
    assert "measured" in next(line for line in lines if line.startswith("5 "))
    assert ended.source == "measured"


def test_a_serving_trial_whose_client_fell_behind_is_said_under_the_table():
    """A trial whose load generator could not send on time in some rate runs (a client starved of
    the host's cores) is named under the table, with what it means; one that kept up is not."""
    from dataclasses import replace

    fine = replace(_record(5, 701.0, None, "rank 1 by model"), metrics={"tokens_per_s_per_device": 701.0})
    behind = replace(fine, number=7, metrics={"tokens_per_s_per_device": 650.0, "load_generator_behind_runs": 2.0})
    console = Console(record=True, width=300, highlight=False, soft_wrap=True)
    print_report_table(
        console, [{"trial": 5}, {"trial": 7}], [fine, behind], [("tokens_per_s_per_device", "maximize")], 20
    )
    text = console.export_text()
    assert "! trial(s) 7: the load generator fell behind" in text and "trial(s) 5" not in text
    assert all(len(line) <= WIDTH for line in text.splitlines())
    console = Console(record=True, width=300, highlight=False, soft_wrap=True)
    print_report_table(console, [{"trial": 5}], [fine], [("tokens_per_s_per_device", "maximize")], 20)
    assert "load generator" not in console.export_text()


def test_best_env_says_which_settings_are_defaults_and_stays_sourceable(train_study):
    run_dir, _ = train_study
    env_file = run_dir / "export" / "best.env"
    text = env_file.read_text()
    exports = [line for line in text.splitlines() if line.startswith("export ")]
    # the allocator and HCCL settings the model prices in memory only: its roomiest, said as a
    # default that no measured speed chose (issue 40: "not distinguished" only where priced alike)
    for name in ("HCCL_BUFFSIZE", "PYTORCH_NPU_ALLOC_CONF", "MULTI_STREAM_MEMORY_REUSE"):
        line = next(line for line in exports if line.startswith(f"export {name}="))
        assert "# default: the model prices" in line and "took its roomiest (probe to choose)" in line
    assert "# defaults the model could not distinguish" in text
    env = subprocess.run(
        ["bash", "-c", f"set -a; . {env_file}; env"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for line in exports:
        name, value = line[len("export ") :].split("  #", 1)[0].split("=", 1)
        assert f"{name}={value.strip(chr(39))}" in env


def test_best_env_of_a_searched_setting_the_model_prices():
    from autotune.export import ExportContext
    from autotune.export._env import EnvExporter

    record = _record(
        1, 700.0, None, "rank 1 by model; not distinguished by the model (probe to choose): precision bf16|fp16"
    )
    ctx = ExportContext.from_record("s", record, searched={"env.HCCL_BUFFSIZE", "tp"})
    text = EnvExporter().render(ctx)
    assert "export HCCL_BUFFSIZE=200  # searched; trial 1 measured with it" in text
    assert "# measured to matter or set by the spec: HCCL_BUFFSIZE" in text
    ctx = ExportContext.from_record("s", record, searched={"tp"})
    assert "# set by the spec (not searched)" in EnvExporter().render(ctx)


def test_ui_command_calls_the_mlflow_ui_module(tmp_path, monkeypatch):
    """``autotune ui RUN_DIR`` hands the run directory, host, port and --open to
    :func:`autotune.tracking.mlflow_ui.serve_ui`, prints the URL it is given, and exits with its code;
    ``--print-url`` only asks :func:`~autotune.tracking.mlflow_ui.study_ui_url`."""
    import sys
    import types

    calls = {}

    def serve_ui(run_dir, host="127.0.0.1", port=5000, open_browser=False, on_ready=print):
        calls["serve"] = (run_dir, host, port, open_browser)
        on_ready("http://127.0.0.1:5055/#/experiments/1")
        return 0

    def study_ui_url(run_dir, base_url):
        calls["url"] = (run_dir, base_url)
        return f"{base_url}/#/experiments/1"

    from autotune.tracking.mlflow_ui import server_url  # the real one: a pure function of host and port

    fake = types.ModuleType("autotune.tracking.mlflow_ui")
    fake.serve_ui, fake.study_ui_url, fake.server_url = serve_ui, study_ui_url, server_url
    monkeypatch.setitem(sys.modules, "autotune.tracking.mlflow_ui", fake)
    result = runner.invoke(app, ["ui", str(tmp_path), "--port", "5055", "--open"])
    assert result.exit_code == 0, result.output
    assert calls["serve"] == (tmp_path.resolve(), "127.0.0.1", 5055, True)
    assert "http://127.0.0.1:5055/#/experiments/1" in result.stdout
    result = runner.invoke(app, ["ui", str(tmp_path), "--print-url", "--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    assert calls["url"] == (tmp_path.resolve(), "http://127.0.0.1:5000")
    assert result.stdout.strip() == "http://127.0.0.1:5000/#/experiments/1"
    missing = runner.invoke(app, ["ui", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such run directory" in missing.stderr
