"""Shared fixtures (spec files written into tmp dirs) and the test environment (Ray quiet, a
throwaway result cache). Shared constants and helpers live in ``support.py``: a ``conftest``
module cannot be imported by name reliably, since tests/torch_probe has one too."""

from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# the result cache of real probes goes to a throwaway file, never the user's ~/.cache
# warm probe servers (workers/torch_probe/warm.py) live in a throwaway dir and idle out quickly
os.environ.setdefault("AUTOTUNE_WARM_DIR", tempfile.mkdtemp(prefix="autotune-test-warm-"))
os.environ.setdefault("AUTOTUNE_WARM_IDLE_S", "60")
os.environ.setdefault("AUTOTUNE_CACHE", os.path.join(tempfile.mkdtemp(prefix="autotune-test-cache-"), "results.sqlite"))
# real-backend studies keep the spec's profile (their tests check the data-sheet predictions); the
# automatic calibration is tested on its own (test_host_profile.py), with a throwaway profile cache
os.environ.setdefault("AUTOTUNE_CALIBRATE", "never")
os.environ.setdefault("AUTOTUNE_PROFILE_CACHE", tempfile.mkdtemp(prefix="autotune-test-profiles-"))
# one MLflow schema for the suite (autotune.tracking.tracker.seed_sqlite_store), never the user's ~/.cache
os.environ.setdefault("AUTOTUNE_MLFLOW_SCHEMA_CACHE", tempfile.mkdtemp(prefix="autotune-test-mlflow-schema-"))


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a YAML spec (dedented) into tmp_path and return its path."""

    def _write(text: str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip())
        return path

    return _write
