"""DeepSpeed: a config JSON (ZeRO stage, micro-batch, gradient accumulation, precision,
activation checkpointing). JSON has no comments: the header is the ``_autotune`` key, which
DeepSpeed ignores, and ``_autotune.assumes`` says which launch the batch sizes are for.

The file is for a plain ``deepspeed.initialize`` over every rank of the cluster: DeepSpeed then
takes the data-parallel world to be all ranks and checks ``train_batch_size ==
train_micro_batch_size_per_gpu * gradient_accumulation_steps * world``. Model parallelism (tp, pp,
cp) is not something a DeepSpeed config can switch on, so such configs are refused rather than
exported with a batch check that fails or a world that is not the trial's (see
:mod:`autotune.stacks`).
"""

from __future__ import annotations

import json

from ..workers.parameters import spellings, value
from ._base import ExportContext, Exporter, header_fields


# the key each knob is written as, from the parameter table: the header names it beside a value the
# evidence did not choose (recompute's activation_checkpointing only where it is written: full)
DEEPSPEED_KEYS = {name: key for name, key in spellings("deepspeed").items() if name != "recompute"}


class DeepSpeedExporter(Exporter):
    name = "deepspeed"
    filename = "deepspeed_config.json"

    def render(self, ctx: ExportContext) -> str:
        mbs = value(ctx.config, "micro_batch_size")
        ga = value(ctx.config, "grad_accum")
        dp = value(ctx.config, "dp")
        world = ctx.world_size
        if dp != world:
            raise ValueError(f"dp {dp} is not the world {world}: a DeepSpeed config cannot launch model parallelism")
        stage = value(ctx.config, "zero_stage")
        recompute = value(ctx.config, "recompute")
        written = dict(DEEPSPEED_KEYS)
        if recompute == "full":
            written["recompute"] = spellings("deepspeed")["recompute"]
        header = header_fields(ctx, written)
        header["assumes"] = (
            f"a plain deepspeed.initialize over all {world} ranks (data parallel {world}, "
            f"{int(ctx.cluster.get('nodes', 1) or 1)} node(s)): train_batch_size = micro-batch {mbs} "
            f"x grad-accum {ga} x {world} ranks"
        )
        cfg: dict = {
            "_autotune": header,
            "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": ga,
            "train_batch_size": mbs * ga * world,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
            "gradient_clipping": 1.0,
        }
        if stage == 3:
            cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        precision = value(ctx.config, "precision")
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif precision == "fp16":
            cfg["fp16"] = {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        if recompute == "full":
            # DeepSpeed's checkpointing settings; the model still wraps each block in
            # deepspeed.checkpointing.checkpoint (or calls gradient_checkpointing_enable())
            cfg["activation_checkpointing"] = {
                "partition_activations": False,
                "contiguous_memory_optimization": False,
                "cpu_checkpointing": False,
            }
            header["launch_note"] = (
                "recompute full: checkpoint every transformer block in the model code "
                "(deepspeed.checkpointing.checkpoint, or gradient_checkpointing_enable())"
            )
        return json.dumps(cfg, indent=2) + "\n"
