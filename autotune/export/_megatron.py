"""MindSpeed-LLM / Megatron-LM: the tuned config as a ready torchrun launch script.

The script exports the config's environment (and ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which
Megatron's ``validate_args`` requires for tp > 1 or cp > 1 before Blackwell, and which every
MindSpeed-LLM example script sets), then runs ``torchrun`` over ``$TRAIN_SCRIPT``
(``pretrain_gpt.py``) with three argument arrays: ``MODEL_ARGS`` (the architecture: Llama has no
dropout, its RoPE base and norm epsilon), ``STACK_ARGS`` (MindSpeed-LLM's Llama fusion flags from
its ``examples/mcore/llama2`` scripts, for the ``mindspeed`` target) and ``AUTOTUNE_ARGS`` (the tuned
parallel, batch, recompute, optimizer-sharding and precision settings), then whatever the user
adds (data, tokenizer, checkpoints). Megatron's argparse keeps the last value of a repeated flag,
so the user's own flags win where they repeat one.

What launches is exactly the trial's config (measured or simulated, as the header says): Megatron
derives dp = world / (tp·pp·cp) and grad-accum = global batch / (micro-batch · dp);
``--recompute-method block`` counts layers per *virtual* stage, so ``--recompute-num-layers`` is the
trial's per-stage count divided by vpp; the
distributed optimizer is ZeRO-1 and nothing more (ZeRO-2/3 are refused, see
:mod:`autotune.stacks`).
"""

from __future__ import annotations

from typing import Any

from ..workers.parameters import effective_vpp, sequence_parallel_on, spellings, stage_layers, value
from ._base import ExportContext, Exporter, args_written, bash_array, header_lines
from ._env import env_exports, env_written

# MindSpeed-LLM's Llama-2 flags (examples/mcore/llama2/pretrain_llama2_13b_ptd.sh, Ascend/MindSpeed-LLM
# a9547f618ed4643e386a96be191258b872c4d9dc): fused kernels and the local transformer implementation.
MINDSPEED_FLAGS = (
    "--use-mcore-models",
    "--use-flash-attn",
    "--use-fused-rmsnorm",
    "--use-fused-swiglu",
    "--use-fused-rotary-pos-emb",
    "--no-masked-softmax-fusion",
    "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion",
    "--transformer-impl",
    "local",
)


# the flag each knob is written as (in AUTOTUNE_ARGS), from the parameter table: the header names it
# beside a value the evidence did not choose
MEGATRON_FLAGS = spellings("megatron")


