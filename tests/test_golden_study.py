"""The study loop's behaviour, pinned (issue #32): a seeded simulated study of the shipped
``llama2_7b_8npu.yaml`` and a seeded ``command``-backend study produce the same trials, statuses,
metrics and MLflow content (params, metrics, tags, artifact names) as the golden record in
``tests/fixtures/golden_study/``, taken before the trial lifecycle was restructured.

What varies from run to run is left out of the record: times, durations, run ids, paths, host
and software names. Floats are rounded to 6 significant digits (the simulator's arithmetic is
deterministic; the command probe's figures are computed from the config).

A deliberate behaviour change regenerates the record: ``AUTOTUNE_REGOLD=1 pytest tests/test_golden_study.py``,
and the diff of the fixture is reviewed with the change.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from support import REPO, command_spec

GOLDEN = Path(__file__).parent / "fixtures" / "golden_study"

# tags and params whose values are times, ids, paths, hosts or versions
_VOLATILE = re.compile(
    r"^mlflow\.(user|source\.|runName|parentRunId|log-model|note\.content)|"
    r"resumed|_s$|seconds|wall|time|duration|software|host|path|uri|run_id|calibrated|written"
)


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def _stable(items: dict[str, Any]) -> dict[str, Any]:
    return {k: _round(v) for k, v in sorted(items.items()) if not _VOLATILE.search(k)}


def _artifacts(client: Any, run_id: str, path: str = "") -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path or None):
        out += _artifacts(client, run_id, item.path) if item.is_dir else [item.path]
    return sorted(out)


def study_record(run_dir: Path, experiment: str) -> dict[str, Any]:
    """Trials as ``autotune report --json`` gives them, and the study's MLflow runs."""
    from mlflow.tracking import MlflowClient

    report = json.loads(CliRunner().invoke(app, ["report", str(run_dir), "--json"]).stdout)
    trials = [
        {
            "number": t["number"],
            "status": t["status"],
            "params": t["params"],
            "probed": t["probed"],
            "baseline": t["baseline"],
            "source": t["source"],
            "metrics": _stable(t["metrics"]),
            "failure": re.sub(r"/\S+", "PATH", t.get("failure") or ""),
        }
        for t in report["trials"]
    ]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = sorted(
        (r for r in runs if "mlflow.parentRunId" in r.data.tags), key=lambda r: r.data.tags.get("autotune.trial", "")
    )
    mlflow_runs = [
        {
            "name": r.data.tags.get("mlflow.runName", "")
            if not r.data.tags.get("autotune.trial")
            else f"trial {r.data.tags['autotune.trial']}",
            "status": r.info.status,
            "params": _stable(r.data.params),
            "metrics": _stable(r.data.metrics),
            "tags": _stable(r.data.tags),
            "artifacts": _artifacts(client, r.info.run_id),
        }
        for r in [*parents, *children]
    ]
    return {"trials": trials, "mlflow": mlflow_runs}


def _compare(name: str, record: dict[str, Any]) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if os.environ.get("AUTOTUNE_REGOLD") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        pytest.skip(f"golden record {path.name} rewritten")
    golden = json.loads(path.read_text())
    assert record["trials"] == golden["trials"]
    assert len(record["mlflow"]) == len(golden["mlflow"])
    for got, want in zip(record["mlflow"], golden["mlflow"]):
        assert got == want, got["name"]


@pytest.mark.timeout(600)
def test_a_seeded_simulated_study_of_the_shipped_spec_is_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    spec = REPO / "search_spaces" / "llama2_7b_8npu.yaml"
    result = CliRunner().invoke(
        app, ["run", str(spec), "--run-dir", str(run_dir), "--n-trials", "12", "--seed", "7", "--json"]
    )
    assert result.exit_code == 0, result.output
    _compare("llama2_7b_8npu_simulated", study_record(run_dir, "llama2-7b-8npu"))


@pytest.mark.timeout(600)
def test_a_seeded_command_backend_study_is_unchanged(write_spec, tmp_path):
    spec = command_spec(write_spec, tmp_path, n_trials=6, parallel=1, ray="ray: {enabled: false}", sleep=0.0)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    _compare("command_backend", study_record(run_dir, "tiny"))
