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
  :data:`LEASE_TTL_S` (its driver was killed) is taken over.

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

__all__ = ["RunDirLock", "StudyLease", "lease_shared_study", "StudyInUse", "LOCK_FILE", "LEASE_ATTR", "LEASE_TTL_S"]

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


class RunDirLock:
    """An exclusive, non-blocking ``flock`` on ``directory/.autotune.lock`` (a context manager)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
            except (OSError, ValueError):
                holder = {}
            os.close(fd)
            raise StudyInUse(
                f"the run directory {self.path.parent} is in use by {_describe(holder)}: one driver per "
                "study. Wait for it to end (or stop it), or pass another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        import fcntl

        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

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


def lease_shared_study(spec: Any, run_dir: Path) -> StudyLease | None:
    """The lease of a study kept in a shared database (``tracking.storage``), which drivers on other
    hosts and run directories may share; None for a journal in the run directory (its lock is
    enough). Raises :class:`StudyInUse` while another driver holds it."""
    from .storage import journal_path, open_study, study_storage

    if journal_path(spec, run_dir) is not None:
        return None
    open_study(spec, run_dir)  # created here if new: the lease lives on the study
    lease = StudyLease(study_storage(spec, run_dir), spec.name)
    lease.acquire()
    return lease
