"""Exports that would launch something other than what was measured are refused (issue #30):
an inference study exported `launch_megatron.sh` (pretrain_gpt.py, no micro-batch) and a
MindFormers training fragment while its batch, kv-cache dtype and quantization lived only in
best_config.yaml, and said "launch with mindspeed"; a Megatron study at a sequence length above
the model's max_position_embeddings validated and ran although Megatron's validate_args refuses
the launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli.commands import app
from autotune.export import ExportContext
from autotune.finish.exports import EXPORTERS
from autotune.spec.errors import SpecError
from autotune.spec.load import parse_spec

REPO = Path(__file__).resolve().parents[1]


def test_an_inference_study_writes_no_training_launch_and_refuses_one(tmp_path):
    run_dir = tmp_path / "run"
    spec = REPO / "search_spaces" / "llama2_7b_infer_8npu.yaml"
    ran = CliRunner().invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking", "--n-trials", "4"])
    assert ran.exit_code == 0, ran.output
    written = sorted(p.name for p in (run_dir / "export").iterdir())
    assert written == ["best.env", "best_config.yaml"], written
    assert "launch with" not in ran.stderr
    for fmt in ("megatron", "mindformers", "deepspeed", "torchtitan"):
        refused = CliRunner().invoke(app, ["export", str(run_dir), "--format", fmt])
        assert refused.exit_code == 2, (fmt, refused.output)
        assert "training launch" in refused.stderr and "infer workload" in refused.stderr
    default = CliRunner().invoke(app, ["export", str(run_dir), "--json"])
    assert default.exit_code == 0 and set(json.loads(default.stdout)["files"]) == {"yaml", "env"}


LONG = {
    "name": "long",
    "model": "llama2-7b",
    "workload": {"kind": "train", "seq_len": 8192, "global_batch_size": 64},
    "cluster": {"accelerator": "npu", "nodes": 1, "devices_per_node": 8},
    "space": {"tp": [1, 2]},
}


@pytest.mark.parametrize("target", ["megatron", "mindspeed"])
def test_a_sequence_longer_than_the_models_positions_is_a_spec_error_for_megatron(target):
    with pytest.raises(SpecError) as exc:
        parse_spec({**LONG, "target": target}, "long.yaml")
    text = str(exc.value)
    assert "workload.seq_len" in text and "max_position_embeddings 4096" in text and "validate_args" in text
    # the fix it names is accepted: a model mapping with the longer context
    model = {"preset": "llama2-7b", "max_position_embeddings": 8192}
    assert parse_spec({**LONG, "target": target, "model": model}).workload.seq_len == 8192


def test_the_megatron_export_refuses_a_sequence_longer_than_the_positions():
    ctx = ExportContext(
        study="s",
        trial=0,
        config={"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "grad_accum": 8, "precision": "bf16"},
        metrics={},
        model={"num_hidden_layers": 32, "max_position_embeddings": 4096},
        workload={"kind": "train", "seq_len": 8192, "global_batch_size": 64},
        cluster={"nodes": 1, "devices_per_node": 8},
        target="none",
    )
    reasons = EXPORTERS["megatron"].unsupported(ctx)
    assert reasons and "--seq-length 8192 above --max-position-embeddings 4096" in reasons[0]
    ctx.workload["seq_len"] = 4096
    assert EXPORTERS["megatron"].unsupported(ctx) == []


def test_an_env_name_that_is_not_a_shell_name_is_never_written_to_a_shell_file(tmp_path):
    """Issue #31: `baseline: {"env.X=1;touch PWNED;#": v, "env.$(touch PWNED2)": w}` reached
    best.env and launch_megatron.sh, and `source best.env` ran both commands. The spec refuses such
    names; the exporters refuse them too (a study recorded before), and what they write is inert
    under bash."""
    import subprocess

    from autotune.export import ExportRefused
    from autotune.finish.exports import write_exports

    config = {"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "grad_accum": 8, "precision": "bf16"}
    hostile = {**config, "env.X=1;touch PWNED;#": "v", "env.$(touch PWNED2)": "w"}
    ctx = ExportContext(
        study="s",
        trial=0,
        config=hostile,
        metrics={},
        model={"num_hidden_layers": 32},
        workload={"kind": "train", "seq_len": 4096, "global_batch_size": 64},
        cluster={"nodes": 1, "devices_per_node": 8},
        target="megatron",
    )
    for fmt in ("env", "megatron", "torchtitan"):
        assert any("not shell variable names" in r for r in EXPORTERS[fmt].unsupported(ctx)), fmt
    with pytest.raises(ExportRefused):
        write_exports(ctx, tmp_path / "out", ["yaml", "env", "megatron"])
    assert not (tmp_path / "out").exists()
    # a value with shell syntax is quoted: sourcing the file runs nothing
    ctx.config = {**config, "env.PYTORCH_NPU_ALLOC_CONF": "$(touch PWNED3);`touch PWNED4`"}
    paths = write_exports(ctx, tmp_path / "ok", ["env"])
    subprocess.run(
        ["bash", "-c", f'source {paths["env"]} && printf %s "$PYTORCH_NPU_ALLOC_CONF" > value'],
        cwd=tmp_path,
        check=True,
    )
    assert (tmp_path / "value").read_text() == "$(touch PWNED3);`touch PWNED4`"
    assert not list(tmp_path.glob("PWNED*"))
