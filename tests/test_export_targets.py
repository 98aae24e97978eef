"""Every export checked by the code of the tool that reads it, and read back from what that code
parsed: global batch, micro-batch, parallel sizes, vpp, recomputed layers, optimizer sharding and
precision must be the measured config's (issue: "exports the real tools accept").

- Megatron-LM / MindSpeed-LLM: megatron-core's config classes (PyPI); Megatron-LM's own
  ``parse_args`` + ``validate_args`` from a source checkout named by ``AUTOTUNE_MEGATRON_LM``
  (skipped without one); MindSpeed's Llama flags against its example script (golden fixture).
- DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig`` with the world a plain
  ``deepspeed.initialize`` sees.
- torchtitan 0.3: its ``ConfigManager`` (tyro) on the exported command line.
- MindFormers: tests/test_export_mindformers.py (MindFormers 2.1.0's own config, trainer and network code in
  .venv-mindspore).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from autotune.export import ExportContext, ExportRefused
from autotune.finish.exports import EXPORTERS, write_exports
from autotune.export._base import script_arrays
from autotune.export._megatron import MINDSPEED_FLAGS
from autotune.export._torchtitan import activation_checkpoint_subcommand
from autotune.spec.space import Space
from autotune.spec.load import parse_spec
from autotune.stacks import STACKS, target_of, unsupported_reasons

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA2_7B = {
    "name": "llama2-7b",
    "arch": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
LLAMA3_8B = {
    **LLAMA2_7B,
    "name": "llama3-8b",
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def cfg(tp=1, pp=1, cp=1, vpp=1, mbs=1, sp=False, rc="none", rl=None, zero=0, prec="bf16", world=8, gbs=64):
    """A canonical config as the space resolves it (dp and grad_accum derived)."""
    dp = world // (tp * pp * cp)
    out = {
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "vpp": vpp,
        "dp": dp,
        "micro_batch_size": mbs,
        "grad_accum": gbs // (mbs * dp),
        "sequence_parallel": sp,
        "recompute": rc,
        "zero_stage": zero,
        "precision": prec,
    }
    if rl is not None:
        out["recompute_layers"] = rl
    return out


# Seven different best configs (Megatron / MindSpeed / MindFormers can launch all of them)
MEGATRON_CONFIGS = {
    "dp8-zero1": cfg(mbs=2, zero=1),
    "tp2-pp2-vpp2-rl4": cfg(tp=2, pp=2, vpp=2, sp=True, rc="full", rl=4, zero=1),
    "tp4-cp2-selective-fp16": cfg(tp=4, cp=2, sp=True, rc="selective", prec="fp16"),
    "tp8-mbs4": cfg(tp=8, mbs=4, sp=True),
    "pp4-vpp2-full-fp16": cfg(pp=4, vpp=2, mbs=2, rc="full", zero=1, prec="fp16"),
    "tp2-rl8-fp32": cfg(tp=2, rc="full", rl=8, prec="fp32"),
    "llama3-2node-pp2": cfg(pp=2, zero=1, world=16, gbs=128),
}
DEEPSPEED_CONFIGS = {
    "zero1-bf16": cfg(mbs=2, zero=1),
    "zero3-full": cfg(zero=3, rc="full"),
    "zero2-fp16": cfg(mbs=4, zero=2, prec="fp16"),
    "zero0-fp32": cfg(prec="fp32"),
    "2node-zero3": cfg(zero=3, mbs=2, world=16, gbs=128),
}
TORCHTITAN_CONFIGS = {
    "tp2-pp2-vpp2-zero3": cfg(tp=2, pp=2, vpp=2, sp=True, rc="full", zero=3),
    "dp8-zero2-selective": cfg(mbs=2, zero=2, rc="selective"),
    "tp2-zero0-fp32": cfg(tp=2, prec="fp32"),
    "pp2-cp2-zero3": cfg(pp=2, cp=2, zero=3),
    "tp2-zero2-nosp": cfg(tp=2, zero=2, mbs=4),
}


def context(config: dict[str, Any], target: str, model: dict[str, Any] | None = None) -> ExportContext:
    world = config["dp"] * config["tp"] * config["pp"] * config["cp"]
    model = model or (LLAMA3_8B if world == 16 else LLAMA2_7B)
    gbs = config["micro_batch_size"] * config["grad_accum"] * config["dp"]
    return ExportContext(
        study="s",
        trial=3,
        config=dict(config),
        metrics={"tokens_per_s_per_device": 1.0},
        source="measured",
        model=model,
        workload={"seq_len": 4096, "global_batch_size": gbs},
        cluster={"nodes": world // 8, "devices_per_node": 8, "world_size": world},
        target=target,
    )


def launched(config: dict[str, Any]) -> dict[str, Any]:
    """What a launch must reproduce: the measured config's batch, parallel and memory settings."""
    return {
        "global_batch": config["micro_batch_size"] * config["grad_accum"] * config["dp"],
        "micro_batch": config["micro_batch_size"],
        "tp": config["tp"],
        "pp": config["pp"],
        "cp": config["cp"],
        "dp": config["dp"],
        "vpp": config["vpp"] if config["pp"] > 1 else 1,
        "recompute": config["recompute"],
        "recompute_layers_per_stage": (config.get("recompute_layers") or 32 // config["pp"])
        if config["recompute"] == "full"
        else 0,
        "zero_stage": config["zero_stage"],
        "precision": config["precision"],
    }


def _flags(argv: list[str]) -> dict[str, Any]:
    """``--a-b v`` -> {"a_b": "v"}, a bare flag -> True (the argparse dest names Megatron uses)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        name = argv[i].lstrip("-").replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[name] = argv[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    return out


# ------------------------------------------------------------------------------- the space
@pytest.mark.parametrize("target", [name for name, stack in STACKS.items() if not stack.serving])
def test_the_space_holds_only_configs_the_target_can_launch(target):
    spec = parse_spec(
        {
            "name": "t",
            "model": "llama2-7b",
            "target": target,
            "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
            "cluster": {"accelerator": "npu", "devices_per_node": 8},
            "space": {
                "tp": [1, 2, 4],
                "pp": [1, 2],
                "vpp": [1, 2],
                "micro_batch_size": [1, 2],
                "recompute": ["none", "selective", "full"],
                "recompute_layers": [2, 3, 16],
                "zero_stage": [0, 1, 2, 3],
                "precision": ["bf16", "fp16", "fp32"],
            },
        }
    )
    enumeration = Space(spec).enumerate()
    assert enumeration.configs
    assert any(reason.startswith(f"target {target}:") for reason in enumeration.invalid_reasons)
    for config in enumeration.configs:
        assert unsupported_reasons(target, config) == [], config
    zeros = {c["zero_stage"] for c in enumeration.configs}
    if target in ("megatron", "mindspeed", "mindformers"):
        assert zeros == {0, 1}
    if target == "torchtitan":
        assert 1 not in zeros and all(c["precision"] != "fp16" for c in enumeration.configs)
    if target == "deepspeed":
        assert all(c["tp"] == c["pp"] == 1 for c in enumeration.configs)


def test_a_config_the_target_cannot_express_is_refused_at_export_with_the_reason(tmp_path):
    zero2 = cfg(mbs=2, zero=2)
    with pytest.raises(ExportRefused, match=r"megatron cannot launch trial 3's config: .*ZeRO-1"):
        write_exports(context(zero2, "mindspeed"), tmp_path, ["yaml", "megatron"])
    assert not list(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(ExportRefused, match="tp/pp/cp > 1"):
        write_exports(context(cfg(tp=2), "megatron"), tmp_path, ["deepspeed"])
    with pytest.raises(ExportRefused, match="no ZeRO-1"):
        write_exports(context(cfg(zero=1), "megatron"), tmp_path, ["torchtitan"])
    assert write_exports(context(zero2, "deepspeed"), tmp_path, ["deepspeed"])  # DeepSpeed has ZeRO-2


def test_default_target_follows_the_backend():
    base = {"name": "t", "model": "tiny-llama", "workload": {"kind": "train", "seq_len": 64, "global_batch_size": 8}}
    assert target_of(parse_spec({**base, "cluster": {"accelerator": "npu"}})) == "mindspeed"
    assert target_of(parse_spec({**base, "cluster": {"accelerator": "cuda"}})) == "megatron"
    assert (
        target_of(
            parse_spec({**base, "cluster": {"accelerator": "cpu", "devices_per_node": 1}, "backend": "mindspore"})
        )
        == "mindformers"
    )
    assert target_of(parse_spec({**base, "target": "torchtitan"})) == "torchtitan"


# ---------------------------------------------------------------------- Megatron / MindSpeed
def _megatron_script(config: dict[str, Any], target: str) -> tuple[str, dict[str, list[str]]]:
    ctx = context(config, target)
    assert EXPORTERS["megatron"].unsupported(ctx) == []
    script = EXPORTERS["megatron"].render(ctx)
    return script, script_arrays(script)


def _script_env(script: str) -> dict[str, str]:
    env = {}
    for line in script.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].split("  #")[0].partition("=")
            env[key] = value.strip().strip("'")
    return env


def _megatron_core_readback(args: dict[str, Any]) -> dict[str, Any]:
    """Build megatron-core's own config objects from the script's arguments and read them back."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    layers = int(args["num_layers"])
    pp = int(args["pipeline_model_parallel_size"])
    per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
    vpp = layers // pp // int(per_chunk) if per_chunk else None
    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else torch.float32
    tc = TransformerConfig(
        num_layers=layers,
        num_layers_in_first_pipeline_stage=args.get("num_layers_in_first_pipeline_stage"),
        hidden_size=int(args["hidden_size"]),
        num_attention_heads=int(args["num_attention_heads"]),
        ffn_hidden_size=int(args["ffn_hidden_size"]),
        num_query_groups=int(args.get("num_query_groups") or args["num_attention_heads"]),
        tensor_model_parallel_size=int(args["tensor_model_parallel_size"]),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=int(args.get("context_parallel_size", 1)),
        sequence_parallel=bool(args.get("sequence_parallel")),
        recompute_granularity=args.get("recompute_granularity"),
        recompute_method=args.get("recompute_method"),
        recompute_num_layers=int(args["recompute_num_layers"]) if "recompute_num_layers" in args else None,
        bf16=bool(args.get("bf16")),
        fp16=bool(args.get("fp16")),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        hidden_dropout=float(args["hidden_dropout"]),
        attention_dropout=float(args["attention_dropout"]),
        gated_linear_unit=bool(args.get("swiglu")),
        add_bias_linear=not args.get("disable_bias_linear"),
        normalization=args["normalization"],
        layernorm_epsilon=float(args["norm_epsilon"]),
    )
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=bool(args.get("use_distributed_optimizer")))
    return {"tc": tc, "ddp": ddp}


