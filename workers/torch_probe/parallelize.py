"""Compose tp, cp, pp, recompute, compile and dp on one DeviceMesh, torchtitan style.

``parallelize_llama`` is the recipe; each ``apply_*`` step does one thing and logs (stderr) what
it applied, so a trial's log says exactly which wrappers ran. Order matters and follows
torchtitan: split the meta model into pipeline stages, then per stage TP → CP → activation
checkpointing → compile → data parallel (FSDP2 before materialisation, DDP after), then the
pipeline schedule over the wrapped stages.

Mesh: ``("pp", "dp", "cp", "tp")``, tp innermost so tensor-parallel ranks are neighbours (same
node / fastest links), pp outermost.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..parameters import stage_layers
from .model import Transformer, init_weights
from .plan import ModelConfig, Plan

log = logging.getLogger("autotune.torch_probe")

__all__ = [
    "ParallelModel",
    "build_mesh",
    "dp_mesh_of",
    "pipeline_split",
    "stage_bounds",
    "apply_tp",
    "block_tp_plan",
    "apply_cp",
    "apply_recompute",
    "apply_compile",
    "apply_fsdp",
    "apply_ddp",
    "apply_pp",
    "materialize",
    "parallelize_llama",
]


@dataclass
class ParallelModel:
    """This rank's share of the model: one module per (virtual) pipeline stage it owns."""

    parts: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    schedule: Any = None  # a torch.distributed.pipelining schedule when pp > 1
    fsdp: bool = False  # FSDP2 manages parameters (and mixed precision)
    ddp: bool = False  # parts are DistributedDataParallel wrappers
    applied: list[str] = field(default_factory=list)

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return (self.num_stages - 1) in self.stage_ids

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]


def _note(pm: ParallelModel | None, text: str) -> None:
    log.info("parallelize: %s", text)
    if pm is not None:
        pm.applied.append(text)


def build_mesh(plan: Plan, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (plan.pp, plan.dp, plan.cp, plan.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "cp", "tp"))


def dp_mesh_of(mesh: Any, plan: Plan) -> Any:
    """The ranks that average gradients: dp, or dp×cp flattened (cp ranks hold the same weights)."""
    if plan.cp > 1 and plan.dp > 1:
        return mesh["dp", "cp"]._flatten("dp_cp")
    return mesh["cp"] if plan.cp > 1 else mesh["dp"]


def stage_bounds(num_layers: int, num_stages: int, first_stage_layers: int | None) -> list[int]:
    """Where each stage's layers start, and the end: an even split, or ``first_stage_layers`` on the
    first stage and the rest split evenly (FIRST_STAGE_RULE, Megatron-LM's
    ``--decoder-first-pipeline-num-layers``)."""
    first, other = (int(x) for x in stage_layers(num_layers, num_stages, first_stage_layers))
    return [0, *(first + i * other for i in range(num_stages))]


def pipeline_split(model: Transformer, plan: Plan, pp_rank: int, pm: ParallelModel) -> list[nn.Module]:
    """Cut the (meta) model into ``pp·vpp`` stages of equal layer count (or the first of its own
    size, ``first_stage_layers``); this rank owns stages ``pp_rank + k·pp`` (the loop placement the
    interleaved schedules expect)."""
    num_stages = plan.pp * plan.vpp
    pm.num_stages = num_stages
    if num_stages == 1:
        pm.stage_ids = [0]
        return [model]
    bounds = stage_bounds(model.cfg.num_hidden_layers, num_stages, plan.first_stage_layers)
    parts = []
    pm.stage_ids = [pp_rank + k * plan.pp for k in range(plan.vpp)]
    for sid in pm.stage_ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in range(bounds[sid], bounds[sid + 1])}
        for key in list(part.layers.keys()):
            if key not in keep:
                del part.layers[key]
        if sid != 0:
            part.tok_embeddings = None
        if sid != num_stages - 1:
            part.norm = None
            part.output = None
        parts.append(part)
    sizes = [bounds[i + 1] - bounds[i] for i in range(num_stages)]
    split = f"{sizes[0]} layers each" if len(set(sizes)) == 1 else "layers " + ",".join(map(str, sizes))
    _note(pm, f"pp: {num_stages} stages of {split}, this rank owns stages {pm.stage_ids}")
    return parts


