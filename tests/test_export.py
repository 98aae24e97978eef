"""Every export format, parsed by what its stack would use (argparse for the Megatron arguments,
json, yaml.safe_load, tomllib), for a measured trial; plus the CLI's --format and run-directory
forms. One contract test runs over every exporter."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from autotune.export import ExportContext
from autotune.finish.exports import EXPORTERS, parse_formats, write_exports
from autotune.export._base import script_arrays

CONFIG = {
    "tp": 2,
    "pp": 2,
    "vpp": 2,
    "cp": 1,
    "dp": 2,
    "micro_batch_size": 2,
    "grad_accum": 16,
    "sequence_parallel": True,
    "recompute": "full",
    "recompute_layers": 4,
    "zero_stage": 1,
    "precision": "bf16",
    "env.PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "env.HCCL_BUFFSIZE": "200",
    "graph_kernel_flags": "--enable_parallel_fusion --opt_level=2",
    "jit_level": "O1",
}
MODEL = {
    "name": "llama2-7b",
    "arch": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
SOFTWARE = {"torch": "2.13.0", "torch_npu": "2.13.0", "cann": "8.1.RC1", "driver": "24.1.0"}


@pytest.fixture
def ctx():
    return ExportContext(
        study="llama2-7b-8npu",
        trial=7,
        config=dict(CONFIG),
        metrics={"tokens_per_s_per_device": 2901.5, "step_time_s": 11.29, "peak_memory_gib": 51.2},
        source="measured",
        model=MODEL,
        workload={"seq_len": 4096, "global_batch_size": 64},
        cluster={"accelerator": "npu", "nodes": 1, "devices_per_node": 8, "world_size": 8},
        software=SOFTWARE,
    )


PLAIN = {
    "tp": 1,
    "pp": 1,
    "cp": 1,
    "vpp": 1,
    "dp": 8,
    "micro_batch_size": 2,
    "grad_accum": 4,
    "zero_stage": 0,
    "precision": "fp32",
    "recompute": "none",
    "env.HCCL_BUFFSIZE": "200",
}  # every format can launch this
# a serving study's config every serving format can launch (issue #33)
SERVE_PLAIN = {
    "tp": 2,
    "pp": 1,
    "replicas": 2,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 8192,
    "block_size": 128,
    "enable_chunked_prefill": False,
    "enable_prefix_caching": False,
    "memory_utilization": 0.9,
    "graph_mode": "graph",
    "kv_cache_dtype": "auto",
    "quantization": "none",
    "precision": "bf16",
    "world_size": 4,
    "env.HCCL_BUFFSIZE": "200",
}
SERVE_WORKLOAD = {
    "kind": "serve",
    "traffic": {"rates": [1.0, 2.0], "prompt_len": 512, "output_len": 128},
    "max_model_len": 640,
}


@pytest.mark.parametrize("name", sorted(EXPORTERS))
def test_every_export_carries_the_header(name, ctx):
    if EXPORTERS[name].launches == "serve":
        ctx.workload, ctx.config = dict(SERVE_WORKLOAD), dict(SERVE_PLAIN)
    if EXPORTERS[name].unsupported(ctx):
        ctx.config = dict(PLAIN)
    assert EXPORTERS[name].unsupported(ctx) == []
    text = EXPORTERS[name].render(ctx)
    if name in ("deepspeed", "mindie"):
        header = json.loads(text)["_autotune"]
        assert header["study"] == "llama2-7b-8npu" and header["trial"] == 7 and header["source"] == "measured"
        assert header["metrics"]["tokens_per_s_per_device"] == 2901.5 and header["software"] == SOFTWARE
    else:
        head = "\n".join(line for line in text.splitlines()[:8] if line.startswith("#"))
        assert "study llama2-7b-8npu, trial 7, measured" in head
        assert "tokens_per_s_per_device=2901.5" in head
        assert "torch 2.13.0, torch_npu 2.13.0, cann 8.1.RC1, driver 24.1.0" in head


def test_probe_text_cannot_inject_commands_through_the_header(ctx, tmp_path):
    import subprocess

    for name in ("graph_kernel_flags", "jit_level"):  # MindSpore settings: not a Megatron launch
        ctx.config.pop(name)
    ctx.software = {"torch": "2.13.0\ntouch INJECTED"}
    ctx.metrics = {"x\nexport EVIL=1\n": 1.0}
    paths = write_exports(ctx, tmp_path, ["env", "megatron"])
    env_file = paths["env"]
    out = subprocess.run(
        ["bash", "-c", f'source "{env_file}" && echo "[$EVIL]"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "[]" and not (tmp_path / "INJECTED").exists()
    assert all(line.startswith(("#", "export", "")) for line in paths["env"].read_text().splitlines())


def _megatron_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor-model-parallel-size", type=int)
    ap.add_argument("--pipeline-model-parallel-size", type=int)
    ap.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    ap.add_argument("--context-parallel-size", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int)
    ap.add_argument("--global-batch-size", type=int)
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--recompute-granularity", choices=["full", "selective"])
    ap.add_argument("--recompute-method", choices=["uniform", "block"])
    ap.add_argument("--recompute-num-layers", type=int)
    ap.add_argument("--use-distributed-optimizer", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    return ap


def test_megatron_script_parses_with_megatrons_flag_names(ctx):
    script = EXPORTERS["megatron"].render(ctx)
    assert script.startswith("#!/usr/bin/env bash")
    ns = _megatron_parser().parse_args(script_arrays(script)["AUTOTUNE_ARGS"])
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size) == (2, 2)
    assert ns.num_layers_per_virtual_pipeline_stage == 32 // (2 * 2)
    assert (ns.micro_batch_size, ns.global_batch_size) == (2, 64)
    assert ns.sequence_parallel and ns.use_distributed_optimizer and ns.bf16 and not ns.fp16
    # 4 layers per stage, counted per virtual stage by --recompute-method block: 2 in each of the 2 chunks
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "block", 2)
    model = script_arrays(script)["MODEL_ARGS"]
    assert model[model.index("--num-query-groups") + 1] == "8" and "--swiglu" in model
    assert "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in script
    assert "export HCCL_BUFFSIZE=200" in script
    assert 'torchrun --nproc-per-node "$NPROC_PER_NODE"' in script and "NPROC_PER_NODE=${NPROC_PER_NODE:-8}" in script


def test_megatron_selective_recompute_and_fp16(ctx):
    ctx.config.update(recompute="selective", precision="fp16", zero_stage=0, vpp=1, sequence_parallel=False)
    ns, rest = _megatron_parser().parse_known_args(script_arrays(EXPORTERS["megatron"].render(ctx))["AUTOTUNE_ARGS"])
    assert not rest
    assert ns.recompute_granularity == "selective" and ns.recompute_method is None
    assert ns.fp16 and not ns.bf16 and not ns.use_distributed_optimizer and not ns.sequence_parallel
    assert ns.num_layers_per_virtual_pipeline_stage is None


def test_deepspeed_json_names_the_world_it_assumes(ctx):
    assert any("tp/pp/cp > 1" in r for r in EXPORTERS["deepspeed"].unsupported(ctx))  # tp 2: not a DeepSpeed config
    ctx.config.update(tp=1, pp=1, vpp=1, dp=8, grad_accum=4, precision="fp16", zero_stage=3)
    cfg = json.loads(EXPORTERS["deepspeed"].render(ctx))
    assert cfg["train_batch_size"] == 2 * 4 * 8 == ctx.workload["global_batch_size"]
    assert "all 8 ranks" in cfg["_autotune"]["assumes"]
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and cfg["zero_optimization"]["stage"] == 3


def test_mindformers_yaml_puts_grad_accum_where_mindformers_reads_it(ctx):
    doc = yaml.safe_load(EXPORTERS["mindformers"].render(ctx))
    pc = doc["parallel_config"]
    assert (pc["data_parallel"], pc["model_parallel"], pc["pipeline_stage"]) == (2, 2, 2)
    assert pc["micro_batch_num"] == 16 and doc["runner_config"]["gradient_accumulation_steps"] == 1
    assert doc["recompute_config"]["recompute"] == [4, 4] and doc["model"]["model_config"]["pp_interleave_num"] == 2
    # vpp 2 needs MindSpore's interleave too (LayerSetting keeps one chunk without it), and the measured
    # sequence length (MindFormers reads it from the model config only); tests/test_export_mindformers.py
    # checks these with MindFormers' own code
    assert doc["parallel"]["pipeline_config"] == {"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}
    assert doc["model"]["model_config"]["seq_length"] == 4096 and doc["model"]["model_config"]["offset"] == 0
    assert doc["parallel"]["dataset_strategy"] == "full_batch" and doc["micro_batch_interleave_num"] == 1
    assert "graph_kernel_flags" not in doc["context"]  # MindSpore 2.10 ignores it: the env file carries it
    text = EXPORTERS["mindformers"].render(ctx)
    assert "MS_DEV_GRAPH_KERNEL_FLAGS=--enable_parallel_fusion --opt_level=2" in text
    ctx.config.update(pp=1, vpp=1, dp=4, grad_accum=8)  # no pipeline: MindFormers accumulates itself
    doc = yaml.safe_load(EXPORTERS["mindformers"].render(ctx))
    assert doc["parallel_config"]["micro_batch_num"] == 1 and doc["runner_config"]["gradient_accumulation_steps"] == 8
    assert "pipeline_config" not in doc["parallel"] and doc["model"]["model_config"]["pp_interleave_num"] == 1


def test_env_file_sources_in_a_shell(ctx, tmp_path):
    import subprocess

    path = write_exports(ctx, tmp_path, ["env"])["env"]
    out = subprocess.run(
        [
            "bash",
            "-c",
            f'source "{path}" && echo "$PYTORCH_NPU_ALLOC_CONF|$PYTORCH_CUDA_ALLOC_CONF|'
            f'$HCCL_BUFFSIZE|$MS_DEV_GRAPH_KERNEL_FLAGS"',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == "expandable_segments:True|expandable_segments:True|200|--enable_parallel_fusion --opt_level=2"


def test_parse_formats():
    assert parse_formats("all") == list(EXPORTERS)
    assert parse_formats("megatron, deepspeed") == ["megatron", "deepspeed"]
    with pytest.raises(ValueError, match="unknown export format.*nemo"):
        parse_formats("megatron,nemo")


def test_cli_export_from_the_run_directory_in_every_format(write_spec, tmp_path):
    from typer.testing import CliRunner

    from autotune.cli.commands import app
    from support import TINY_TRAIN

    spec = write_spec(TINY_TRAIN)
    run_dir = tmp_path / "study"
    runner = CliRunner()
    assert runner.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"]).exit_code == 0
    result = runner.invoke(app, ["export", str(run_dir), "--format", "all", "--out", str(tmp_path / "x"), "--json"])
    assert result.exit_code == 0, result.output
    files = json.loads(result.stdout)["files"]
    assert {"yaml", "env", "megatron"} <= set(files) <= set(EXPORTERS)
    for name in set(EXPORTERS) - set(files):  # formats that cannot launch the best config say why
        assert f"not exported as {name}" in result.stderr
    assert "NOTE: simulated" in open(files["megatron"]).read()
    bad = runner.invoke(app, ["export", str(run_dir), "--format", "nemo"])
    assert bad.exit_code == 2 and "nemo" in bad.output
    not_a_run = runner.invoke(app, ["export", str(tmp_path)])
    assert not_a_run.exit_code == 2 and "not a run directory" in not_a_run.output
