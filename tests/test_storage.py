"""A damaged study record (issue #13, item 7): a journal cut mid-line is recovered; anything else
names the file and the way out (exit 3, no traceback), for ``run`` and ``report`` alike; an empty
journal beside earlier results is not a fresh start; an impossible run directory is exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from support import TINY_TRAIN

cli = CliRunner()


def _run(spec: Path, run_dir: Path, *extra: str):
    return cli.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), *extra])


@pytest.fixture
def finished(write_spec, tmp_path):
    spec = write_spec(TINY_TRAIN)
    run_dir = tmp_path / "study"
    assert _run(spec, run_dir, "--no-tracking").exit_code == 0
    return spec, run_dir, run_dir / "optuna.journal"


def _probes(spec: Path, run_dir: Path) -> int:
    result = cli.invoke(app, ["report", str(spec), "--run-dir", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    return sum(1 for t in json.loads(result.stdout)["trials"] if t["probed"])


def test_a_journal_cut_mid_record_is_recovered_and_the_study_goes_on(finished):
    spec, run_dir, journal = finished
    whole = journal.read_bytes()
    with open(journal, "ab") as f:  # what a crash in the middle of Optuna's append leaves
        f.write(b'{"op_code":8,"worker_id":"x","trial_id":3,"user_attr":{"autotune.st')
    result = _run(spec, run_dir, "--no-tracking", "--n-trials", "8")
    assert result.exit_code == 0, result.output
    assert "cut mid-write" in result.stderr and "Traceback" not in result.output
    torn = list(run_dir.glob("optuna.journal.torn-*"))
    assert len(torn) == 1 and torn[0].read_bytes().startswith(b'{"op_code":8')
    assert journal.read_bytes().startswith(whole)  # every complete record kept
    assert _probes(spec, run_dir) == 8  # the six measured before, two more: nothing probed again


DAMAGE = {
    "random bytes": b"\x8f\x02garbage\xff\n",
    "NULs": b"\x00" * 40 + b"\n",
    "an unknown operation": b'{"op_code": 99, "worker_id": "w"}\n',
    "not an object": b"[1, 2, 3]\n",
    "a record Optuna cannot apply": b'{"op_code": 8, "worker_id": "w"}\n',
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_journal_names_the_file_for_run_and_report(finished, damage):
    spec, run_dir, journal = finished
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:5]) + DAMAGE[damage] + b"".join(lines[5:]))
    before = journal.read_bytes()
    for command in (
        ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"],
        ["report", str(spec), "--run-dir", str(run_dir)],
    ):
        result = cli.invoke(app, command)
        assert result.exit_code == 3, (command[0], result.output)
        assert str(journal) in result.stderr.replace("\n", ""), result.stderr
        assert "Traceback" not in result.output and "--run-dir" in result.stderr
        if damage != "a record Optuna cannot apply":  # found before Optuna reads: the line is named
            assert "line 6" in result.stderr
    assert journal.read_bytes() == before  # nothing written into a damaged record


def test_an_empty_journal_beside_earlier_results_is_not_a_fresh_start(finished):
    spec, run_dir, journal = finished
    journal.write_bytes(b"")
    result = _run(spec, run_dir, "--no-tracking")
    assert result.exit_code == 3
    assert "empty" in result.stderr and "6 trial" in result.stderr and str(journal) in result.stderr.replace("\n", "")
    assert journal.read_bytes() == b""  # no second study started in it


def test_a_run_directory_that_cannot_be_made_is_exit_2(write_spec, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _run(write_spec(TINY_TRAIN), blocker / "study", "--no-tracking")
    assert result.exit_code == 2
    assert "cannot create the run directory" in result.stderr and "Traceback" not in result.output