def apply_tp(part: Transformer, tp_mesh: Any, plan: Plan, pm: ParallelModel) -> None:
    """Megatron tensor parallelism with DTensor: Colwise q/k/v and gate/up, Rowwise o and down;
    with ``sequence_parallel`` the norms run on sequence shards and the activations between
    blocks stay sharded on the sequence dim. The head is Colwise with vocab-sharded logits (loss
    parallel) in training, replicated logits in inference."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    sp = plan.sequence_parallel
    act = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {}
    if part.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if part.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if part.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if plan.loss_parallel else Replicate(),
            use_local_output=not plan.loss_parallel,
        )
    if top:
        parallelize_module(part, tp_mesh, top)
    for block in part.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(block, sp))


def block_tp_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The Megatron plan of one transformer block (Colwise q/k/v and gate/up, Rowwise o and down;
    norms on sequence shards with ``sequence_parallel``). One function, so ``autotune calibrate``
    measures a tensor-parallel layer exactly as the probe shards it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    act = Shard(1) if sequence_parallel else Replicate()
    layer_plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    if hasattr(block.feed_forward, "w3"):
        layer_plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        layer_plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return layer_plan


def apply_cp(part: Transformer, cp_mesh: Any, plan: Plan) -> None:
    """Context parallel: this rank trains on sequence chunk ``cp_rank`` (positions offset for
    RoPE and the causal mask) and all-gathers keys/values inside attention."""
    part.pos_offset = cp_mesh.get_local_rank() * (plan.seq_len // plan.cp)
    for block in part.layers.values():
        block.attention.cp_group = cp_mesh.get_group()


def apply_recompute(part: Transformer, plan: Plan) -> None:
    """``selective``: recompute the attention core (RoPE + SDPA) of every layer in backward, as
    Megatron's ``--recompute-granularity selective`` does; the projections and MLP keep their
    activations. ``full``: ``checkpoint_wrapper`` on whole blocks — the first ``recompute_layers``
    blocks of each stage (default all), like Megatron's ``block`` method."""
    if plan.recompute == "selective":
        for block in part.layers.values():
            block.attention.recompute_core = True
    elif plan.recompute == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        keys = list(part.layers.keys())
        n = len(keys) if plan.recompute_layers is None else min(plan.recompute_layers, len(keys))
        for key in keys[:n]:
            part.layers[key] = checkpoint_wrapper(part.layers[key], preserve_rng_state=False)


def apply_compile(part: Transformer, plan: Plan) -> None:
    """torch.compile each block in place (``nn.Module.compile`` keeps parameter names): the
    blocks are identical, so one compiled graph is reused and compile time stays small."""
    mode = None if plan.compile == "default" else plan.compile
    # Training shapes are fixed; decoding passes a new position every token, which must stay
    # symbolic (dynamic=None lets dynamo mark it dynamic after the first recompile).
    dynamic = False if plan.kind == "train" else None
    for block in part.layers.values():
        block.compile(mode=mode, dynamic=dynamic)
    # torch 2.13: the gradient a compiled TP block returns into the tensor-parallel embedding's
    # to_local() reaches DTensor's redistribute backward as a plain tensor ("'Tensor' object has
    # no attribute '_local_tensor'"); one copy of the embedding output in between avoids it.
    part.clone_embedding = plan.tp > 1


def _amp_dtype(plan: Plan) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)


def apply_fsdp(part: Transformer, dp_mesh: Any, plan: Plan) -> None:
    """FSDP2 (``fully_shard``) per block, then the root: zero_stage 3 = full sharding (params
    re-gathered in backward), zero_stage 2 = ``reshard_after_forward=False`` (params stay gathered
    between forward and backward; grads and optimizer state sharded). Mixed precision through
    FSDP's policy (compute in bf16/fp16, reduce gradients in fp32), as torchtitan does.
    With zero_stage 0/1 and tp > 1 or pp > 1, FSDP2's ``replicate`` plays DDP's role (gradients
    all-reduced; ZeRO-1 then shards the optimizer, see zero1.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = _amp_dtype(plan)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    if plan.zero_stage in (0, 1):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in part.layers.values():
            replicate(block, mesh=dp_mesh, mp_policy=mp)
        replicate(part, mesh=dp_mesh, mp_policy=mp)
        return
    reshard = plan.zero_stage == 3
    for block in part.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def apply_ddp(part: nn.Module, dp_mesh: Any, device_index: int | None) -> nn.Module:
    """zero_stage 0/1 without tp: classic DDP (bucketed all-reduce overlapped with backward).
    ZeRO-1's optimizer sharding is the optimizer's job (train.build_optimizer)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        part,
        device_ids=None if device_index is None else [device_index],
        process_group=dp_mesh.get_group(),
        broadcast_buffers=False,
    )


def materialize(part: nn.Module, cfg: ModelConfig, device: torch.device, seed: int) -> None:
    """Allocate this rank's (sharded) parameters on the device and fill them (meta → real)."""
    part.to_empty(device=device)
    if isinstance(part, Transformer) and part.tied and part.output is not None and part.tok_embeddings is not None:
        part.output.weight = part.tok_embeddings.weight
    init_weights(part, cfg, seed)


