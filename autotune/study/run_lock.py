"""One driver per study: an exclusive lock on the run directory, and a lease on a shared storage.

Two ``autotune run`` processes on one study each ask Optuna for trials, and both probe: a resumed
study with a budget of 10 ran 19 probes, 9 configs measured twice. So a driver holds

- an ``flock`` on ``RUN_DIR/.autotune.lock`` for as long as it runs (the file says who holds it:
  pid, host, start time, command). The kernel drops the lock when its holder dies, however it
  dies, so a killed driver's lock is taken over at once and safely: no stale-lock timeout, no
  guess about whether a pid is still alive;
- where the study lives in a shared database (``tracking.storage``), drivers on other hosts with
  other run directories share it: a lease kept on the study (a study user attribute, Optuna's
  public API), renewed while the driver runs and given up when it ends; a lease not renewed for
  :data:`LEASE_TTL_S` (its driver was killed) is taken over;
- where the study lives in a journal file outside the run directory (``tracking.storage`` naming a
  path), drivers with other run directories share it too: an ``flock`` on
  ``<journal>.<study>.lock`` beside it (:class:`JournalLease`), the same kind of lock as the run
  directory's, and the one the journal's own writes already rely on. A journal inside the run
  directory is covered by the run directory's lock; one inside *another* run directory (a spec
  naming ``runs/a/optuna.journal`` run with ``--run-dir runs/b``) is that directory's, so its lock
  is taken as well.

A second driver is refused (the CLI exits 3) with who holds the study. Reading (``report``,
``export``) takes neither: it writes nothing.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = [
    "JournalLease",
    "RunDirLock",
    "StudyLease",
    "lease_shared_study",
    "StudyInUse",
    "LOCK_FILE",
    "LEASE_ATTR",
    "LEASE_TTL_S",
]

LOCK_FILE = ".autotune.lock"
LEASE_ATTR = "autotune.driver_lease"
LEASE_TTL_S = 90.0


class StudyInUse(RuntimeError):
    """Another driver holds the run directory or the study; the message says who."""


def _holder() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv[:6])[:300],
    }


def _describe(holder: dict[str, Any]) -> str:
    return f"autotune pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started', '?')}" + (
        f" ({holder['command']})" if holder.get("command") else ""
    )


def _flock(path: Path) -> tuple[int | None, dict[str, Any]]:
    """An exclusive, non-blocking ``flock`` on ``path``, this process written in as its holder:
    ``(fd, {})``; or ``(None, holder)`` with what the file says of the process that holds it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
        except (OSError, ValueError):
            holder = {}
        os.close(fd)
        return None, holder if isinstance(holder, dict) else {}
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder()).encode(), 0)
    return fd, {}


def _unflock(fd: int | None) -> None:
    import fcntl

    if fd is not None:
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


