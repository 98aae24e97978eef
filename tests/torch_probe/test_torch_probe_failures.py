"""Failures end as one protocol line and a non-zero exit, classified by protocol.classify_failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def failure_lines(run):
    return [m for m in run.messages if m.get("event") == "failure"]


def test_injected_nan_is_classified_nan(probe):
    run = probe({"inject_nan_at_step": 1})
    assert run.returncode != 0
    assert run.failure()[0] == "nan", run.tail()
    assert len(failure_lines(run)) == 1
    assert not [m for m in run.messages if "metrics" in m]
    assert len(run.steps) == 2  # step 0 fine, step 1 reported with its NaN loss, then the failure
    assert run.steps[1]["loss"] is None and run.steps[1]["loss_finite"] == 0


def test_soft_memory_limit_is_classified_oom_with_rank_and_size(probe):
    run = probe({}, env={"AUTOTUNE_MEMORY_LIMIT_GIB": "0.05"})
    status, reason = run.failure()
    assert status == "oom", run.tail()
    assert "rank 0" in reason and "GiB" in reason and "requested" in reason


def test_real_allocator_oom_is_classified_oom(probe):
    """An embedding of 2**37 x 128 fp32 (64 TiB) cannot be allocated: the CPU allocator's own
    error, with the requested bytes, becomes 'oom'."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("overcommit_memory=1: a huge allocation would succeed and be OOM-killed later")
    run = probe({}, model={"vocab_size": 2**37})
    status, reason = run.failure()
    assert status == "oom", run.tail()
    assert "rank 0" in reason and "bytes" in reason


@pytest.mark.parametrize(
    "params,model_change,needle",
    [
        ({"pp": 2}, {"num_hidden_layers": 3}, "not divisible by pp*vpp"),
        ({"tp": 2, "dp": 2}, {}, "!= world size 2"),
        ({"pp": 2, "first_stage_layers": 4}, {}, "less first_stage_layers 4 do not split evenly"),
    ],
    ids=["layers-pp", "world", "first-stage"],
)
def test_invalid_config_is_classified_invalid(probe, params, model_change, needle):
    run = probe(params, world=2, model=model_change, launcher="torchrun")
    status, reason = run.failure()
    assert status == "invalid", run.tail()
    assert needle in reason
    assert len(failure_lines(run)) == 1  # every rank found it, rank 0 reported it


@pytest.mark.slow
def test_nan_from_env_under_tp_fails_all_ranks_together(probe):
    run = probe({"tp": 2}, world=2, env={"AUTOTUNE_INJECT_NAN_STEP": "0"})
    assert run.failure()[0] == "nan", run.tail()
    assert len(failure_lines(run)) == 1


def test_missing_trial_file_is_invalid():
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_TRIAL_FILE"}
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.workers.torch_probe"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode != 0
    assert '"status": "invalid"' in proc.stdout


@pytest.mark.slow
def test_spawn_launcher_stops_its_ranks_on_sigterm(tmp_path, make_trial):
    """The dispatcher's deadline kills the launcher; the ranks must not outlive it."""
    import signal
    import time

    from autotune.workers.protocol import write_trial_file
    from autotune.workers.torch_probe.launch import spawn_argv

    request = make_trial({"dp": 2}, 2, {"measured_steps": 10_000})
    trial = write_trial_file(request, tmp_path / "trial.json")
    proc = subprocess.Popen(
        spawn_argv(request, sys.executable, str(trial)), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    first = proc.stdout.readline()  # the first step event: the ranks are up and training
    assert '"event": "step"' in first
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) != 0
    time.sleep(0.5)
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
