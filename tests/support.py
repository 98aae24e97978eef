"""Constants and helpers the tests share (imported as ``support``; fixtures stay in conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

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


# The guide's own tests (test_guided.py, test_guided_sampler.py): Llama-2-7B on one 8-NPU node
# with 40 GiB devices, so that memory decides, over a space no single stack restricts.
GUIDED_SPEC = {
    "name": "guided",
    "model": "llama2-7b",
    "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
    "cluster": {"accelerator": "npu", "profile": "ascend-910b", "nodes": 1, "devices_per_node": 8,
                "overrides": {"device_memory_gib": 40}},
    "target": "none",
    "space": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4], "micro_batch_size": [1, 2, 4], "recompute": ["none", "selective", "full"],
              "zero_stage": [0, 1, 3], "sequence_parallel": [False, True]},
    "objectives": [{"metric": "tokens_per_s_per_device", "direction": "maximize"}],
}