@pytest.mark.parametrize("target", ["megatron", "mindspeed"])
@pytest.mark.parametrize("name", sorted(MEGATRON_CONFIGS))
def test_megatron_export_builds_megatron_cores_configs_and_launches_the_measured_config(name, target):
    config = MEGATRON_CONFIGS[name]
    script, arrays = _megatron_script(config, target)
    args = _flags(arrays["MODEL_ARGS"] + arrays["AUTOTUNE_ARGS"])
    core = _megatron_core_readback(args)
    tc, ddp = core["tc"], core["ddp"]
    world = config["dp"] * config["tp"] * config["pp"] * config["cp"]
    dp = world // (tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size * tc.context_parallel_size)
    vpp = tc.virtual_pipeline_model_parallel_size or 1
    per_stage = (
        (
            tc.recompute_num_layers * vpp
            if tc.recompute_method == "block"
            else tc.num_layers // tc.pipeline_model_parallel_size
        )
        if tc.recompute_granularity == "full"
        else 0
    )
    got = {
        "global_batch": int(args["global_batch_size"]),
        "micro_batch": int(args["micro_batch_size"]),
        "tp": tc.tensor_model_parallel_size,
        "pp": tc.pipeline_model_parallel_size,
        "cp": tc.context_parallel_size,
        "dp": dp,
        "vpp": vpp,
        "recompute": tc.recompute_granularity or "none",
        "recompute_layers_per_stage": per_stage,
        "zero_stage": 1 if ddp.use_distributed_optimizer else 0,
        "precision": "bf16" if tc.bf16 else "fp16" if tc.fp16 else "fp32",
    }
    assert got == launched(config)
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0  # Llama has no dropout
    assert _script_env(script)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    rope = float(args["rotary_base"])
    assert rope == (500000.0 if world == 16 else 10000.0)
    assert (arrays["STACK_ARGS"][: len(MINDSPEED_FLAGS)] == list(MINDSPEED_FLAGS)) == (target == "mindspeed")
    if target == "mindspeed" and config["cp"] > 1:  # ring attention, not the Ulysses default of older MindSpeed
        assert arrays["STACK_ARGS"][-2:] == ["--context-parallel-algo", "megatron_cp_algo"]