def apply_pp(pm: ParallelModel, plan: Plan, pp_mesh: Any, device: torch.device, loss_fn: Callable[..., Any]) -> None:
    """Pipeline stages over the wrapped parts and the schedule: 1F1B, or interleaved 1F1B with
    ``vpp`` stages per rank; ``grad_accum`` micro-batches per step (gradients averaged)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    group = pp_mesh.get_group()
    stages = [PipelineStage(part, sid, pm.num_stages, device, group=group) for part, sid in zip(pm.parts, pm.stage_ids)]
    if plan.vpp == 1:
        pm.schedule = Schedule1F1B(stages[0], n_microbatches=plan.grad_accum, loss_fn=loss_fn, scale_grads=True)
        name = "1F1B"
    else:
        pm.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=plan.grad_accum, loss_fn=loss_fn, scale_grads=True)
        name = f"interleaved 1F1B (vpp={plan.vpp})"
    _note(pm, f"pp: schedule {name}, {plan.grad_accum} micro-batches of {plan.micro_batch_size}")


def parallelize_llama(
    cfg: ModelConfig,
    plan: Plan,
    mesh: Any,
    device: torch.device,
    device_index: int | None,
    loss_fn: Callable[..., Any] | None = None,
) -> ParallelModel:
    """The recipe: meta model → this rank's parallel, materialised, wrapped parts (+ schedule)."""
    pm = ParallelModel(parts=[], stage_ids=[0], num_stages=1)
    tie = cfg.tie_word_embeddings and plan.tp == 1 and plan.pp == 1 and plan.zero_stage < 2
    if cfg.tie_word_embeddings and not tie:
        _note(pm, "tie_word_embeddings: untied (tied weights are kept only without tp, pp and FSDP)")
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=plan.seq_len, tie=tie)
    parts = pipeline_split(model, plan, mesh["pp"].get_local_rank(), pm)
    if plan.tp > 1:
        for part in parts:
            apply_tp(part, mesh["tp"], plan, pm)
        _note(
            pm,
            f"tp: {plan.tp}-way Colwise q/k/v/gate/up, Rowwise o/down"
            + (", sequence parallel norms" if plan.sequence_parallel else "")
            + (", loss parallel" if plan.loss_parallel else ""),
        )
    if plan.cp > 1:
        for part in parts:
            apply_cp(part, mesh["cp"], plan)
        _note(pm, f"cp: {plan.cp}-way, sequence chunks with all-gathered K/V")
    if plan.recompute != "none" and plan.kind == "train":
        for part in parts:
            apply_recompute(part, plan)
        what = (
            "attention core (RoPE+SDPA) of every layer"
            if plan.recompute == "selective"
            else (
                f"full blocks (first {plan.recompute_layers} per stage)"
                if plan.recompute_layers is not None
                else "all blocks"
            )
        )
        _note(pm, f"recompute {plan.recompute}: {what}")
    if plan.compile != "none":
        for part in parts:
            apply_compile(part, plan)
        _note(pm, f"compile: torch.compile(mode={plan.compile!r}) per block")
    dp_mesh = dp_mesh_of(mesh, plan)
    # DDP (the class) only for plain data parallel: it cannot hold DTensor (tp) parameters, and
    # its bucket rebuilding breaks under the pipeline schedules' interleaved micro-batches
    # (wrong gradients or an internal assert, torch 2.13); FSDP2's replicate handles both.
    use_fsdp = plan.kind == "train" and plan.dp_cp > 1 and (plan.zero_stage >= 2 or plan.tp > 1 or plan.pp > 1)
    if use_fsdp:
        for part in parts:
            apply_fsdp(part, dp_mesh, plan)
        pm.fsdp = plan.zero_stage >= 2
        if plan.zero_stage >= 2:
            _note(
                pm,
                f"dp: FSDP2 over {plan.dp_cp} ranks, zero_stage {plan.zero_stage} "
                f"(reshard_after_forward={plan.zero_stage == 3}), precision {plan.precision} via MixedPrecisionPolicy",
            )
        else:
            _note(
                pm,
                f"dp: replicate (FSDP2-based DDP) over {plan.dp_cp} ranks"
                + (" + ZeRO-1 optimizer sharding (zero1.Zero1AdamW)" if plan.zero_stage == 1 else ""),
            )
    for part in parts:
        materialize(part, cfg, device, plan.seed)
    if plan.kind == "train" and plan.dp_cp > 1 and not use_fsdp:
        parts = [apply_ddp(part, dp_mesh, device_index) for part in parts]
        pm.ddp = True
        _note(
            pm,
            f"dp: DDP over {plan.dp_cp} ranks"
            + (" + ZeRO-1 optimizer sharding (ZeroRedundancyOptimizer)" if plan.zero_stage == 1 else ""),
        )
    elif plan.kind == "train" and plan.dp_cp == 1 and plan.zero_stage:
        _note(pm, f"dp: zero_stage {plan.zero_stage} has nothing to shard with dp=1: plain optimizer")
    pm.parts = parts
    if plan.pp > 1:
        if loss_fn is None:
            raise ValueError("pipeline parallel needs the loss function")
        apply_pp(pm, plan, mesh["pp"], device, loss_fn)
    return pm
