"""MindSpeed-LLM / Megatron-LM: the parallel and memory arguments, as a ready torchrun launch script.

The script sets the config's environment, then runs ``torchrun`` over ``$TRAIN_SCRIPT``
(``pretrain_gpt.py`` by default) with the model's shape arguments, the tuned arguments in the
``AUTOTUNE_ARGS`` array, and whatever the user adds on the command line (data, tokenizer,
checkpoints). Node rank, master address and port come from the environment, as on any cluster.
"""

from __future__ import annotations

import shlex
from typing import Any

from ._base import ExportContext, Exporter, header_lines
from ._env import env_exports


def megatron_args(config: dict[str, Any], global_batch_size: int | None, num_layers: int | None = None) -> list[str]:
    """Megatron-LM / MindSpeed-LLM arguments for the config's parallel, memory and precision settings."""
    tp, pp, vpp = int(config.get("tp", 1)), int(config.get("pp", 1)), int(config.get("vpp", 1) or 1)
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if vpp > 1 and pp > 1 and num_layers:
        args += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (pp * vpp))]
    if int(config.get("cp", 1) or 1) > 1:
        args += ["--context-parallel-size", str(config["cp"])]
    if "micro_batch_size" in config:
        args += ["--micro-batch-size", str(config["micro_batch_size"])]
    if global_batch_size:
        args += ["--global-batch-size", str(global_batch_size)]
    if config.get("sequence_parallel"):
        args.append("--sequence-parallel")
    recompute = config.get("recompute", "none")
    if recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif recompute == "full":
        layers = config.get("recompute_layers")
        args += ["--recompute-granularity", "full", "--recompute-method", "block" if layers else "uniform",
                 "--recompute-num-layers", str(layers or 1)]
    if int(config.get("zero_stage", 0) or 0) >= 1:
        args.append("--use-distributed-optimizer")  # Megatron's ZeRO-1-style sharded optimizer
    precision = config.get("precision", "bf16")
    if precision in ("bf16", "fp16"):
        args.append(f"--{precision}")
    return args


def _model_args(model: dict[str, Any], workload: dict[str, Any]) -> list[str]:
    pairs = [("--num-layers", model.get("num_hidden_layers")), ("--hidden-size", model.get("hidden_size")),
             ("--ffn-hidden-size", model.get("intermediate_size")),
             ("--num-attention-heads", model.get("num_attention_heads")),
             ("--seq-length", workload.get("seq_len")), ("--max-position-embeddings", model.get("max_position_embeddings"))]
    args = [x for flag, v in pairs if v for x in (flag, str(v))]
    heads, kv = model.get("num_attention_heads"), model.get("num_key_value_heads")
    if kv and heads and int(kv) != int(heads):
        args += ["--group-query-attention", "--num-query-groups", str(kv)]
    if str(model.get("arch", "llama")) == "llama":
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    return args


def _array(name: str, args: list[str]) -> list[str]:
    lines = [f"{name}=("]
    i = 0
    while i < len(args):  # one flag (with its value) per line
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"    {shlex.quote(args[i])} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(f"    {shlex.quote(args[i])}")
            i += 1
    lines.append(")")
    return lines


class MegatronExporter(Exporter):
    name = "megatron"
    filename = "launch_megatron.sh"
    executable = True

    def render(self, ctx: ExportContext) -> str:
        gbs = ctx.workload.get("global_batch_size")
        layers = ctx.model.get("num_hidden_layers")
        nodes = int(ctx.cluster.get("nodes", 1) or 1)
        per_node = ctx.world_size // max(1, nodes)
        lines = ["#!/usr/bin/env bash", *header_lines(ctx),
                 "# MindSpeed-LLM / Megatron-LM launch with the tuned parallel, memory and precision settings.",
                 "# Add data, tokenizer and checkpoint arguments on the command line: ./launch_megatron.sh --data-path ...",
                 "set -euo pipefail", "", *env_exports(ctx), "",
                 f"NNODES=${{NNODES:-{nodes}}}", "NODE_RANK=${NODE_RANK:-0}",
                 "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}", "MASTER_PORT=${MASTER_PORT:-6000}",
                 f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{per_node}}}", "TRAIN_SCRIPT=${TRAIN_SCRIPT:-pretrain_gpt.py}", "",
                 *_array("MODEL_ARGS", _model_args(ctx.model, ctx.workload)),
                 *_array("AUTOTUNE_ARGS", megatron_args(ctx.config, gbs, layers)), "",
                 'torchrun --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
                 '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
                 '    "$TRAIN_SCRIPT" "${MODEL_ARGS[@]}" "${AUTOTUNE_ARGS[@]}" "$@"']
        return "\n".join(lines) + "\n"
