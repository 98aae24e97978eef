"""DeepSpeed: a config JSON (ZeRO stage, micro-batch, gradient accumulation, precision,
activation checkpointing). JSON has no comments: the header is the ``_autotune`` key, which
DeepSpeed ignores."""

from __future__ import annotations

import json

from ._base import ExportContext, Exporter, header_fields


class DeepSpeedExporter(Exporter):
    name = "deepspeed"
    filename = "deepspeed_config.json"

    def render(self, ctx: ExportContext) -> str:
        mbs = int(ctx.get("micro_batch_size", 1))
        ga = int(ctx.get("grad_accum", 1) or 1)
        dp = int(ctx.get("dp", 1) or 1)
        stage = int(ctx.get("zero_stage", 0) or 0)
        cfg: dict = {
            "_autotune": header_fields(ctx),
            "train_micro_batch_size_per_gpu": mbs,
            "gradient_accumulation_steps": ga,
            "train_batch_size": mbs * ga * dp,
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
            "gradient_clipping": 1.0,
        }
        if stage == 3:
            cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        precision = ctx.get("precision", "bf16")
        if precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif precision == "fp16":
            cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                           "hysteresis": 2, "min_loss_scale": 1}
        recompute = ctx.get("recompute", "none")
        if recompute != "none":
            cfg["activation_checkpointing"] = {"partition_activations": recompute == "full" and int(ctx.get("tp", 1)) > 1,
                                               "contiguous_memory_optimization": False, "cpu_checkpointing": False}
        return json.dumps(cfg, indent=2) + "\n"
