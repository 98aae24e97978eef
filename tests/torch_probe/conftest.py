"""Helpers for the torch probe tests: a tiny Llama preset, trial files, and running the probe as
the dispatcher does (spawn.py or torchrun for several ranks, a plain ``python -m`` for one).

Probe runs are subprocesses: the probe owns its process (process group, os._exit), and that is
how it runs in production.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from autotune.workers.protocol import TrialRequest, classify_failure, parse_output_line, write_trial_file

# Tiny Llama: GQA (4 heads, 2 kv heads), 4 layers so pp2 and pp2·vpp2 split evenly.
TINY_MODEL: dict[str, Any] = dict(
    arch="llama",
    name="tiny-test",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TINY_TRAIN: dict[str, Any] = dict(
    kind="train", seq_len=64, global_batch_size=4, warmup_steps=1, measured_steps=2, timeout_s=120, profile_step=False
)
PROBE_TIMEOUT_S = 240


def make_request(
    params: dict[str, Any], world: int = 1, workload: dict[str, Any] | None = None, model: dict[str, Any] | None = None
) -> TrialRequest:
    wl = dict(TINY_TRAIN)
    wl.update(workload or {})
    return TrialRequest(
        params=dict(params),
        model=dict(model or TINY_MODEL),
        workload=wl,
        cluster=dict(
            accelerator="cpu",
            nodes=1,
            devices_per_node=world,
            world_size=world,
            hardware={"peak_tflops": {"bf16": 1.0, "fp16": 1.0, "fp32": 0.5}},
        ),
        study="test",
        number=0,
        backend={},
    )


@dataclass
class ProbeRun:
    returncode: int
    stdout: str
    stderr: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("event") == "step"]

    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    @property
    def metrics(self) -> dict[str, float]:
        found = [m for m in self.messages if "metrics" in m]
        assert len(found) == 1, f"expected one metrics line, got {len(found)}\n{self.tail()}"
        return found[0]["metrics"]

    @property
    def result(self) -> dict[str, Any]:
        return next(m for m in self.messages if "metrics" in m)

    def failure(self) -> tuple[str, str]:
        return classify_failure(self.returncode, self.stdout.splitlines() + self.stderr.splitlines())

    def tail(self) -> str:
        return self.stdout[-3000:] + "\n--- stderr ---\n" + self.stderr[-6000:]


def run_probe(
    tmp_path: Path,
    request: TrialRequest,
    env: dict[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT_S,
    launcher: str = "spawn",
) -> ProbeRun:
    """One trial as the dispatcher runs it: ``launcher`` 'spawn' (spawn.py), 'warm' (warm.py, ranks
    forked from a server with torch imported) or 'torchrun' (launch.torchrun_argv); a world of one
    runs plainly with ``python -m``."""
    from autotune.workers.torch_probe.launch import spawn_argv, torchrun_argv, warm_argv

    trial = write_trial_file(request, tmp_path / f"trial_{abs(hash(json.dumps(request.params, sort_keys=True)))}.json")
    world = int(request.cluster["world_size"])
    if world == 1:
        argv = [sys.executable, "-m", "autotune.workers.torch_probe", str(trial)]
    elif launcher == "torchrun":
        argv = torchrun_argv(request, sys.executable, str(trial))
    elif launcher == "warm":
        argv = warm_argv(request, sys.executable, str(trial))
    else:
        argv = spawn_argv(request, sys.executable, str(trial))
    full_env = dict(os.environ)
    for key in ("AUTOTUNE_MEMORY_LIMIT_GIB", "AUTOTUNE_INJECT_NAN_STEP", "AUTOTUNE_ARTIFACT_DIR"):
        full_env.pop(key, None)
    full_env.update(env or {})
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env)
    messages = [m for m in (parse_output_line(line) for line in proc.stdout.splitlines()) if m]
    return ProbeRun(proc.returncode, proc.stdout, proc.stderr, messages)


@pytest.fixture
def probe(tmp_path: Path):
    """``probe(params, world=1, workload=None, env=None, model=None, launcher='spawn') -> ProbeRun``;
    ``model`` holds overrides of the tiny preset's fields."""

    def _run(
        params: dict[str, Any],
        world: int = 1,
        workload: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        model: dict[str, Any] | None = None,
        launcher: str = "spawn",
    ) -> ProbeRun:
        request = make_request(params, world, workload, dict(TINY_MODEL, **(model or {})))
        return run_probe(tmp_path, request, env, launcher=launcher)

    return _run


@pytest.fixture
def make_trial():
    """``make_trial(params, world=1, workload=None, model=None) -> TrialRequest`` (tiny model)."""
    return make_request


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of the single-process fp32 run: what every decomposition must reproduce."""
    run = run_probe(tmp_path_factory.mktemp("reference"), make_request({"precision": "fp32"}, 1))
    assert run.returncode == 0, run.tail()
    return run.losses
