"""Two drivers on one journal outside the run directory (issue #42, High #1).

The shared-study lease was skipped for every journal, on the assumption that a journal lives in
the run directory (whose lock covers it). With ``tracking.storage`` naming a journal elsewhere, a
second driver in another run directory re-queued the first's live trial as "interrupted", the
first died on ``UpdateFinishedTrialError`` with its measurement lost, and both exported a best. A
journal outside the run directory is now leased like a database: the second driver is refused
(exit 3) naming the holder, and writes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.study.run_lock import LOCK_FILE, RunDirLock, StudyInUse, lease_shared_study
from autotune.spec.load import load_spec
from support import TINY_TRAIN, command_spec, probe_log

pytestmark = pytest.mark.timeout(300)


def _autotune(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_probe(tmp_path: Path, driver: subprocess.Popen, within_s: float = 120.0) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if any(e["event"] == "start" for e in probe_log(tmp_path)):
            return
        if driver.poll() is not None:
            raise AssertionError(f"the first driver ended before probing: {driver.communicate()}")
        time.sleep(0.1)
    raise AssertionError("the first driver never started a probe")


def test_two_drivers_on_one_external_journal_lose_nothing(write_spec, tmp_path):
    journal = tmp_path / "shared" / "shared.journal"
    spec = command_spec(write_spec, tmp_path, n_trials=3, parallel=1, ray="ray: {enabled: false}", sleep=1.5)
    spec.write_text(spec.read_text() + f"tracking: {{storage: '{journal}'}}\n")
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    first = _autotune("run", str(spec), "--run-dir", str(run_a), "--no-tracking")
    try:
        _wait_for_probe(tmp_path, first)  # the first driver's trial is live now
        second = subprocess.run(
            [sys.executable, "-m", "autotune.cli", "run", str(spec), "--run-dir", str(run_b), "--no-tracking"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        a_out, a_err = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    said = second.stderr.replace("\n", " ")
    assert second.returncode == 3, second.stderr
    assert f"autotune pid {first.pid}" in said and "one driver per study" in said, second.stderr
    assert str(journal) in said.replace(" ", "") or str(journal) in said, second.stderr
    assert "resuming" not in second.stderr
    assert first.returncode == 0, a_err
    assert "UpdateFinishedTrialError" not in a_err and "already finished" not in a_err

    # every trial of the first driver complete, with its measurement; none marked interrupted
    study = optuna.load_study(
        study_name="tiny",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal))),
    )
    trials = study.get_trials(deepcopy=False)
    assert trials, "no trial recorded"
    assert all(t.state.is_finished() for t in trials), [(t.number, t.state) for t in trials]
    assert not any(
        t.user_attrs.get("autotune.status") == "interrupted"
        or "interrupted" in str(t.user_attrs.get("autotune.reason"))
        for t in trials
    ), [(t.number, t.user_attrs.get("autotune.status"), t.user_attrs.get("autotune.reason")) for t in trials]
    assert not any("autotune.requeued_from" in t.user_attrs for t in trials)
    probed = [t for t in trials if t.user_attrs.get("autotune.probed")]
    # every probe is a trial with its outcome: the measured ones with their throughput
    assert len(probed) == 3 and {t.user_attrs["autotune.status"] for t in probed} <= {"ok", "oom"}, [
        (t.number, t.user_attrs.get("autotune.status")) for t in probed
    ]
    ok = [t for t in probed if t.user_attrs["autotune.status"] == "ok"]
    assert ok and all(t.state == optuna.trial.TrialState.COMPLETE and t.values[0] > 0 for t in ok)
    # every probe started ended (none cut off), and each config was probed once
    log = probe_log(tmp_path)
    starts = [e for e in log if e["event"] == "start"]
    assert len(starts) == len([e for e in log if e["event"] == "end"]) == 3
    assert len({str(sorted(e["params"].items())) for e in starts}) == 3

    # one best: only the first driver's run directory has an export, the second wrote nothing
    assert (run_a / "export").is_dir() and any((run_a / "export").iterdir())
    assert not (run_b / "export").exists() and not (run_b / "trials").exists()
    assert not (run_b / "mlflow.db").exists()


def _spec(write_spec, tmp_path: Path, storage: Path | None):
    text = TINY_TRAIN + (f"tracking: {{storage: '{storage}'}}\n" if storage is not None else "")
    return load_spec(write_spec(text))


def test_an_external_journal_is_leased_and_one_in_the_run_dir_is_not(write_spec, tmp_path):
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    run_a.mkdir(), run_b.mkdir()
    external = _spec(write_spec, tmp_path, tmp_path / "shared" / "shared.journal")
    lease = lease_shared_study(external, run_a)
    assert lease is not None
    try:
        with pytest.raises(StudyInUse, match=f"in use by autotune pid {os.getpid()}"):
            lease_shared_study(external, run_b)
    finally:
        lease.release()
    again = lease_shared_study(external, run_b)  # released: taken at once
    assert again is not None
    again.release()

    # the default journal, and one named inside the run directory: the run-dir lock covers them
    assert lease_shared_study(_spec(write_spec, tmp_path, None), run_a) is None
    assert lease_shared_study(_spec(write_spec, tmp_path, run_a / "sub" / "study.journal"), run_a) is None


def test_another_run_directorys_journal_is_covered_by_that_directorys_lock(write_spec, tmp_path):
    """A journal inside run directory A, used by a driver in B, is A's: B takes A's lock too."""
    run_a, run_b = tmp_path / "A", tmp_path / "B"
    run_a.mkdir(), run_b.mkdir()
    spec = _spec(write_spec, tmp_path, run_a / "optuna.journal")
    with RunDirLock(run_a):  # A's driver runs on its own journal (no lease: its lock covers it)
        assert lease_shared_study(spec, run_a) is None
        with pytest.raises(StudyInUse, match=f"in use by autotune pid {os.getpid()}"):
            lease_shared_study(spec, run_b)
    lease = lease_shared_study(spec, run_b)  # A's driver ended: B takes both
    try:
        assert (run_a / LOCK_FILE).exists()
        with pytest.raises(StudyInUse):
            RunDirLock(run_a).acquire()  # and a driver in A now waits for B
    finally:
        lease.release()
    with RunDirLock(run_a):
        pass
