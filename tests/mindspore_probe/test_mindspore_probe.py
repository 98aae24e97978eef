"""The MindSpore probe (workers/mindspore_probe). The plan checks and the launch argv run in
this environment; the probe itself runs in MindSpore's own environment (the README's set-up
creates ./.venv-mindspore; AUTOTUNE_MINDSPORE_PYTHON names another) and is skipped without it.
What runs here is what MindSpore's CPU backend supports: graph and pynative mode, jit levels,
graph-kernel flags, full and selective recompute, fp32 and fp16 with loss scaling, gradient
accumulation, data parallel through msrun (slow), and the oom / nan / invalid classifications."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest

from autotune.workers.mindspore_probe import launch
from autotune.workers.protocol import TrialRequest, classify_failure, parse_output_line
from support import REPO

TINY = {
    "name": "tiny",
    "arch": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 172,
    "vocab_size": 512,
}
TRIAL = {
    "params": {"micro_batch_size": 2, "recompute": "none", "precision": "fp32", "mode": "graph"},
    "model": TINY,
    "workload": {"kind": "train", "seq_len": 32, "global_batch_size": 4, "warmup_steps": 1, "measured_steps": 2},
    "cluster": {"accelerator": "cpu", "world_size": 1},
    "study": "t",
    "number": 0,
}


def _probe_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ms_probe_under_test", launch.PROBE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import: MindSpore is imported inside run()
    return module


def _trial(**params) -> dict:
    t = copy.deepcopy(TRIAL)
    t["params"].update(params)
    return t


# ---- without MindSpore -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, words",
    [
        ({"tp": 2}, "semi-auto parallel"),
        ({"pp": 2}, "only on Ascend"),
        ({"zero_stage": 1}, "runs only on Ascend"),
        ({"zero_stage": 3}, "optimizer states only"),
        ({"precision": "bf16"}, "no bf16 kernels"),
        ({"micro_batch_size": 3}, "not a multiple"),
        ({"mode": "eager"}, "expected graph or pynative"),
        ({"jit_level": "O2"}, "takes O0 or O1"),
    ],
)
def test_what_the_probe_cannot_run_is_invalid_before_mindspore_starts(params, words):
    probe = _probe_module()
    with pytest.raises(probe.ProbeFailure) as info:
        probe.resolve_plan(_trial(**params), world=1)
    assert info.value.status == "invalid" and words in info.value.reason


def test_plan_defaults_flags_and_environment(monkeypatch):
    probe = _probe_module()
    plan = probe.resolve_plan(_trial(graph_kernel_flags="--opt_level=2", **{"env.MS_ALLOC_CONF": "enable_vmm:True"}), 1)
    assert plan["jit_level"] == "O1"  # graph-kernel fusion needs O1
    assert plan["grad_accum"] == 2 and not plan["notes"]
    monkeypatch.setattr(os, "environ", dict(os.environ))
    applied = probe.prepare_env(plan)
    assert applied == {"MS_ALLOC_CONF": "enable_vmm:True", "MS_DEV_GRAPH_KERNEL_FLAGS": "--opt_level=2"}
    assert os.environ["MS_DEV_GRAPH_KERNEL_FLAGS"] == "--opt_level=2"
    noted = probe.resolve_plan(_trial(graph_kernel_flags="--opt_level=2", jit_level="O0"), 1)
    assert "no effect" in noted["notes"][0]


def test_launch_argv_single_process_and_msrun(tmp_path):
    req = TrialRequest(params={}, model=TINY, workload={}, cluster={"accelerator": "cpu", "world_size": 1})
    assert launch.probe_argv(req, "/env/bin/python", "t.json") == [
        "/env/bin/python",
        str(launch.PROBE_SCRIPT),
        "t.json",
    ]
    req2 = TrialRequest(
        params={}, model=TINY, workload={}, cluster={"accelerator": "npu", "nodes": 1, "devices_per_node": 8}
    )
    argv = launch.probe_argv(req2, "/env/bin/python", "t.json", log_dir=str(tmp_path))
    assert argv[0] == "/env/bin/msrun" and argv[argv.index("--worker_num") + 1] == "8"
    assert "--join=True" in argv and argv[argv.index("--tail_worker_log") + 1] == "0"
    assert argv[-2:] == [str(launch.PROBE_SCRIPT), "t.json"]
    assert launch.probe_env("/env/bin/python", "/usr/bin")["PATH"] == "/env/bin" + os.pathsep + "/usr/bin"
    # across nodes: one msrun per node, the whole world in --worker_num, this node's share local,
    # node 0's address and port and this node's rank filled in by the dispatcher
    req4 = TrialRequest(
        params={}, model=TINY, workload={}, cluster={"accelerator": "npu", "nodes": 4, "devices_per_node": 8}
    )
    argv = launch.probe_argv(req4, "/env/bin/python", "t.json", log_dir=str(tmp_path))
    assert argv[argv.index("--worker_num") + 1] == "32" and argv[argv.index("--local_worker_num") + 1] == "8"
    assert [argv[argv.index(f) + 1] for f in ("--master_addr", "--master_port", "--node_rank")] == [
        "{master_addr}",
        "{master_port}",
        "{node_rank}",
    ]


def test_a_missing_mindspore_environment_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(launch.MINDSPORE_PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no MindSpore environment found.*backend.python"):
        launch.resolve_python(None, tmp_path)
    with pytest.raises(ValueError, match="nope/bin/python"):
        launch.resolve_python("nope/bin/python", tmp_path)


# ---- with MindSpore ----------------------------------------------------------------------------


def _ms_python() -> str | None:
    try:
        return launch.resolve_python(None, REPO)
    except ValueError:
        return None


MS_PYTHON = _ms_python()
needs_mindspore = pytest.mark.skipif(
    MS_PYTHON is None, reason="no MindSpore environment (README set-up: .venv-mindspore)"
)


def _run(tmp_path: Path, trial: dict, env: dict | None = None, timeout: float = 240) -> tuple[int, list[dict], str]:
    path = tmp_path / f"trial_{abs(hash(json.dumps(trial, sort_keys=True)))}.json"
    path.write_text(json.dumps(trial))
    req = TrialRequest(
        params=trial["params"], model=trial["model"], workload=trial["workload"], cluster=trial["cluster"]
    )
    argv = launch.probe_argv(req, MS_PYTHON, str(path), log_dir=str(tmp_path / "msrun"))
    full_env = {**os.environ, **launch.probe_env(MS_PYTHON), **(env or {})}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=tmp_path)
    messages = [m for m in (parse_output_line(line) for line in proc.stdout.splitlines()) if m]
    return proc.returncode, messages, proc.stdout[-2000:] + proc.stderr[-3000:]


def _metrics(messages: list[dict]) -> dict:
    return next(m for m in messages if "metrics" in m)["metrics"]


@needs_mindspore
@pytest.mark.parametrize(
    "params",
    [
        {"mode": "graph"},
        {"mode": "pynative", "recompute": "full"},
        {"mode": "graph", "recompute": "selective", "micro_batch_size": 1},  # grad accumulation 4
        {"mode": "graph", "precision": "fp16"},
        pytest.param(  # 50 s of graph-kernel compilation on 2 cores: the opt-in step (CI's 25-minute goal)
            {"mode": "graph", "jit_level": "O1", "graph_kernel_flags": "--opt_level=2 --enable_cluster_ops=MatMul"},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["graph", "pynative-full-recompute", "selective-recompute-ga4", "fp16-loss-scale", "graph-kernel-O1"],
)
def test_trains_and_reports_the_protocol(tmp_path, params):
    rc, messages, tail = _run(tmp_path, _trial(**params))
    assert rc == 0, tail
    steps = [m for m in messages if m.get("event") == "step"]
    assert [s["phase"] for s in steps] == ["warmup", "measure", "measure"]
    metrics = _metrics(messages)
    assert metrics["loss_finite"] == 1 and metrics["tokens_per_s_per_device"] > 0 and metrics["peak_memory_gib"] > 0
    info = next(m for m in messages if "metrics" in m)["info"]
    assert info["software"]["mindspore"] and info["mode"] == params["mode"]
    assert info["peak_memory_counts"] == "device"  # on the CPU the peak is the process's RSS


@needs_mindspore
def test_injected_nan_is_nan_and_memory_limit_is_oom(tmp_path):
    rc, messages, tail = _run(tmp_path, _trial(), env={"AUTOTUNE_INJECT_NAN_STEP": "1"})
    assert rc != 0 and classify_failure(rc, tail.splitlines())[0] == "nan", tail
    rc, messages, tail = _run(tmp_path, _trial(), env={"AUTOTUNE_MEMORY_LIMIT_GIB": "0.01"})
    status, reason = classify_failure(rc, tail.splitlines())
    assert status == "oom" and "rank 0" in reason, tail


@needs_mindspore
@pytest.mark.slow
def test_data_parallel_through_msrun(tmp_path):
    trial = _trial(micro_batch_size=1, dp=2)
    trial["cluster"]["world_size"] = 2
    rc, messages, tail = _run(tmp_path, trial)
    assert rc == 0, tail
    assert _metrics(messages)["tokens_per_s"] == pytest.approx(2 * _metrics(messages)["tokens_per_s_per_device"])


@needs_mindspore
@pytest.mark.slow
def test_a_mindspore_cpu_study_runs_end_to_end_with_measurements_in_mlflow(tmp_path, monkeypatch):
    """`autotune run` on the shipped tiny MindSpore spec (3 trials): real measurements, MLflow
    children tagged measured, and the MindFormers export of the best."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    monkeypatch.setenv(launch.MINDSPORE_PYTHON_ENV, MS_PYTHON)
    run_dir = tmp_path / "study"
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(REPO / "search_spaces" / "tiny_llama_cpu_mindspore.yaml"),
            "--run-dir",
            str(run_dir),
            "--n-trials",
            "3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["source"] == "measured" and payload["best"]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-llama-cpu-mindspore")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 3 and {r.data.tags["autotune.source"] for r in children} == {"measured"}
    import yaml

    mf = yaml.safe_load((run_dir / "export" / "mindformers_parallel.yaml").read_text())
    assert mf["context"]["jit_config"]["jit_level"] in ("O0", "O1")


def test_the_npu_mindspore_spec_previews_on_the_simulator_without_npus(monkeypatch):
    """`autotune run search_spaces/llama2_7b_8npu_mindspore.yaml` on a machine without NPUs: the
    simulator, announced; `--backend mindspore` would force the probes."""
    from autotune.dispatch.backends import select_backend
    from autotune.spec.load import load_spec

    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    spec = load_spec(REPO / "search_spaces" / "llama2_7b_8npu_mindspore.yaml")
    monkeypatch.setattr("autotune.dispatch.backends.visible_devices", lambda accelerator: 0)
    choice = select_backend(spec)
    assert choice.kind == "simulate" and "no NPU is visible" in choice.reason
    assert select_backend(spec, "mindspore").kind == "mindspore"
    monkeypatch.setattr("autotune.dispatch.backends.visible_devices", lambda accelerator: 8)
    assert select_backend(spec).kind == "mindspore"
