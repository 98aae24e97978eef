"""Shared fixtures: spec files written into tmp dirs, the repo paths, Ray kept quiet."""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# the result cache of real probes goes to a throwaway file, never the user's ~/.cache
os.environ.setdefault("AUTOTUNE_CACHE", os.path.join(tempfile.mkdtemp(prefix="autotune-test-cache-"), "results.sqlite"))


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a YAML spec (dedented) into tmp_path and return its path."""

    def _write(text: str, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip())
        return path

    return _write


TINY_TRAIN = """
name: tiny
model: tiny-llama
workload: {kind: train, seq_len: 128, global_batch_size: 8, warmup_steps: 1, measured_steps: 2}
cluster: {accelerator: cpu, nodes: 1, devices_per_node: 2}
backend: simulate
space:
  tp: [1, 2]
  pp: [1, 2]
  micro_batch_size: [1, 2, 4]
  zero_stage: [0, 1, 3]
  recompute: [none, full]
objectives: [tokens_per_s_per_device]
search: {n_trials: 6, seed: 1}
"""


def read_pid(path: Path, within_s: float = 30.0) -> int:
    """The pid a test probe wrote into ``path`` (waiting for the probe to start)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} was never written")
