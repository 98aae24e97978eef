"""The Optuna storage of a study: where it lives, who may write it, and what to do when it is damaged.

Optuna storage is the record of a study (MLflow is a view of it, see :mod:`autotune.tracking.tracker`), so
a damaged record must never be read as "no study" nor crash with a traceback:

- a journal whose last line was cut by a crash mid-write is *recovered*: the torn bytes are moved
  to ``<journal>.torn-<time>`` and the journal truncated to its last complete record (Optuna skips
  a torn last line when it reads, but its next append would glue a record onto it and corrupt the
  journal for good);
- any other damage (bytes that are not JSON, NULs, an operation Optuna does not know, a record it
  cannot apply) is a :class:`StorageDamaged` naming the file, the line and what to do;
- an empty journal in a run directory that holds trial results of an earlier run is damage too,
  not a fresh start (that would orphan the study's MLflow runs and probe everything again).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import optuna

from ..settings import Objectives
from ..spec.schema import Spec

__all__ = ["StorageDamaged", "check_journal", "journal_path", "name_metrics", "open_study", "study_storage"]

log = logging.getLogger(__name__)


class StorageDamaged(Exception):
    """The study's storage cannot be read as a study; the message names the file and the way out."""


def check_journal(path: Path) -> str | None:
    """Check an Optuna journal file line by line before Optuna replays it; recover a torn last
    line. Returns a line saying what was recovered, or None; raises :class:`StorageDamaged`."""
    if not path.exists():
        return None
    # the journal's operation codes, to tell a record Optuna knows: Optuna exports no public name for them
    from optuna.storages.journal._storage import JournalOperation

    known = {int(op) for op in JournalOperation}
    data = path.read_bytes()
    recovered = None
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        torn = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%dT%H%M%S')}")
        torn_bytes = data[cut:]
        torn.write_bytes(torn_bytes)
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        data = data[:cut]
        recovered = (
            f"{path}: the last record was cut mid-write (the run was killed while writing it); "
            f"{len(torn_bytes)} byte(s) moved to {torn.name}, "
            "the study continues from the record before it"
        )
    fix = "restore the file from a backup, or pass a new --run-dir to start the study over"
    for number, line in enumerate(data.splitlines(), start=1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            shown = line[:60].decode("utf-8", "backslashreplace")
            raise StorageDamaged(f"{path}: line {number} is not an Optuna journal record ({shown!r}); {fix}") from None
        op = record.get("op_code") if isinstance(record, dict) else None
        if isinstance(op, bool) or not isinstance(op, int) or op not in known:
            raise StorageDamaged(
                f"{path}: line {number} has no Optuna operation this version knows "
                f"(op_code {op!r}; optuna {optuna.__version__}); {fix}"
            )
    return recovered


def study_storage(spec: Spec, run_dir: Path, read_only: bool = False) -> Any:
    """The Optuna storage: the spec's URL, else a journal file in the run directory
    (~3 ms per trial, append-only, survives SIGKILL). ``read_only``: for reading a study
    (``report``, ``export``), which an archived, read-only run directory must still allow."""
    path = journal_path(spec, run_dir)
    if path is None:
        try:
            return optuna.storages.RDBStorage(spec.tracking.storage, heartbeat_interval=None)
        except ImportError as exc:  # SQLAlchemy picked a driver module that is not installed
            raise StorageDamaged(_driver_hint(spec.tracking.storage, exc)) from None
    return _journal(path, read_only)


# the database drivers autotune's test extra installs, by URL scheme
_DRIVERS = {"postgresql": "postgresql+psycopg2", "postgres": "postgresql+psycopg2", "mysql": "mysql+pymysql"}


def _driver_hint(url: str, exc: Exception) -> str:
    """Optuna's "Failed to import DB access module" names neither the field nor the fix: for a bare
    ``postgresql://`` SQLAlchemy 2.1 picks psycopg 3, which is not what is installed."""
    from ..spec.secret_env import masked_url

    scheme = url.split("://", 1)[0]
    fix = _DRIVERS.get(scheme)
    how = (
        f"name the driver in the URL: {masked_url(fix + url[len(scheme) :])} (psycopg2 is installed with "
        "autotune's test extra; pip install psycopg2-binary otherwise)"
        if fix
        else "install the database driver the URL's scheme names, or name an installed one (scheme+driver://)"
    )
    return f"tracking.storage {masked_url(url)!r}: no database driver for it can be imported ({exc}); {how}"


def journal_path(spec: Spec, run_dir: Path) -> Path | None:
    """The journal file a study is kept in, or None when it lives in a database."""
    url = spec.tracking.storage
    if not url:
        return run_dir / "optuna.journal"
    if url.endswith((".journal", ".log")) and "://" not in url:
        return Path(url)
    return None


def _journal(path: Path, read_only: bool = False) -> Any:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    if not read_only:
        path.parent.mkdir(parents=True, exist_ok=True)
    lock = _journal_lock(path)
    try:
        lock.acquire()  # nobody appends while a torn last line is cut off
    except OSError:
        if not read_only:
            raise
        # the lock file cannot be created (a read-only archive): nobody writes there, so read as is
        return JournalStorage(JournalFileBackend(str(path), lock_obj=_NoLock()))
    try:
        recovered = check_journal(path)
    finally:
        lock.release()
    if recovered:
        log.warning("%s", recovered)
    return JournalStorage(JournalFileBackend(str(path), lock_obj=lock))


class _NoLock:
    """Optuna's journal lock interface for a journal nobody can write (a read-only directory)."""

    def acquire(self) -> bool:
        return True

    def release(self) -> None:
        return None


def _journal_lock(path: Path) -> Any:
    """The journal's write lock: ``flock`` where the OS has it, else Optuna's own.

    Optuna's default lock is a symlink next to the journal; a SIGKILL between its creation and
    removal leaves it behind, and the next ``autotune run`` then waits 30 s for Optuna's grace
    period before it takes the lock by force. The kernel releases an ``flock`` when its holder
    dies, so resuming after a kill starts at once. Every autotune process writing the journal
    uses this lock; plain Optuna tools that only read it need none."""
    try:
        import fcntl  # noqa: F401
    except ImportError:  # pragma: no cover - Windows
        from optuna.storages.journal import JournalFileOpenLock

        return JournalFileOpenLock(str(path))
    return _FlockJournalLock(str(path) + ".flock")


class _FlockJournalLock:
    """Implements Optuna's journal file lock interface (``acquire``/``release``) with ``flock``."""

    def __init__(self, lock_path: str) -> None:
        import threading

        self._lock_path = lock_path
        self._in_process = threading.Lock()  # one holder per process at a time, as flock is per fd
        self._fd: int | None = None

    def acquire(self) -> bool:
        import fcntl
        import os

        self._in_process.acquire()
        try:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            self._in_process.release()
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        import fcntl
        import os

        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        finally:
            self._in_process.release()


def open_study(
    spec: Spec,
    run_dir: Path,
    sampler: optuna.samplers.BaseSampler | None = None,
    create: bool = True,
    objectives: Objectives | None = None,
) -> optuna.Study:
    """The spec's study (``objectives``: the spec's, resolved, when the caller has them). Raises
    :class:`StorageDamaged` (naming the file) for a storage that cannot be read as a study, and
    ``KeyError`` when ``create`` is false and there is no study of that name in it."""
    path = journal_path(spec, run_dir)
    where = str(path) if path is not None else f"the Optuna storage {spec.tracking.storage} (tracking.storage)"
    if path is not None and create and (not path.exists() or path.stat().st_size == 0):
        earlier = sorted(run_dir.glob("trials/*/result.json"))
        if earlier:
            raise StorageDamaged(
                f"{path} is {'empty' if path.exists() else 'missing'}, but {run_dir} holds {len(earlier)} trial "
                f"result(s) of an earlier run of this study (e.g. {earlier[0].relative_to(run_dir)}): the study's "
                "record was lost, and starting afresh would probe those configs again and orphan their MLflow runs. "
                "Restore the journal from a backup, or pass a new --run-dir to start over"
            )
    try:
        storage = study_storage(spec, run_dir, read_only=not create)
    except StorageDamaged:
        raise
    except Exception as exc:  # Optuna could not replay what it read
        if path is None:
            raise
        raise StorageDamaged(
            f"{where}: Optuna cannot replay it ({type(exc).__name__}: {exc}); restore the file "
            "from a backup, or pass a new --run-dir to start the study over"
        ) from None
    if objectives is None:
        from ..spec.resolve import objectives_of

        objectives = objectives_of(spec)
    directions = [d for _, d in objectives]
    if not create:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
    else:
        study = optuna.create_study(
            study_name=spec.name, storage=storage, directions=directions, sampler=sampler, load_if_exists=True
        )
    if path is not None:
        _check_no_trial_lost(study, path, run_dir)
    if create:
        name_metrics(study, spec, objectives)
    return study


def name_metrics(study: optuna.Study, spec: Spec, objectives: Objectives | None = None) -> None:
    """Name the study's objectives after the spec's metrics (``study.set_metric_names``), so that
    optuna-dashboard and ``trials_dataframe`` say ``decode_tokens_per_s``, not "Objective 0". On
    new and resumed studies (one written before autotune named them gets its names); written
    only when they change, so that a resume adds no record to the journal."""
    import warnings

    if objectives is None:
        from ..spec.resolve import objectives_of

        objectives = objectives_of(spec)
    names = [m for m, _ in objectives]
    if study.metric_names == names or len(names) != len(study.directions):
        return
    with warnings.catch_warnings():  # set_metric_names is marked experimental
        warnings.simplefilter("ignore")
        study.set_metric_names(names)


def _check_no_trial_lost(study: optuna.Study, path: Path, run_dir: Path) -> None:
    """A journal cut mid-file (a copy that stopped short, a disk that lost its tail) reads as a
    shorter, valid study: resumed, its lost trials would be probed again and get second MLflow runs.
    The run directory keeps every finished trial's ``trials/NNNN/result.json``: one the journal
    knows nothing of says records were lost (a crash mid-write loses at most the last record, of a
    trial the journal already holds)."""
    known = {t.number for t in study.get_trials(deepcopy=False)}
    lost = sorted(
        int(p.parent.name)
        for p in run_dir.glob("trials/[0-9]*/result.json")
        if p.parent.name.isdigit() and int(p.parent.name) not in known
    )
    if lost:
        raise StorageDamaged(
            f"{path} holds {len(known)} trial(s), but {run_dir} holds results of trial(s) "
            f"{', '.join(map(str, lost[:8]))}{' ...' if len(lost) > 8 else ''} that it does not: the journal was cut "
            "and lost records; resuming would probe those configs again and double their MLflow runs. Restore the "
            "journal from a backup, or pass a new --run-dir to start over"
        )