def megatron_args(
    config: dict[str, Any], global_batch_size: int | None, num_layers: int | None = None, target: str = "megatron"
) -> list[str]:
    """Megatron-LM / MindSpeed-LLM arguments for the config's parallel, batch, recompute,
    optimizer-sharding and precision settings. A first stage of its own size is Megatron-LM's
    ``--decoder-first-pipeline-num-layers``; MindSpeed-LLM's examples write the same split as
    ``--num-layer-list`` (every stage's layers, MindSpeed's own flag)."""
    tp, pp = value(config, "tp"), value(config, "pp")
    vpp = effective_vpp(value(config, "vpp"), pp)
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    first = value(config, "first_stage_layers")
    if first and pp > 1:
        if target == "mindspeed":
            if not num_layers:
                raise ValueError("MindSpeed's --num-layer-list needs the model's layer count")
            _, other = stage_layers(num_layers, pp, first)
            args += ["--num-layer-list", ",".join([str(first), *[str(int(other))] * (pp - 1)])]
        else:
            args += ["--decoder-first-pipeline-num-layers", str(first)]
    if vpp > 1:
        if not num_layers:
            raise ValueError("an interleaved schedule (vpp > 1) needs the model's layer count")
        args += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (pp * vpp))]
    if value(config, "cp") > 1:
        args += ["--context-parallel-size", str(config["cp"])]
    if "micro_batch_size" in config:
        args += ["--micro-batch-size", str(config["micro_batch_size"])]
    if global_batch_size:
        args += ["--global-batch-size", str(global_batch_size)]
    if sequence_parallel_on(value(config, "sequence_parallel"), tp):
        args.append("--sequence-parallel")
    recompute = value(config, "recompute")
    if recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        layers = value(config, "recompute_layers")
        if layers:  # the first `layers` of each stage; block counts per virtual stage
            args += [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                str(layers // vpp),
            ]
        else:  # every layer: each layer is its own checkpointed chunk
            args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    zero = value(config, "zero_stage")
    if zero == 1:
        args.append("--use-distributed-optimizer")  # ZeRO-1: optimizer states sharded over dp (x cp)
    elif zero >= 2:
        raise ValueError(f"zero_stage {zero} has no Megatron form (the distributed optimizer is ZeRO-1)")
    precision = value(config, "precision")
    if precision in ("bf16", "fp16"):
        args.append(f"--{precision}")
    return args


def model_args(model: dict[str, Any], workload: dict[str, Any], target: str = "megatron") -> list[str]:
    """The architecture as Megatron arguments (and MindSpeed's vocabulary rule for ``mindspeed``)."""
    pairs = [
        ("--num-layers", model.get("num_hidden_layers")),
        ("--hidden-size", model.get("hidden_size")),
        ("--ffn-hidden-size", model.get("intermediate_size")),
        ("--num-attention-heads", model.get("num_attention_heads")),
        ("--seq-length", workload.get("seq_len")),
        ("--max-position-embeddings", model.get("max_position_embeddings")),
    ]
    args = [x for flag, v in pairs if v for x in (flag, str(v))]
    heads, kv = model.get("num_attention_heads"), model.get("num_key_value_heads")
    if kv and heads and int(kv) != int(heads):
        args += ["--group-query-attention", "--num-query-groups", str(kv)]
    if str(model.get("arch", "llama")) == "llama":
        args += [
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--disable-bias-linear",
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0.0",
            "--rotary-base",
            f"{int(model.get('rope_theta') or 10000)}",
            "--norm-epsilon",
            f"{float(model.get('rms_norm_eps') or 1e-5):g}",
        ]
        if not model.get("tie_word_embeddings"):
            args.append("--untie-embeddings-and-output-weights")
    if target == "mindspeed":
        args += ["--make-vocab-size-divisible-by", "1"]  # the Hugging Face vocabulary, unpadded
    return args


class MegatronExporter(Exporter):
    name = "megatron"
    filename = "launch_megatron.sh"
    shell = True
    executable = True

    def workload_reasons(self, ctx: ExportContext) -> list[str]:
        seq, positions = ctx.workload.get("seq_len"), ctx.model.get("max_position_embeddings")
        if seq and positions and int(seq) > int(positions):  # validate_args, core_r0.12 and main
            return [f"Megatron's validate_args refuses --seq-length {seq} above --max-position-embeddings {positions}"]
        return []

    def render(self, ctx: ExportContext) -> str:
        target = ctx.target if ctx.target in ("mindspeed", "megatron") else "megatron"
        gbs = ctx.workload.get("global_batch_size")
        layers = ctx.model.get("num_hidden_layers")
        nodes = int(ctx.cluster.get("nodes", 1) or 1)
        per_node = ctx.world_size // max(1, nodes)
        stack: tuple[str, ...] = ()
        if target == "mindspeed":
            stack = MINDSPEED_FLAGS
            if value(ctx.config, "cp") > 1:  # ring attention, as measured and priced; MindSpeed's default
                stack += ("--context-parallel-algo", "megatron_cp_algo")  # was Ulysses in older releases
        args = megatron_args(ctx.config, gbs, layers, target)
        written = {**env_written(ctx), **args_written(args, MEGATRON_FLAGS)}  # precision: --bf16 or --fp16
        if gbs:  # dp and grad-accum follow from the global batch
            written.update(dp="--global-batch-size (dp)", grad_accum="--global-batch-size (grad-accum)")
        env = env_exports(ctx)
        if "CUDA_DEVICE_MAX_CONNECTIONS" not in ctx.env:
            env.append("export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's validate_args requires it for tp/cp > 1")
        lines = [
            "#!/usr/bin/env bash",
            *header_lines(ctx, written=written),
            f"# {'MindSpeed-LLM' if target == 'mindspeed' else 'Megatron-LM'} launch with the tuned parallel, "
            "batch, recompute, optimizer-sharding and precision settings",
            f"# (world {ctx.world_size} = {nodes} node(s) x {per_node}; dp and grad-accum follow from "
            f"--global-batch-size, as {ctx.how}).",
            "# Add data, tokenizer and checkpoint arguments on the command line: ./launch_megatron.sh --data-path ...",
            "set -euo pipefail",
            "",
            *env,
            "",
            f"NNODES=${{NNODES:-{nodes}}}",
            "NODE_RANK=${NODE_RANK:-0}",
            "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}",
            "MASTER_PORT=${MASTER_PORT:-6000}",
            f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{per_node}}}",
            "TRAIN_SCRIPT=${TRAIN_SCRIPT:-pretrain_gpt.py}",
            "",
            *bash_array("MODEL_ARGS", model_args(ctx.model, ctx.workload, target)),
            *bash_array("STACK_ARGS", stack),
            *bash_array("AUTOTUNE_ARGS", args),
            "",
            'torchrun --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
            '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
            '    "$TRAIN_SCRIPT" "${MODEL_ARGS[@]}" "${STACK_ARGS[@]}" "${AUTOTUNE_ARGS[@]}" "$@"',
        ]
        return "\n".join(lines) + "\n"
