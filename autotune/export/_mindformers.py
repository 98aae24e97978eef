"""MindFormers: the ``context``, ``parallel``, ``parallel_config``, ``recompute_config`` and
``runner_config`` blocks of a model YAML, merged into the team's own run YAML.

What launches is the measured config, by MindFormers' own batch rule (``BaseTrainer.
_check_global_batch_size_for_auto_parallel`` in ``mindformers/trainer/base_trainer.py``): in
semi-auto parallel with ``full_batch``, the global batch is ``batch_size x data_parallel x
micro_batch_num`` when pipelining (``gradient_accumulation_steps`` is ignored there), and
``batch_size x data_parallel x gradient_accumulation_steps`` without (``micro_batch_num`` is reset
to 1). So grad-accum goes to ``micro_batch_num`` with pp > 1 and to
``runner_config.gradient_accumulation_steps`` with pp = 1.

Mapping: data_parallel = dp, model_parallel = tp, pipeline_stage = pp, context_parallel = cp,
``pp_interleave_num`` = vpp, use_seq_parallel = sequence parallel, batch_size = the micro-batch;
ZeRO-1 = ``enable_parallel_optimizer`` (MindSpore's optimizer sharding); recompute full =
``recompute: True``, or a list with the recomputed layer count of each stage (MindFormers'
per-stage form) when only some layers are; selective = ``select_recompute: True``. Graph-kernel
flags are not a context key MindSpore 2.10 reads: they go into the ``env`` export as
``MS_DEV_GRAPH_KERNEL_FLAGS`` (named in this file's header).
"""

from __future__ import annotations

import yaml

from ._base import ExportContext, Exporter, header_lines, one_line

_MODES = {"graph": 0, "pynative": 1}


class MindFormersExporter(Exporter):
    name = "mindformers"
    filename = "mindformers_parallel.yaml"

    def render(self, ctx: ExportContext) -> str:
        pp = int(ctx.get("pp", 1))
        ga = int(ctx.get("grad_accum", 1) or 1)
        recompute = ctx.get("recompute", "none")
        layers = ctx.get("recompute_layers")
        context = {"mode": _MODES.get(str(ctx.get("mode", "graph")), 0),
                   "jit_config": {"jit_level": str(ctx.get("jit_level", "O1"))}}
        body = {
            "context": context,
            "parallel": {"parallel_mode": 1, "enable_parallel_optimizer": int(ctx.get("zero_stage", 0) or 0) >= 1,
                         "full_batch": True},
            "parallel_config": {
                "data_parallel": int(ctx.get("dp", 1) or 1), "model_parallel": int(ctx.get("tp", 1)),
                "pipeline_stage": pp, "context_parallel": int(ctx.get("cp", 1) or 1),
                "micro_batch_num": ga if pp > 1 else 1,
                "use_seq_parallel": bool(ctx.get("sequence_parallel", False)),
                "vocab_emb_dp": True, "gradient_aggregation_group": 4,
            },
            "recompute_config": {"recompute": ([int(layers)] * pp if layers else True) if recompute == "full" else False,
                                 "select_recompute": recompute == "selective",
                                 "parallel_optimizer_comm_recompute": False, "mp_comm_recompute": True,
                                 "recompute_slice_activation": True},
            "runner_config": {"batch_size": int(ctx.get("micro_batch_size", 1)),
                              "gradient_accumulation_steps": 1 if pp > 1 else ga},
        }
        precision = ctx.get("precision", "bf16")
        body["model"] = {"model_config": {
            "compute_dtype": "float16" if precision == "fp16" else ("bfloat16" if precision == "bf16" else "float32"),
            "pp_interleave_num": int(ctx.get("vpp", 1) or 1)}}
        if precision == "fp16":
            body["runner_wrapper"] = {"scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536,
                                                      "scale_factor": 2, "scale_window": 1000}}
        notes = [f"# MindFormers: merge into your model's run YAML (semi-auto parallel, full_batch): global batch "
                 f"{int(ctx.get('micro_batch_size', 1)) * int(ctx.get('dp', 1) or 1) * ga} = batch_size x data_parallel x "
                 f"{'micro_batch_num' if pp > 1 else 'gradient_accumulation_steps'}"]
        flags = ctx.get("graph_kernel_flags")
        if flags:
            notes.append(f"# graph-kernel flags go in the environment (best.env): "
                         f"MS_DEV_GRAPH_KERNEL_FLAGS={one_line(' '.join(str(flags).split()))}")
        return "\n".join([*header_lines(ctx), *notes]) + "\n" + yaml.safe_dump(body, sort_keys=False)

