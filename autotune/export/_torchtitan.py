"""torchtitan 0.3: a launch script with the tuned settings as the trainer's CLI overrides.

torchtitan 0.3 reads no TOML: a job is a ``config_registry`` function of a Python module
(``--module llama3 --config llama3_8b``, or a team's own module) plus ``--section.field value``
overrides, which its ``ConfigManager`` parses with tyro. The script passes the tuned settings in
the ``AUTOTUNE_ARGS`` array after the user's module and config (``TORCHTITAN_MODULE`` /
``TORCHTITAN_CONFIG``; Llama-3 presets get torchtitan's own). torchtitan 0.2's TOML files are
not written: its keys differ, and 0.2 has no gradient accumulation below ``local_batch_size``.

The mapping launches exactly the trial's config (measured or simulated, as the header says):

- ZeRO on FSDP2: stage 0 = ``data_parallel_replicate_degree`` dp (DDP); stage 2 = shard over dp
  without resharding after forward; stage 3 = shard, resharding after forward (the torch probe's
  own mapping). Stage 1 and fp16 have no torchtitan form, and bf16 needs FSDP (refused by
  :mod:`autotune.stacks`).
- Batch: without pipelining ``local_batch_size`` is the micro-batch and ``global_batch_size``
  micro-batch x grad-accum x dp, so torchtitan accumulates grad-accum micro-batches; with
  pipelining the pipeline's micro-batches are the accumulation (``local_batch_size`` = micro-batch x
  grad-accum, ``pipeline_parallel_microbatch_size`` = micro-batch).
- vpp: ``Interleaved1F1B`` with ``pipeline_parallel_layers_per_stage`` = layers / (pp x vpp), and
  no lighter first/last stage (torchtitan's default takes one layer off each, autotune's stages
  are even).
- Recompute: the ``activation-checkpoint:none|selective|full`` subcommand (every block), last on
  the command line (tyro gives what follows a subcommand to it), after the user's own flags.
"""

from __future__ import annotations

from typing import Any

from ..workers.parameters import effective_vpp, sequence_parallel_on, spellings, value
from ._base import ExportContext, Exporter, args_written, bash_array, header_lines
from ._env import env_exports, env_written

# torchtitan's own config_registry functions for the presets it ships
_PRESET_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b")}


# the flag each knob is written as (in AUTOTUNE_ARGS), from the parameter table: the header names it
# beside a value the evidence did not choose (recompute: the AUTOTUNE_AC subcommand, named by render)
TORCHTITAN_FLAGS = {name: flag for name, flag in spellings("torchtitan").items() if name != "recompute"}


def torchtitan_args(config: dict[str, Any], workload: dict[str, Any], num_layers: int) -> list[str]:
    """The trainer's CLI overrides for the config (after ``--module`` and ``--config``)."""
    dp, zero = value(config, "dp"), value(config, "zero_stage")
    tp, pp = value(config, "tp"), value(config, "pp")
    vpp = effective_vpp(value(config, "vpp"), pp)
    mbs, ga = value(config, "micro_batch_size"), value(config, "grad_accum")
    precision = value(config, "precision")
    shard = zero >= 2
    args = [
        "--parallelism.data_parallel_replicate_degree",
        str(1 if shard else dp),
        "--parallelism.data_parallel_shard_degree",
        str(dp if shard else 1),
        "--parallelism.fsdp_reshard_after_forward",
        "always" if zero == 3 else "never",
        "--parallelism.tensor_parallel_degree",
        str(tp),
        "--parallelism.enable-sequence-parallel"
        if sequence_parallel_on(value(config, "sequence_parallel"), tp)
        else "--parallelism.no-enable-sequence-parallel",
        "--parallelism.context_parallel_degree",
        str(value(config, "cp")),
        "--parallelism.pipeline_parallel_degree",
        str(pp),
    ]
    if pp > 1:
        args += [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B" if vpp > 1 else "1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage",
            str(num_layers // (pp * vpp)),
            "--parallelism.pipeline_parallel_first_stage_less_layers",
            "0",
            "--parallelism.pipeline_parallel_last_stage_less_layers",
            "0",
            "--parallelism.pipeline_parallel_microbatch_size",
            str(mbs),
            "--training.disable-cuda-graphs",  # torchtitan's check: no CUDA graphs with pipelining
            "--training.local_batch_size",
            str(mbs * ga),
        ]
    else:
        args += ["--training.local_batch_size", str(mbs)]
    dtype = "float32" if precision == "fp32" else "bfloat16"
    args += [
        "--training.global_batch_size",
        str(mbs * ga * dp),
        "--training.seq_len",
        str(int(workload.get("seq_len", 0) or 0)),
        "--training.dtype",
        "float32",
        "--training.mixed_precision_param",
        dtype,
        "--compile.enable" if value(config, "compile") != "none" else "--compile.no-enable",
    ]
    return args


def activation_checkpoint_subcommand(config: dict[str, Any]) -> str:
    """The trainer's ``activation-checkpoint:*`` subcommand; it goes last (tyro applies what
    follows a subcommand to it)."""
    recompute = value(config, "recompute")
    return f"activation-checkpoint:{recompute if recompute in ('selective', 'full') else 'none'}"


class TorchtitanExporter(Exporter):
    name = "torchtitan"
    filename = "launch_torchtitan.sh"
    shell = True
    executable = True

    def render(self, ctx: ExportContext) -> str:
        layers = int(ctx.model.get("num_hidden_layers") or 0)
        module, config = _PRESET_CONFIGS.get(str(ctx.model.get("name", "")), ("", ""))
        nodes = int(ctx.cluster.get("nodes", 1) or 1)
        per_node = ctx.world_size // max(1, nodes)
        args = torchtitan_args(ctx.config, ctx.workload, layers)
        written = {**env_written(ctx), **args_written(args, TORCHTITAN_FLAGS)}
        written["recompute"] = f"AUTOTUNE_AC={activation_checkpoint_subcommand(ctx.config)}"
        lines = [
            "#!/usr/bin/env bash",
            *header_lines(ctx, written=written),
            "# torchtitan 0.3.x launch: your config_registry module and function, then the tuned overrides.",
            f"# (world {ctx.world_size} = {nodes} node(s) x {per_node}; the model: {ctx.model.get('name', '')}, "
            f"{layers} layers)",
            "set -euo pipefail",
            "",
            *env_exports(ctx),
            "",
            f"TORCHTITAN_MODULE=${{TORCHTITAN_MODULE:-{module}}}  # e.g. llama3, or your_pkg.config_registry",
            f"TORCHTITAN_CONFIG=${{TORCHTITAN_CONFIG:-{config}}}  # the config_registry function of this model",
            ': "${TORCHTITAN_MODULE:?set TORCHTITAN_MODULE/TORCHTITAN_CONFIG to the model config_registry}"',
            f"NNODES=${{NNODES:-{nodes}}}",
            "NODE_RANK=${NODE_RANK:-0}",
            "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}",
            "MASTER_PORT=${MASTER_PORT:-29500}",
            f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{per_node}}}",
            "",
            *bash_array("AUTOTUNE_ARGS", args),
            f"AUTOTUNE_AC={activation_checkpoint_subcommand(ctx.config)}  # a tyro subcommand: last",
            "",
            'torchrun --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
            '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
            '    -m torchtitan.train --module "$TORCHTITAN_MODULE" --config "$TORCHTITAN_CONFIG" '
            '"${AUTOTUNE_ARGS[@]}" "$@" "$AUTOTUNE_AC"',
        ]
        return "\n".join(lines) + "\n"
