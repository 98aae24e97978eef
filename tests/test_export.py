"""Every export format, parsed by what its stack would use (argparse for the Megatron arguments,
json, yaml.safe_load, tomllib), for a measured trial; plus the CLI's --format and run-directory
forms. One contract test runs over every exporter."""

from __future__ import annotations

import argparse
import json
import shlex
import tomllib

import pytest
import yaml

from autotune.export import EXPORTERS, ExportContext, parse_formats, write_exports

CONFIG = {"tp": 2, "pp": 2, "vpp": 2, "cp": 1, "dp": 2, "micro_batch_size": 2, "grad_accum": 16,
          "sequence_parallel": True, "recompute": "full", "recompute_layers": 4, "zero_stage": 1, "precision": "bf16",
          "env.PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True", "env.HCCL_BUFFSIZE": "200",
          "graph_kernel_flags": "--enable_parallel_fusion --opt_level=2", "jit_level": "O1"}
MODEL = {"name": "llama2-7b", "arch": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096}
SOFTWARE = {"torch": "2.13.0", "torch_npu": "2.13.0", "cann": "8.1.RC1", "driver": "24.1.0"}


@pytest.fixture
def ctx():
    return ExportContext(study="llama2-7b-8npu", trial=7, config=dict(CONFIG),
                         metrics={"tokens_per_s_per_device": 2901.5, "step_time_s": 11.29, "peak_memory_gib": 51.2},
                         source="measured", model=MODEL, workload={"seq_len": 4096, "global_batch_size": 64},
                         cluster={"accelerator": "npu", "nodes": 1, "devices_per_node": 8, "world_size": 8},
                         software=SOFTWARE)


@pytest.mark.parametrize("name", sorted(EXPORTERS))
def test_every_export_carries_the_header(name, ctx):
    text = EXPORTERS[name].render(ctx)
    if name == "deepspeed":
        header = json.loads(text)["_autotune"]
        assert header["study"] == "llama2-7b-8npu" and header["trial"] == 7 and header["source"] == "measured"
        assert header["metrics"]["tokens_per_s_per_device"] == 2901.5 and header["software"] == SOFTWARE
    else:
        head = "\n".join(line for line in text.splitlines()[:8] if line.startswith("#"))
        assert "study llama2-7b-8npu, trial 7, measured" in head
        assert "tokens_per_s_per_device=2901.5" in head
        assert "torch 2.13.0, torch_npu 2.13.0, cann 8.1.RC1, driver 24.1.0" in head


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


def _bash_array(script: str, name: str) -> list[str]:
    lines = script.splitlines()
    start = lines.index(f"{name}=(")
    end = lines.index(")", start)
    return shlex.split(" ".join(lines[start + 1:end]))


def test_megatron_script_parses_with_megatrons_flag_names(ctx):
    script = EXPORTERS["megatron"].render(ctx)
    assert script.startswith("#!/usr/bin/env bash")
    ns = _megatron_parser().parse_args(_bash_array(script, "AUTOTUNE_ARGS"))
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size) == (2, 2)
    assert ns.num_layers_per_virtual_pipeline_stage == 32 // (2 * 2)
    assert (ns.micro_batch_size, ns.global_batch_size) == (2, 64)
    assert ns.sequence_parallel and ns.use_distributed_optimizer and ns.bf16 and not ns.fp16
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "block", 4)
    model = _bash_array(script, "MODEL_ARGS")
    assert model[model.index("--num-query-groups") + 1] == "8" and "--swiglu" in model
    assert "export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True" in script
    assert "export HCCL_BUFFSIZE=200" in script
    assert 'torchrun --nproc-per-node "$NPROC_PER_NODE"' in script and "NPROC_PER_NODE=${NPROC_PER_NODE:-8}" in script


def test_megatron_selective_recompute_and_fp16(ctx):
    ctx.config.update(recompute="selective", precision="fp16", zero_stage=0, vpp=1, sequence_parallel=False)
    ns, rest = _megatron_parser().parse_known_args(_bash_array(EXPORTERS["megatron"].render(ctx), "AUTOTUNE_ARGS"))
    assert not rest
    assert ns.recompute_granularity == "selective" and ns.recompute_method is None
    assert ns.fp16 and not ns.bf16 and not ns.use_distributed_optimizer and not ns.sequence_parallel
    assert ns.num_layers_per_virtual_pipeline_stage is None


