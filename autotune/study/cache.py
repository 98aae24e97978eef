"""Results of real probes, kept across studies so that no config is measured twice.

A probe of Llama-2-7B on a node costs minutes of eight NPUs; a second study over an overlapping
space (a wider micro-batch range, a new objective) should not pay for configs already measured.
Every real probe's outcome is written here; ``autotune run --reuse-cache`` answers a trial from it
when everything that decides the measurement is the same:

- the canonical config (``space.config_key``: equivalent configs share a key),
- the model architecture, the workload (sequence, batch, steps), the cluster (accelerator,
  nodes, devices, the resolved hardware profile),
- the backend (kind, argv, extra env, interpreter),
- the software on the driver host: autotune, torch, torch_npu, MindSpore versions (read from
  package metadata, without importing them); a probe's own report of its software is kept with
  the result.

Only outcomes that repeat are kept: ``ok`` and the infeasible ones (``oom``, ``nan``,
``invalid``); never ``timeout``, ``crash`` or ``pruned``, which say more about the moment than
the config. The store is one SQLite file (``AUTOTUNE_CACHE``, default
``~/.cache/autotune/results.sqlite``), safe for concurrent studies on one host.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune.workers.protocol import ProbeResult

__all__ = ["ResultCache", "cache_key", "default_cache_path", "CACHEABLE"]

CACHEABLE = ("ok", "oom", "nan", "invalid")
_PACKAGES = ("autotune", "torch", "torch_npu", "mindspore")


def default_cache_path() -> Path:
    return Path(os.environ.get("AUTOTUNE_CACHE") or Path.home() / ".cache" / "autotune" / "results.sqlite")


def _software() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cache_key(
    config_key: str, model: dict[str, Any], workload: dict[str, Any], cluster: dict[str, Any], backend: dict[str, Any]
) -> str:
    """The key of one measurement: a hash of everything that decides it (see the module doc)."""
    work = {k: v for k, v in workload.items() if k not in ("timeout_s",)}
    back = {k: backend.get(k) for k in ("kind", "argv", "env", "python", "metric_patterns", "cwd")}
    hardware = cluster.get("hardware")
    if isinstance(hardware, dict) and "usable_memory_gib" in hardware:
        # what the device check read at the study's start (autotune.study.usable_memory: on a CPU the host's
        # free memory, which moves with its load) does not decide a measurement
        cluster = {**cluster, "hardware": {k: v for k, v in hardware.items() if k != "usable_memory_gib"}}
    payload = {
        "config": config_key,
        "model": model,
        "workload": work,
        "cluster": cluster,
        "backend": back,
        "software": _software(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class ResultCache:
    """One SQLite table: key -> the probe's result, with the study and trial that measured it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path or default_cache_path())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, study TEXT, trial INTEGER, "
            "created REAL, result TEXT)"
        )

    def get(self, key: str) -> tuple[ProbeResult, dict[str, Any]] | None:
        """The cached result and where it came from (``{"study", "trial", "created"}``), or None."""
        row = self._db.execute("SELECT study, trial, created, result FROM results WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        study, trial, created, text = row
        return ProbeResult.from_json(json.loads(text)), {"study": study, "trial": trial, "created": created}

    def put(self, key: str, result: ProbeResult, study: str, trial: int) -> bool:
        """Keep a result that would repeat; True when stored."""
        if result.status not in CACHEABLE or result.source != "measured":
            return False
        self._db.execute(
            "INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?, ?)",
            (key, study, trial, time.time(), json.dumps(result.to_json(), default=str)),
        )
        return True

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def close(self) -> None:
        self._db.close()
