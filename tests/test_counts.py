"""One count everywhere (issue #30): the end of a tiny CPU study said "1 failed" where the report
said "1 pruned"; after an infrastructure retry the progress bar showed "5/4"."""

from __future__ import annotations

import io
import json

from rich.console import Console
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.tracking.progress import ProgressObserver
from autotune.finish.report import status_counts, status_line
from autotune.study.records import TrialRecord
from support import TINY_TRAIN


def _record(number: int, status: str) -> TrialRecord:
    return TrialRecord(
        number=number,
        state="COMPLETE",
        config={"tp": 1},
        status=status,
        source="measured",
        metrics={},
        predicted={},
        reason="" if status == "ok" else status,
        probed=True,
        baseline=False,
        chosen_because="",
        values=None,
        feasible=True,
    )


def test_an_infrastructure_retry_does_not_advance_the_bar_past_the_budget():
    console = Console(file=io.StringIO(), width=120)
    observer = ProgressObserver(console, [("tokens_per_s_per_device", "maximize")])
    with observer:
        observer.on_start(budget=4, done=0)
        for number, status in enumerate(["ok", "infra", "ok", "ok", "ok"]):  # trial 1's retry is trial 2
            observer.on_trial_finished(_record(number, status), None, 0)
        task = observer.progress.tasks[0]
        assert task.completed == 4 and task.total == 4


def test_a_pruned_trial_is_counted_pruned_not_failed():
    records = [_record(0, "ok"), _record(1, "pruned"), _record(2, "oom")]
    assert status_counts(records) == {"ok": 1, "oom": 1, "pruned": 1}
    assert status_line(records) == "3 trials: 1 ok, 1 oom, 1 pruned"


def test_run_and_report_print_the_same_counts(write_spec, tmp_path):
    spec = write_spec(
        TINY_TRAIN.replace("objectives:", 'constraints: ["micro_batch_size < 4"]\nobjectives:').replace(
            "seed: 1}", "seed: 1, sampler: random}"
        )
    )
    run_dir = tmp_path / "run"
    ran = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking", "--json"])
    assert ran.exit_code == 0, ran.output
    reported = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    counts: dict[str, int] = {}
    for trial in reported["trials"]:
        counts[trial["status"]] = counts.get(trial["status"], 0) + 1
    assert "invalid" in counts  # the constraint rejected some proposals: more than one status to count
    assert json.loads(ran.stdout)["statuses"] == dict(sorted(counts.items()))
    again = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"])  # budget reached
    line = next(x for x in again.stderr.splitlines() if "probed" in x)
    text = CliRunner().invoke(app, ["report", str(run_dir)]).stdout
    assert line.split(" (")[0] in text  # the same words at the end of `run` and atop `report`