def test_deepspeed_json(ctx):
    cfg = json.loads(EXPORTERS["deepspeed"].render(ctx))
    assert cfg["zero_optimization"]["stage"] == 1
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 16
    assert cfg["train_batch_size"] == 2 * 16 * 2
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert "activation_checkpointing" in cfg
    ctx.config.update(precision="fp16", zero_stage=3)
    cfg = json.loads(EXPORTERS["deepspeed"].render(ctx))
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["loss_scale"] == 0 and cfg["zero_optimization"]["stage"] == 3


def test_mindformers_yaml(ctx):
    doc = yaml.safe_load(EXPORTERS["mindformers"].render(ctx))
    pc = doc["parallel_config"]
    assert (pc["data_parallel"], pc["model_parallel"], pc["pipeline_stage"]) == (2, 2, 2)
    assert pc["micro_batch_num"] == 16 and pc["use_seq_parallel"] is True
    assert doc["recompute_config"]["recompute"] is True and doc["recompute_config"]["select_recompute"] is False
    assert doc["context"]["jit_config"] == {"jit_level": "O1"}
    assert doc["context"]["graph_kernel_flags"] == "--enable_parallel_fusion --opt_level=2"
    assert doc["parallel"]["enable_parallel_optimizer"] is True
    assert doc["runner_config"]["batch_size"] == 2


def test_torchtitan_toml(ctx):
    doc = tomllib.loads(EXPORTERS["torchtitan"].render(ctx))
    p = doc["parallelism"]
    assert p["tensor_parallel_degree"] == 2 and p["pipeline_parallel_degree"] == 2
    assert p["data_parallel_shard_degree"] == 2 and p["data_parallel_replicate_degree"] == 1
    assert p["fsdp_reshard_after_forward"] == "never" and p["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert doc["training"]["local_batch_size"] == 32 and doc["training"]["seq_len"] == 4096
    assert doc["training"]["mixed_precision_param"] == "bfloat16"
    assert doc["activation_checkpoint"]["mode"] == "full"
    ctx.config.update(zero_stage=0)
    p = tomllib.loads(EXPORTERS["torchtitan"].render(ctx))["parallelism"]
    assert p["data_parallel_replicate_degree"] == 2 and p["data_parallel_shard_degree"] == 1


def test_env_file_sources_in_a_shell(ctx, tmp_path):
    import subprocess

    path = write_exports(ctx, tmp_path, ["env"])["env"]
    out = subprocess.run(["bash", "-c", f'source "{path}" && echo "$PYTORCH_NPU_ALLOC_CONF|$PYTORCH_CUDA_ALLOC_CONF|'
                                        f'$HCCL_BUFFSIZE|$MS_DEV_GRAPH_KERNEL_FLAGS"'],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "expandable_segments:True|expandable_segments:True|200|--enable_parallel_fusion --opt_level=2"


def test_parse_formats():
    assert parse_formats("all") == list(EXPORTERS)
    assert parse_formats("megatron, deepspeed") == ["megatron", "deepspeed"]
    with pytest.raises(ValueError, match="unknown export format.*nemo"):
        parse_formats("megatron,nemo")


def test_cli_export_from_the_run_directory_in_every_format(write_spec, tmp_path):
    from typer.testing import CliRunner

    from autotune.cli import app
    from support import TINY_TRAIN

    spec = write_spec(TINY_TRAIN)
    run_dir = tmp_path / "study"
    runner = CliRunner()
    assert runner.invoke(app, ["run", str(spec), "--run-dir", str(run_dir), "--no-tracking"]).exit_code == 0
    result = runner.invoke(app, ["export", str(run_dir), "--format", "all", "--out", str(tmp_path / "x"), "--json"])
    assert result.exit_code == 0, result.output
    files = json.loads(result.stdout)["files"]
    assert set(files) == set(EXPORTERS)
    ds = json.loads(open(files["deepspeed"]).read())
    assert ds["_autotune"]["study"] == "tiny" and ds["_autotune"]["source"] == "simulated"
    assert "NOTE: simulated" in open(files["megatron"]).read()
    bad = runner.invoke(app, ["export", str(run_dir), "--format", "nemo"])
    assert bad.exit_code == 2 and "nemo" in bad.output
    not_a_run = runner.invoke(app, ["export", str(tmp_path)])
    assert not_a_run.exit_code == 2 and "not a run directory" in not_a_run.output
