"""A re-run of an edited spec is not a resume (issue #30, "Editing a spec and re-running keeps the
old study"): what defines the study is kept on it, and a change stops the run with exit 2 naming
the fields; a larger budget alone continues; --fresh-study sets the old study aside, kept."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from typer.testing import CliRunner

from autotune.cli.commands import app

SPEC = """
name: edited
model: tiny-llama
workload: {kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}
cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}
backend: simulate
space:
  tp: [1, 2]
  micro_batch_size: [1, 2]
  precision: [PRECISIONS]
objectives: [tokens_per_s_per_device]
search: {n_trials: 3, seed: 1}
"""


def _run(spec: Path, run_dir: Path, *extra: str):
    return CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking", "--json", *extra])


def _write(path: Path, precisions: str) -> Path:
    path.write_text(SPEC.replace("PRECISIONS", precisions))
    return path


def test_an_edited_space_is_refused_with_the_changed_field_and_the_ways_on(tmp_path):
    spec, run_dir = _write(tmp_path / "spec.yaml", "bf16, fp16"), tmp_path / "run"
    first = _run(spec, run_dir)
    assert first.exit_code == 0, first.output
    _write(spec, "bf16")
    again = _run(spec, run_dir)
    assert again.exit_code == 2, again.output
    assert "space.precision" in again.stderr and '["bf16", "fp16"] -> ["bf16"]' in again.stderr
    assert "--run-dir" in again.stderr and "--fresh-study" in again.stderr
    # a larger budget does not make the edit a continuation (it raised Optuna's raw
    # "CategoricalDistribution does not support dynamic value space" before)
    more = _run(spec, run_dir, "--n-trials", "5")
    assert more.exit_code == 2 and "dynamic value space" not in more.output


def test_a_larger_budget_alone_continues_the_study(tmp_path):
    spec, run_dir = _write(tmp_path / "spec.yaml", "bf16, fp16"), tmp_path / "run"
    assert _run(spec, run_dir).exit_code == 0
    more = _run(spec, run_dir, "--n-trials", "5")
    assert more.exit_code == 0, more.output
    assert json.loads(more.stdout)["probes"] == 5


def test_fresh_study_sets_the_old_one_aside_and_measures_only_the_new_space(tmp_path):
    spec, run_dir = _write(tmp_path / "spec.yaml", "fp16"), tmp_path / "run"
    assert _run(spec, run_dir).exit_code == 0
    _write(spec, "bf16")
    fresh = _run(spec, run_dir, "--fresh-study")
    assert fresh.exit_code == 0, fresh.output
    assert json.loads(fresh.stdout)["best"][0]["params"]["precision"] == "bf16"
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal"))
    )
    new = optuna.load_study(study_name="edited", storage=storage)
    assert len(new.trials) == 3 and {t.params["precision"] for t in new.trials} == {"bf16"}
    names = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    aside = [n for n in names if n.startswith("edited.superseded-")]
    assert "edited" in names and len(aside) == 1  # the old study is kept, under another name
    old = optuna.load_study(study_name=aside[0], storage=storage)
    assert {t.params["precision"] for t in old.trials} == {"fp16"}
    assert list(run_dir.glob("superseded-*/trials")) or not list(run_dir.glob("trials"))