@pytest.mark.parametrize("target", ["megatron", "mindspeed"])
def test_a_first_stage_of_its_own_size_builds_those_layers_in_megatron_core(target):
    """first_stage_layers: Megatron-LM's --decoder-first-pipeline-num-layers (megatron-core's
    num_layers_in_first_pipeline_stage: its own get_num_layers_to_build gives each rank its layers),
    MindSpeed-LLM's --num-layer-list (every stage's layers, as its Llama-3-70B example writes them)."""
    config = {**cfg(pp=4, zero=1), "first_stage_layers": 5}  # 32 layers: 5, then 9 on each of the other three
    _, arrays = _megatron_script(config, target)
    args = _flags(arrays["MODEL_ARGS"] + arrays["AUTOTUNE_ARGS"])
    if target == "mindspeed":
        assert args["num_layer_list"] == "5,9,9,9" and "decoder_first_pipeline_num_layers" not in args
        return
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    args["num_layers_in_first_pipeline_stage"] = int(args.pop("decoder_first_pipeline_num_layers"))
    tc = _megatron_core_readback(args)["tc"]
    assert [get_num_layers_to_build(tc, pp_rank=r) for r in range(4)] == [5, 9, 9, 9]


def test_stacks_that_cannot_write_a_first_stage_of_its_own_size_refuse_it():
    config = {**cfg(pp=2, zero=3), "first_stage_layers": 8}
    for target in ("torchtitan", "mindformers"):
        assert any("first_stage_layers" in r for r in unsupported_reasons(target, config)), target
    assert not any("first_stage_layers" in r for r in unsupported_reasons("megatron", {**config, "zero_stage": 1}))


