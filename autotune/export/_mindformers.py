"""MindFormers: the ``context``, ``parallel``, ``parallel_config``, ``recompute_config``,
``runner_config``, ``runner_wrapper`` and ``model.model_config`` blocks of a run YAML, merged over
the team's own model YAML (MindFormers' ``base_config:`` does that merge: the file names the model
YAML as its base and its own keys win).

Checked by MindFormers 2.1.0's own code on CPU (``tests/test_export_mindformers.py``): the merged
YAML is loaded with ``MindFormerConfig``, the context built (``build_context``), the trainer's
config steps run (``_train_dataset_preprocess``, ``set_config`` with its batch rule, ``check_rules``)
and the network built without weights (the legacy Llama, and an mcore Qwen3 from 2.1.0's own YAML),
whose ``LayerSetting`` decides the pipeline chunks and the recomputed layers.

What launches is the trial's config (measured or simulated, as the header says), by MindFormers'
batch rule (``BaseTrainer._check_global_batch_size_for_auto_parallel``): in semi-auto parallel the
global batch is ``batch_size x data_parallel x micro_batch_num x micro_batch_interleave_num`` when pipelining
(``gradient_accumulation_steps`` is ignored there) and ``batch_size x data_parallel x
micro_batch_interleave_num x gradient_accumulation_steps`` without (``micro_batch_num`` is reset to
1). So grad-accum goes to ``micro_batch_num`` with pp > 1 and to
``runner_config.gradient_accumulation_steps`` with pp = 1, and ``micro_batch_interleave_num`` is 1.
``dataset_strategy: full_batch`` goes with ``full_batch``: MindFormers' trainer takes a model YAML's
``parallel.dataset_strategy`` over ``full_batch`` (``_set_full_batch_with_strategy``), and the
templates' strategies name their own data_parallel through a YAML anchor, which a merge does not
update (the batch check then refuses the run).

Mapping: data_parallel = dp, model_parallel = tp, pipeline_stage = pp, context_parallel = cp,
use_seq_parallel = sequence parallel, batch_size = the micro-batch, vocab_emb_dp False (the
embedding and output layer split over model_parallel, as Megatron's vocab-parallel embedding;
MindFormers sets it False itself with pp > 1). vpp > 1 needs both ``model_config.
pp_interleave_num`` and ``parallel.pipeline_config.pipeline_interleave``: ``LayerSetting`` keeps one
chunk per stage unless MindSpore's ``pipeline_interleave`` is on (scheduler ``1f1b``, interleaved
1F1B). ZeRO-1 = ``enable_parallel_optimizer`` (MindSpore's optimizer sharding); recompute full =
``recompute: True``, or a list with the recomputed layer count of each stage (MindFormers' per-stage
form, spread over the stage's chunks by ``LayerSetting``) when only some layers are; selective =
``select_recompute: True``; ``recompute_slice_activation`` False (the mcore models refuse True).
``model_config.offset: 0``: even stages, as the trial ran or was priced (a model YAML's offset is for
its own pp, and the mcore models refuse one of another length). ``model_config.seq_length`` is the
study's sequence length (MindFormers takes it from nowhere else; a dataset with its own length must match).
Precision: ``compute_dtype``, with dynamic loss scaling for fp16 and none (``scale_sense: 1.0``) for
bf16 and fp32; parameter and norm/softmax dtypes stay the model YAML's (their keys differ between
the legacy and the mcore models, and the mcore conversion refuses ``param_init_type`` beside a
YAML's ``params_dtype``). ``base_config`` cannot merge fp16's loss-scale mapping over a number
(MindFormers' ``_merge_a_into_b`` copies the base value as a mapping): the header says to replace it
by hand. Graph-kernel flags are not a context key MindSpore 2.10 reads: they go into the ``env``
export as ``MS_DEV_GRAPH_KERNEL_FLAGS`` (named in this file's header).
"""

from __future__ import annotations

import yaml

from ..workers.parameters import effective_vpp, spellings, value
from ._base import ExportContext, Exporter, header_lines, one_line

