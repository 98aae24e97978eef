"""A study's record, read from an archive and resumed from a damaged copy (issue #31: a read-only
run directory could not be reported, "blaming the journal"; a journal cut mid-file was resumed,
its lost configs probed again and given second MLflow runs)."""

from __future__ import annotations

import errno
import json

from typer.testing import CliRunner

from autotune.study import storage
from autotune.cli.commands import app
from support import TINY_TRAIN, command_spec


def _study(write_spec, tmp_path):
    spec = write_spec(TINY_TRAIN)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking", "--json"])
    assert result.exit_code == 0, result.output
    return spec, run_dir


def test_a_read_only_run_directory_is_reported_and_exported(write_spec, tmp_path, monkeypatch):
    spec, run_dir = _study(write_spec, tmp_path)

    def read_only_fs(self):  # what a read-only mount answers when the lock file is created
        raise OSError(errno.EROFS, "Read-only file system", self._lock_path)

    monkeypatch.setattr(storage._FlockJournalLock, "acquire", read_only_fs)
    report = CliRunner().invoke(app, ["report", str(run_dir), "--json"])
    assert report.exit_code == 0, report.output
    assert len(json.loads(report.stdout)["trials"]) == 6
    exported = CliRunner().invoke(app, ["export", str(run_dir), "--out", str(tmp_path / "out"), "--json"])
    assert exported.exit_code == 0, exported.output
    # a run (a writer) still needs the lock: it says so rather than write unlocked
    again = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"])
    assert again.exit_code != 0


def test_a_journal_cut_mid_file_is_damage_not_a_shorter_study(write_spec, tmp_path):
    spec = command_spec(write_spec, tmp_path, n_trials=6, parallel=1, ray="ray: {enabled: false}", sleep=0.0)
    run_dir = tmp_path / "run"
    first = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"])
    assert first.exit_code == 0, first.output
    journal = run_dir / "optuna.journal"
    data = journal.read_bytes()
    cut = int(len(data) * 0.55)
    while data[cut - 1 : cut] == b"\n":  # mid-record, not at a line end
        cut += 1
    journal.write_bytes(data[:cut])
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"])
    assert result.exit_code == 3, result.output
    assert "the journal was cut" in result.stderr and "optuna.journal" in result.stderr
    report = CliRunner().invoke(app, ["report", str(run_dir)])
    assert report.exit_code == 3 and "the journal was cut" in report.stderr


def test_a_database_url_without_an_installed_driver_names_the_field_and_the_fix(write_spec, tmp_path):
    spec = write_spec(TINY_TRAIN + "tracking: {storage: 'postgresql://tuner:pw_Zq8s99@127.0.0.1:1/optuna'}\n")
    result = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(tmp_path / "run"), "--no-tracking"])
    assert result.exit_code == 3, result.output
    assert "tracking.storage" in result.stderr
    assert "postgresql+psycopg2://tuner:***@127.0.0.1:1/optuna" in result.stderr
    assert "pw_Zq8s99" not in result.output