def test_mindspeed_flags_are_those_of_mindspeed_llms_llama_examples():
    """Golden fixture: the flags of MindSpeed-LLM's examples/mcore/llama2/pretrain_llama2_13b_ptd.sh
    (Ascend/MindSpeed-LLM at a9547f618ed4643e386a96be191258b872c4d9dc), one per line."""
    golden = (FIXTURES / "mindspeed_llama2_13b_ptd.flags").read_text().split()
    for flag in (f for f in MINDSPEED_FLAGS if f.startswith("--")):
        assert flag in golden, flag
    _, arrays = _megatron_script(MEGATRON_CONFIGS["tp8-mbs4"], "mindspeed")
    exported = set(a for a in arrays["MODEL_ARGS"] + arrays["STACK_ARGS"] if a.startswith("--"))
    # every architecture/fusion flag the example sets that autotune also decides, it sets the same way
    for flag in (
        "--attention-dropout",
        "--hidden-dropout",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--make-vocab-size-divisible-by",
        "--use-flash-attn",
        "--use-fused-rmsnorm",
        "--use-fused-swiglu",
        "--use-fused-rotary-pos-emb",
        "--transformer-impl",
    ):
        assert flag in golden and flag in exported, flag


MEGATRON_LM = os.environ.get("AUTOTUNE_MEGATRON_LM")