class RunDirLock:
    """An exclusive, non-blocking ``flock`` on ``directory/.autotune.lock`` (a context manager)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd, holder = _flock(self.path)
        if fd is None:
            raise StudyInUse(
                f"the run directory {self.path.parent} is in use by {_describe(holder)}: one driver per "
                "study. Wait for it to end (or stop it), or pass another --run-dir"
            )
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        _unflock(fd)

    def __enter__(self) -> "RunDirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StudyLease:
    """The study's driver lease in its shared storage, renewed by a daemon thread."""

    def __init__(self, storage: Any, study_name: str, ttl_s: float = LEASE_TTL_S):
        self.storage = storage
        self.study_name = study_name
        self.ttl_s = ttl_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _study(self) -> Any:
        import optuna

        return optuna.load_study(study_name=self.study_name, storage=self.storage)

    def _write(self, expires: float) -> None:
        self._study().set_user_attr(LEASE_ATTR, {**_holder(), "token": self.token, "expires": expires})

    def _current(self) -> dict[str, Any]:
        lease = self._study().user_attrs.get(LEASE_ATTR)
        return lease if isinstance(lease, dict) else {}

    def acquire(self) -> None:
        lease = self._current()
        if lease and lease.get("token") != self.token and float(lease.get("expires", 0)) > time.time():
            raise StudyInUse(
                f"the study {self.study_name!r} in the shared storage is in use by {_describe(lease)} "
                f"(its lease runs until {time.ctime(float(lease['expires']))}): one driver per study. "
                "Wait for it to end, or give this study another name"
            )
        self._write(time.time() + self.ttl_s)
        if self._current().get("token") != self.token:  # another driver wrote in between: it won
            raise StudyInUse(f"the study {self.study_name!r} was taken by another driver at the same moment")
        self._thread = threading.Thread(target=self._renew, name="autotune-study-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._write(time.time() + self.ttl_s)
            except Exception:  # the database is down: the study loop says so; the lease lapses
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            try:
                if self._current().get("token") == self.token:
                    self._write(0.0)
            except Exception:  # the database went away: the lease lapses by itself
                pass


class JournalLease:
    """A study's driver lock in a journal file kept outside the run directory: an ``flock`` on
    ``<journal>.<study>.lock`` beside the journal (one study per lock: other studies in the same
    journal keep their own drivers), and, for a journal inside another run directory, that
    directory's lock too (the :class:`RunDirLock` file). Held for as long as the driver runs; the kernel drops it
    when the driver dies, however it dies, so a killed driver's study is taken over at once and a
    live one's never (nor are its running trials taken for a killed run's)."""

    def __init__(self, journal: Path, study_name: str, run_dir: Path):
        self.journal = Path(journal)
        self.study_name = study_name
        name = f"{self.journal.name}.{study_name}.lock"
        if len(name) > 200:  # a name the file system cannot hold: the study's digest stands for it
            import hashlib

            name = f"{self.journal.name[:100]}.{hashlib.sha256(study_name.encode()).hexdigest()[:16]}.lock"
        self.path = self.journal.with_name(name)
        owner = self.journal.parent  # another run directory's, when it holds a run-directory lock
        self._owner = owner / LOCK_FILE if (owner / LOCK_FILE).exists() and not _inside(owner, Path(run_dir)) else None
        self._fd: int | None = None
        self._owner_fd: int | None = None

    def acquire(self) -> None:
        from .storage import StorageDamaged

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, holder = _flock(self.path)
        except OSError as exc:
            raise StorageDamaged(
                f"cannot lock the journal {self.journal} for this driver: {self.path} ({exc.strerror or exc}); "
                "the journal's directory must be writable by the driver"
            ) from None
        if fd is None:
            raise StudyInUse(
                f"the study {self.study_name!r} in the journal {self.journal} is in use by {_describe(holder)}: "
                "one driver per study. Wait for it to end (or stop it), or give this study another name"
            )
        self._fd = fd
        if self._owner is None:
            return
        try:
            fd, holder = _flock(self._owner)
        except OSError as exc:
            self.release()
            raise StorageDamaged(
                f"cannot lock the run directory {self._owner.parent} that holds the journal {self.journal} "
                f"({exc.strerror or exc}); name a journal elsewhere in tracking.storage"
            ) from None
        if fd is None:
            self.release()
            raise StudyInUse(
                f"the journal {self.journal} is the study record of the run directory {self._owner.parent}, "
                f"which is in use by {_describe(holder)}: one driver per study. Wait for it to end (or stop it), "
                "or name another journal in tracking.storage"
            )
        self._owner_fd = fd

    def release(self) -> None:
        owner_fd, self._owner_fd = self._owner_fd, None
        try:
            _unflock(owner_fd)
        finally:
            fd, self._fd = self._fd, None
            _unflock(fd)


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def lease_shared_study(spec: Any, run_dir: Path) -> StudyLease | JournalLease | None:
    """The lease of a study that drivers with other run directories may share: one in a database
    (``tracking.storage`` a URL: :class:`StudyLease`), or in a journal outside ``run_dir``
    (``tracking.storage`` a path: :class:`JournalLease`); None for a journal inside the run
    directory (its lock is enough). Raises :class:`StudyInUse` while another driver holds it."""
    from .storage import journal_path, open_study, study_storage

    journal = journal_path(spec, run_dir)
    if journal is not None:
        if _inside(journal, run_dir):
            return None
        lease: StudyLease | JournalLease = JournalLease(journal, spec.name, run_dir)
        lease.acquire()
        return lease
    open_study(spec, run_dir)  # created here if new: the lease lives on the study
    lease = StudyLease(study_storage(spec, run_dir), spec.name)
    lease.acquire()
    return lease
