"""MindFormers: the ``parallel_config`` and ``recompute_config`` blocks of a model YAML, with the
MindSpore context (execution mode, jit level, graph-kernel flags) and parallel settings.

Mapping: data_parallel = dp, model_parallel = tp, pipeline_stage = pp, micro_batch_num = the
gradient-accumulation micro-batches (the pipeline's micro-batches), use_seq_parallel = sequence
parallel, batch_size = the micro-batch size; ZeRO >= 1 = ``enable_parallel_optimizer`` (MindSpore's
optimizer sharding); recompute full = ``recompute: True``, selective = ``select_recompute: True``.
"""

from __future__ import annotations

import yaml

from ._base import ExportContext, Exporter, header_lines

_MODES = {"graph": 0, "pynative": 1}


class MindFormersExporter(Exporter):
    name = "mindformers"
    filename = "mindformers_parallel.yaml"

    def render(self, ctx: ExportContext) -> str:
        recompute = ctx.get("recompute", "none")
        context = {"mode": _MODES.get(str(ctx.get("mode", "graph")), 0),
                   "jit_config": {"jit_level": str(ctx.get("jit_level", "O1"))}}
        flags = ctx.get("graph_kernel_flags")
        if flags:
            context["graph_kernel_flags"] = str(flags)  # also exported as MS_DEV_GRAPH_KERNEL_FLAGS (env format)
        body = {
            "context": context,
            "parallel": {"parallel_mode": 1, "enable_parallel_optimizer": int(ctx.get("zero_stage", 0) or 0) >= 1,
                         "full_batch": True},
            "parallel_config": {
                "data_parallel": int(ctx.get("dp", 1) or 1), "model_parallel": int(ctx.get("tp", 1)),
                "pipeline_stage": int(ctx.get("pp", 1)), "context_parallel": int(ctx.get("cp", 1) or 1),
                "micro_batch_num": int(ctx.get("grad_accum", 1) or 1),
                "use_seq_parallel": bool(ctx.get("sequence_parallel", False)),
                "vocab_emb_dp": True, "gradient_aggregation_group": 4,
            },
            "recompute_config": {"recompute": recompute == "full", "select_recompute": recompute == "selective",
                                 "parallel_optimizer_comm_recompute": False, "mp_comm_recompute": True,
                                 "recompute_slice_activation": True},
            "runner_config": {"batch_size": int(ctx.get("micro_batch_size", 1))},
        }
        precision = ctx.get("precision", "bf16")
        body["model"] = {"model_config": {"compute_dtype": "float16" if precision == "fp16" else
                                          ("bfloat16" if precision == "bf16" else "float32")}}
        if precision == "fp16":
            body["runner_wrapper"] = {"scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536,
                                                      "scale_factor": 2, "scale_window": 1000}}
        return "\n".join(header_lines(ctx)) + "\n" + yaml.safe_dump(body, sort_keys=False)
