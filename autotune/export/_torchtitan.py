"""torchtitan: a TOML fragment for the job config's ``[parallelism]``, ``[training]``,
``[activation_checkpoint]`` and ``[compile]`` sections.

ZeRO maps onto torchtitan's FSDP2 data parallelism: stage 0 = replicate (DDP) over dp; stage 3 =
shard over dp, resharding after forward; stages 1 and 2 = shard over dp without resharding after
forward (torchtitan has no ZeRO-1; parameters stay gathered between forward and backward, as in
ZeRO-2).
"""

from __future__ import annotations

from typing import Any

from ._base import ExportContext, Exporter, header_lines


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


class TorchtitanExporter(Exporter):
    name = "torchtitan"
    filename = "torchtitan.toml"

    def render(self, ctx: ExportContext) -> str:
        dp = int(ctx.get("dp", 1) or 1)
        zero = int(ctx.get("zero_stage", 0) or 0)
        pp, vpp = int(ctx.get("pp", 1)), int(ctx.get("vpp", 1) or 1)
        mbs, ga = int(ctx.get("micro_batch_size", 1)), int(ctx.get("grad_accum", 1) or 1)
        parallelism = {
            "data_parallel_replicate_degree": dp if zero == 0 else 1,
            "data_parallel_shard_degree": 1 if zero == 0 else dp,
            "fsdp_reshard_after_forward": "always" if zero == 3 else "never",
            "tensor_parallel_degree": int(ctx.get("tp", 1)),
            "enable_async_tensor_parallel": False,
            "pipeline_parallel_degree": pp,
            "context_parallel_degree": int(ctx.get("cp", 1) or 1),
        }
        if pp > 1:
            parallelism["pipeline_parallel_schedule"] = "Interleaved1F1B" if vpp > 1 else "1F1B"
            parallelism["pipeline_parallel_microbatch_size"] = mbs
        precision = ctx.get("precision", "bf16")
        training = {"local_batch_size": mbs * ga, "global_batch_size": mbs * ga * dp,
                    "seq_len": int(ctx.workload.get("seq_len", 0) or 0),
                    "mixed_precision_param": "float32" if precision == "fp32" else
                    ("float16" if precision == "fp16" else "bfloat16")}
        recompute = ctx.get("recompute", "none")
        sections = {
            "parallelism": parallelism,
            "training": training,
            "activation_checkpoint": {"mode": recompute if recompute in ("selective", "full") else "none"},
            "compile": {"enable": bool(ctx.get("compile", False) and ctx.get("compile") != "none")},
        }
        if recompute == "selective":
            sections["activation_checkpoint"]["selective_ac_option"] = "op"
        lines = header_lines(ctx)
        for name, values in sections.items():
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        return "\n".join(lines) + "\n"