@pytest.mark.skipif(
    not MEGATRON_LM,
    reason="set AUTOTUNE_MEGATRON_LM to a Megatron-LM checkout to run its parse_args + validate_args on the exports",
)
def test_megatron_lm_parse_and_validate_args_accept_every_export():
    user_args = [
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "32000",
        "--mock-data",
        "--train-iters",
        "10",
        "--lr",
        "1e-4",
    ]
    cases, expected = [], []
    for target in ("megatron", "mindspeed"):
        for name, config in sorted(MEGATRON_CONFIGS.items()):
            script, arrays = _megatron_script(config, target)
            world = config["dp"] * config["tp"] * config["pp"] * config["cp"]
            cases.append(
                {
                    "argv": arrays["MODEL_ARGS"] + arrays["STACK_ARGS"] + arrays["AUTOTUNE_ARGS"] + user_args,
                    "env": _script_env(script),
                    "world_size": world,
                    "ignore_unknown": target == "mindspeed",
                }
            )
            expected.append((target, name, config))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "megatron_lm_harness.py"), MEGATRON_LM],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    for (target, name, config), result in zip(expected, results):
        assert result["ok"], (target, name, result.get("error"))
        a = result["args"]
        vpp = a["virtual_pipeline_model_parallel_size"] or 1
        per_stage = (
            (
                a["recompute_num_layers"] * vpp
                if a["recompute_method"] == "block"
                else a["num_layers"] // a["pipeline_model_parallel_size"]
            )
            if a["recompute_granularity"] == "full"
            else 0
        )
        got = {
            "global_batch": a["global_batch_size"],
            "micro_batch": a["micro_batch_size"],
            "tp": a["tensor_model_parallel_size"],
            "pp": a["pipeline_model_parallel_size"],
            "cp": a["context_parallel_size"],
            "dp": a["data_parallel_size"],
            "vpp": vpp,
            "recompute": a["recompute_granularity"] or "none",
            "recompute_layers_per_stage": per_stage,
            "zero_stage": 1 if a["use_distributed_optimizer"] else 0,
            "precision": "bf16" if a["bf16"] else "fp16" if a["fp16"] else "fp32",
        }
        assert got == launched(config), (target, name)
        assert a["hidden_dropout"] == 0.0 and a["attention_dropout"] == 0.0


# ------------------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("name", sorted(DEEPSPEED_CONFIGS))
def test_deepspeed_config_passes_deepspeeds_batch_check_for_the_world_it_names(name, monkeypatch):
    pytest.importorskip("deepspeed", reason="pip install deepspeed (DS_BUILD_OPS=0) to check the DeepSpeed export")
    warnings.filterwarnings("ignore")
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DEEPSPEED_CONFIGS[name]
    ctx = context(config, "deepspeed")
    assert EXPORTERS["deepspeed"].unsupported(ctx) == []
    data = json.loads(EXPORTERS["deepspeed"].render(ctx))
    world = ctx.world_size
    assert f"all {world} ranks" in data["_autotune"]["assumes"]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)  # a plain initialize: every rank
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    ds = DeepSpeedConfig(data)
    assert ds.world_size == world
    got = {
        "global_batch": ds.train_batch_size,
        "micro_batch": ds.train_micro_batch_size_per_gpu,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "dp": ds.world_size,
        "vpp": 1,
        "recompute": "full" if "activation_checkpointing" in data else "none",
        "recompute_layers_per_stage": 32 if "activation_checkpointing" in data else 0,
        "zero_stage": ds.zero_optimization_stage,
        "precision": "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32",
    }
    assert got == launched(config)
    assert ds.gradient_accumulation_steps == config["grad_accum"]


# ------------------------------------------------------------------------------------ torchtitan
@pytest.fixture(scope="module")
def torchtitan_manager():
    pytest.importorskip("torchtitan", reason="pip install torchtitan==0.3.* to check the torchtitan export")
    try:  # torchtitan 0.3's model registries import triton (x86_64 Linux wheels only)
        import torchtitan.models.llama3.config_registry  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"torchtitan cannot load its llama3 config registry here: {exc}")
    from torchtitan.config.manager import ConfigManager

    return ConfigManager