_MODES = {"graph": 0, "pynative": 1}
# the key each knob is written as, from the parameter table: the header names it beside a value the
# evidence did not choose (grad_accum's depends on pp: render names it)
MINDFORMERS_KEYS = {name: key for name, key in spellings("mindformers").items() if name != "grad_accum"}
_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


class MindFormersExporter(Exporter):
    name = "mindformers"
    filename = "mindformers_parallel.yaml"

    def render(self, ctx: ExportContext) -> str:
        config = ctx.config
        pp = value(config, "pp")
        vpp = effective_vpp(value(config, "vpp"), pp)
        ga, mbs, dp = value(config, "grad_accum"), value(config, "micro_batch_size"), value(config, "dp")
        recompute = value(config, "recompute")
        layers = value(config, "recompute_layers")
        context = {
            "mode": _MODES.get(value(config, "mode"), 0),
            "jit_config": {"jit_level": value(config, "jit_level")},
        }
        parallel = {
            "parallel_mode": 1,
            "enable_parallel_optimizer": value(config, "zero_stage") >= 1,
            "full_batch": True,
            "dataset_strategy": "full_batch",
        }
        if pp > 1:
            parallel["pipeline_config"] = {"pipeline_interleave": vpp > 1, "pipeline_scheduler": "1f1b"}
        body = {
            "context": context,
            "parallel": parallel,
            "parallel_config": {
                "data_parallel": dp,
                "model_parallel": value(config, "tp"),
                "pipeline_stage": pp,
                "context_parallel": value(config, "cp"),
                "micro_batch_num": ga if pp > 1 else 1,
                "use_seq_parallel": value(config, "sequence_parallel"),
                "vocab_emb_dp": False,
                "gradient_aggregation_group": 4,
            },
            "micro_batch_interleave_num": 1,
            "recompute_config": {
                "recompute": ([layers] * pp if layers else True) if recompute == "full" else False,
                "select_recompute": recompute == "selective",
                "parallel_optimizer_comm_recompute": False,
                "mp_comm_recompute": True,
                "recompute_slice_activation": False,
            },
            "runner_config": {"batch_size": mbs, "gradient_accumulation_steps": 1 if pp > 1 else ga},
        }
        precision = value(config, "precision")
        body["runner_wrapper"] = {
            "scale_sense": {
                "type": "DynamicLossScaleUpdateCell",
                "loss_scale_value": 65536,
                "scale_factor": 2,
                "scale_window": 1000,
            }
            if precision == "fp16"
            else 1.0
        }
        model_config = {"compute_dtype": _DTYPES.get(precision, "float32"), "pp_interleave_num": vpp, "offset": 0}
        seq_len = (ctx.workload or {}).get("seq_len")
        if seq_len:
            model_config["seq_length"] = int(seq_len)
        body["model"] = {"model_config": model_config}
        notes = [
            f"# MindFormers: the run YAML is this file with `base_config: <your model YAML>` on top (or these keys "
            f"merged over it); semi-auto parallel, full_batch: global batch "
            f"{mbs * dp * ga} = batch_size x data_parallel x "
            f"{'micro_batch_num' if pp > 1 else 'gradient_accumulation_steps'}"
        ]
        if seq_len:
            notes.append(
                f"# {ctx.how} at sequence length {int(seq_len)}: a dataset with its own length (Megatron "
                f"datasets' data_loader.config.seq_length) must match"
            )
        if precision == "fp16":
            notes.append(
                "# fp16: if your model YAML's runner_wrapper.scale_sense is a number, replace it by the mapping "
                "below (base_config cannot merge a mapping over a number)"
            )
        flags = value(config, "graph_kernel_flags")
        if flags:
            notes.append(
                f"# graph-kernel flags go in the environment (best.env): "
                f"MS_DEV_GRAPH_KERNEL_FLAGS={one_line(' '.join(str(flags).split()))}"
            )
        written = dict(MINDFORMERS_KEYS)
        with_stages, without = spellings("mindformers")["grad_accum"]
        written["grad_accum"] = with_stages if pp > 1 else without
        return "\n".join([*header_lines(ctx, written=written), *notes]) + "\n" + yaml.safe_dump(body, sort_keys=False)
