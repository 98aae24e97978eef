"""Which backend measures a study (issue #30: "A stack preset silently becomes a simulation").

A preset spec on npu/cuda whose stack (and its torch_npu) lives in another environment must run
the stack, not the simulator; ``--backend`` takes every backend kind the spec does."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from autotune.dispatch.backends import select_backend
from autotune.cli.commands import app
from autotune.spec.schema import BACKEND_KINDS
from autotune.spec.load import parse_spec


def _preset(kind: str = "megatron", accelerator: str = "npu") -> dict:
    return {
        "name": "p",
        "model": "llama2-7b",
        "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
        "cluster": {"accelerator": accelerator, "nodes": 1, "devices_per_node": 8},
        "backend": {"kind": kind, "entry": "pretrain_gpt.py"},
        "space": {"tp": [1, 2]},
    }


@pytest.mark.parametrize("accelerator", ["npu", "cuda"])
@pytest.mark.parametrize("kind", ["megatron", "mindspeed", "deepspeed"])
def test_a_preset_runs_its_stack_where_autotunes_interpreter_sees_no_device(monkeypatch, kind, accelerator):
    monkeypatch.setattr("autotune.dispatch.backends.visible_devices", lambda acc: 0)
    spec = parse_spec(_preset(kind, accelerator))
    choice = select_backend(spec)
    assert choice.kind == kind and not choice.simulated, choice.reason
    assert select_backend(spec, kind).kind == kind  # --backend KIND names the spec's own preset


def test_npu_devices_count_without_torch_npu_in_autotunes_environment(monkeypatch, tmp_path):
    from autotune.dispatch import backends

    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(
        backends.glob, "glob", lambda pattern: ["/dev/davinci0", "/dev/davinci1"] if "davinci" in pattern else []
    )
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None)
    assert backends.visible_devices("npu") == 2
    # auto still needs an NPU runtime in this interpreter for its own torch probe, and says so
    spec = parse_spec({**_preset(), "backend": {"kind": "auto"}})
    choice = select_backend(spec)
    assert choice.simulated and "torch_npu is not installed" in choice.reason


def test_run_backend_option_takes_every_backend_kind(tmp_path):
    assert {"megatron", "mindspeed", "torchtitan", "deepspeed", "mindspore", "torch", "command"} <= set(BACKEND_KINDS)
    spec = tmp_path / "p.yaml"
    import yaml

    spec.write_text(yaml.safe_dump(_preset("megatron")))
    result = CliRunner().invoke(
        app, ["run", str(spec), "--backend", "torchtitan", "--run-dir", str(tmp_path / "r"), "--no-tracking"]
    )
    assert result.exit_code == 2
    assert "expected auto, simulate" not in result.output  # not the old list that left the presets out
    assert "backend.kind: torchtitan" in result.output
    bad = CliRunner().invoke(
        app, ["run", str(spec), "--backend", "nonsense", "--run-dir", str(tmp_path / "r"), "--no-tracking"]
    )
    assert bad.exit_code == 2 and "megatron" in bad.output and "deepspeed" in bad.output