@pytest.mark.parametrize("name", sorted(TORCHTITAN_CONFIGS))
def test_torchtitan_config_manager_parses_the_launch_and_reads_back_the_measured_config(name, torchtitan_manager):
    config = TORCHTITAN_CONFIGS[name]
    ctx = context(config, "torchtitan", model=LLAMA3_8B)
    assert EXPORTERS["torchtitan"].unsupported(ctx) == []
    script = EXPORTERS["torchtitan"].render(ctx)
    assert "TORCHTITAN_MODULE=${TORCHTITAN_MODULE:-llama3}" in script
    args = script_arrays(script)["AUTOTUNE_ARGS"]
    user = ["--training.steps", "10"]  # what a user adds after the tuned flags ("$@")
    job = torchtitan_manager().parse_args(
        ["--module", "llama3", "--config", "llama3_8b", *args, *user, activation_checkpoint_subcommand(config)]
    )
    p, t = job.parallelism, job.training
    dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    pp = p.pipeline_parallel_degree
    micro = p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
    vpp = (32 // pp) // p.pipeline_parallel_layers_per_stage if pp > 1 else 1
    ac = type(job.activation_checkpoint).__qualname__.split(".")[0]
    zero = 0 if p.data_parallel_shard_degree == 1 else 3 if p.fsdp_reshard_after_forward == "always" else 2
    got = {
        "global_batch": t.global_batch_size,
        "micro_batch": micro,
        "tp": p.tensor_parallel_degree,
        "pp": pp,
        "cp": p.context_parallel_degree,
        "dp": dp,
        "vpp": vpp,
        "recompute": {"FullAC": "full", "SelectiveAC": "selective"}.get(ac, "none"),
        "recompute_layers_per_stage": 32 // pp if ac == "FullAC" else 0,
        "zero_stage": zero,
        "precision": "bf16" if t.mixed_precision_param == "bfloat16" else "fp32",
    }
    assert got == launched(config)
    if pp > 1:  # even stages, as measured (torchtitan's default takes a layer off the first and last)
        assert p.pipeline_parallel_first_stage_less_layers == 0 and p.pipeline_parallel_last_stage_less_layers == 0
    assert p.enable_sequence_parallel == bool(config["sequence_parallel"])
    # gradient accumulation torchtitan derives: global / (local x dp) (1 with pipelining: its micro-batches)
    accumulation = t.global_batch_size // (t.local_batch_size * dp)
    assert accumulation * (t.local_batch_size // micro) == config["grad_accum"]
    assert t.steps == 10  # the user's own flags still apply


# ----------------------------------------------------------------------------------- MindFormers
# tests/test_export_mindformers.py: these configs exported, merged into MindFormers Llama (and
# Qwen3) model YAMLs and read back by MindFormers 2.1.0's own config, trainer and network code
# (batch rule, LayerSetting's pipeline chunks and recomputed layers) in .venv-mindspore.


# ------------------------------------------------------------------------- the worked example
def test_mindspeed_example_runs_and_its_launch_script_passes_the_users_flags_through(tmp_path):
    """examples/mindspeed_llama2_7b: plan -> run (simulator here) -> launch_megatron.sh, executed
    by bash with a stand-in torchrun that records what MindSpeed-LLM would receive."""
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    spec = Path(__file__).resolve().parents[1] / "examples" / "mindspeed_llama2_7b" / "spec.yaml"
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(spec),
            "--backend",
            "simulate",
            "--run-dir",
            str(run_dir),
            "--no-tracking",
            "--n-trials",
            "3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    script = run_dir / "export" / "launch_megatron.sh"
    assert json.loads(result.stdout)["exports"]["megatron"] == str(script)
    best = json.loads(result.stdout)["best"][0]["params"]
    assert best["zero_stage"] <= 1  # the target cannot launch more
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n'
        'echo "CDMC=$CUDA_DEVICE_MAX_CONNECTIONS ALLOC=$PYTORCH_NPU_ALLOC_CONF" >> "$RECORD"\n'
    )
    fake.chmod(0o755)
    record = tmp_path / "argv.txt"
    user = [
        "--tokenizer-type",
        "PretrainedFromHF",
        "--data-path",
        "/data/my corpus_text_document",
        "--use-fused-rmsnorm",
        "--micro-batch-size",
        "1",
    ]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record)}
    subprocess.run(["bash", str(script), *user], env=env, check=True, timeout=60)
    lines = record.read_text().splitlines()
    argv, env_line = lines[:-1], lines[-1]
    assert argv[-len(user) :] == user  # the user's flags, untouched and last (a space in a path survives)
    assert "pretrain_gpt.py" in argv and "--transformer-impl" in argv and "--use-flash-attn" in argv
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == str(best["tp"])
    assert argv[argv.index("--global-batch-size") + 1] == "64"
    assert env_line == "CDMC=1 ALLOC=expandable_segments:True"


def test_a_baseline_the_target_cannot_launch_is_a_spec_error():
    from autotune.spec.errors import SpecError

    data = {
        "name": "t",
        "model": "llama2-7b",
        "target": "mindspeed",
        "workload": {"kind": "train", "seq_len": 4096, "global_batch_size": 64},
        "space": {"zero_stage": [0, 1, 2]},
        "baseline": {"tp": 1, "zero_stage": 2},
    }
    with pytest.raises(SpecError, match=r"baseline: the baseline breaks a rule: target mindspeed: ZeRO-2/3"):
        parse_spec(data, "spec.yaml")
    data["baseline"]["zero_stage"] = 1
    assert parse_spec(data).baseline == {"tp": 1, "zero_stage": 1}
