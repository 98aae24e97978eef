"""The training probe: build the parallel model, run warm-up and measured steps, report.

One step = one optimizer step over the global batch: ``grad_accum`` micro-batches of
``micro_batch_size`` sequences per data-parallel rank (through the pipeline schedule when pp > 1),
AdamW, and the fp16 loss scaler when asked. After each step the ranks exchange one small tensor
(loss share, memory) outside the timed region, so every rank sees the same global loss (a
non-finite one ends the probe on all ranks together as ``nan``) and the same memory peak (the
soft memory limit fails all ranks together as ``oom``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...objectives import flops_per_token
from . import measure
from .failures import ProbeFailure, report_step
from .model import synthetic_tokens
from .parallelize import ParallelModel, dp_mesh_of, parallelize_llama
from .plan import ModelConfig, Plan

log = logging.getLogger("autotune.torch_probe")

__all__ = ["Runtime", "run_train"]


@dataclass
class Runtime:
    """What the probe knows about this process: rank, device, mesh, the device module."""

    plan: Plan
    cfg: ModelConfig
    rank: int
    world_size: int
    device: torch.device
    device_kind: str
    device_index: int | None
    devmod: Any
    mesh: Any
    model_dict: dict[str, Any] = field(default_factory=dict)  # the trial's model mapping
    peak_tflops: dict[str, float] = field(default_factory=dict)
    memory_limit_gib: float | None = None
    artifact_dir: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    peak_by_rank: list[float] = field(default_factory=list)  # GiB, every rank's (the result's info)
    usable_gib: float | None = None  # the least any rank's allocator could use (USABLE_KEY), on a device

    def sync(self) -> None:
        self.devmod.synchronize()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of a tensor (the local shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached float plain tensor (under loss parallel the loss is a replicated DTensor)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.float()


class _Trainer:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        plan = rt.plan
        self.inject = False
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)
        self.scaler: Any = None
        self.pm: ParallelModel = parallelize_llama(
            rt.cfg, plan, rt.mesh, rt.device, rt.device_index, loss_fn=self._pp_loss
        )
        # FSDP2 applies mixed precision itself; everything else runs under autocast.
        self.autocast = self.amp_dtype is not None and not self.pm.fsdp
        self.optimizer = self._build_optimizer()
        if plan.precision == "fp16":
            self.scaler = self._build_scaler()
            # Initialise the scale on every rank: under pp only the last stage scales a loss,
            # but every rank unscales and steps.
            self.scaler.scale(torch.zeros((), device=rt.device))
        self.pp_rank = rt.mesh["pp"].get_local_rank()
        self.dp_rank = rt.mesh["dp"].get_local_rank()
        self.cp_rank = rt.mesh["cp"].get_local_rank()
        # gradient bytes exist only inside a step (zero_grad frees them): counted as the first
        # optimizer step begins, by a hook that then removes itself
        self.grad_bytes: float | None = None
        self._grad_hook = self.optimizer.register_step_pre_hook(self._count_grads)

    # -- model-state accounting (what the memory rule predicts) ----------------------------------
    def _count_grads(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.grad_bytes = float(sum(_local_bytes(p.grad) for p in self.pm.parameters() if p.grad is not None))
        self._grad_hook.remove()

    def state_bytes(self) -> list[float]:
        """[weights, gradients, optimizer states] bytes this rank holds, and the model parameters
        it is the first replica of (0 on other dp/cp/tp replicas): summed over ranks, the second
        gives the model's parameter count. Step counters (0-d tensors) are not states."""
        params = list(self.pm.parameters())
        optimizer = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: the local one
        states = sum(
            _local_bytes(v)
            for st in optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        first_replica = self.dp_rank == 0 and self.cp_rank == 0 and self.rt.mesh["tp"].get_local_rank() == 0
        owned = float(sum(p.numel() for p in params)) if first_replica else 0.0
        return [float(sum(_local_bytes(p) for p in params)), self.grad_bytes or 0.0, float(states), owned]

    # -- construction ---------------------------------------------------------------------------
    def _build_optimizer(self) -> torch.optim.Optimizer:
        plan, params = self.rt.plan, self.pm.parameters()
        kwargs = dict(lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
        if plan.zero_stage == 1 and plan.dp_cp > 1:
            group = dp_mesh_of(self.rt.mesh, plan).get_group()
            if self.pm.ddp:  # plain tensors: torch's own ZeRO-1
                from torch.distributed.optim import ZeroRedundancyOptimizer

                return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=group, **kwargs)
            from .zero1 import Zero1AdamW  # DTensor parameters (tp, or replicate under pp)

            return Zero1AdamW(params, group, **kwargs)
        return torch.optim.AdamW(params, **kwargs)

    def _build_scaler(self) -> Any:
        """fp16 loss scaling. With one rank, torch.amp.GradScaler; with several, the sharded
        scaler, because its inf/nan check is all-reduced over all ranks — TP, PP and FSDP ranks
        hold different gradients and must agree on skipping a step."""
        kind = self.rt.device_kind
        if self.rt.world_size == 1:
            return torch.amp.GradScaler(kind)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=kind)

    # -- one step -------------------------------------------------------------------------------
    def _amp(self) -> Any:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.rt.device_kind, dtype=self.amp_dtype)

    def _loss_ctx(self) -> Any:
        if not self.rt.plan.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def _maybe_inject(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.inject else loss

    def _pp_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self._maybe_inject(_loss(logits, labels))
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows (dp) and sequence chunk (cp) of the step's global batch."""
        plan = self.rt.plan
        tokens = synthetic_tokens(step, plan.global_batch_size, plan.seq_len, self.rt.cfg.vocab_size, plan.seed)
        rows = plan.micro_batch_size * plan.grad_accum
        tokens = tokens[self.dp_rank * rows : (self.dp_rank + 1) * rows]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        chunk = plan.seq_len // plan.cp
        sl = slice(self.cp_rank * chunk, (self.cp_rank + 1) * chunk)
        return inputs[:, sl].contiguous().to(self.rt.device), labels[:, sl].contiguous().to(self.rt.device)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step; returns this rank's mean loss (None off the last pipeline stage)."""
        plan, pm = self.rt.plan, self.pm
        loss: torch.Tensor | None
        with self._amp(), self._loss_ctx():
            if pm.schedule is not None:
                losses: list[torch.Tensor] = []
                args = (inputs,) if pm.is_first else ()
                kwargs = {"target": labels, "losses": losses} if pm.is_last else {}
                pm.schedule.step(*args, **kwargs)
                loss = torch.stack([_plain(x) for x in losses]).mean() if pm.is_last else None
                if loss is not None and self.scaler is not None:
                    loss = loss / self.scaler.get_scale()
            else:
                model = pm.parts[0]
                total = torch.zeros((), device=self.rt.device)
                mbs = plan.micro_batch_size
                for m in range(plan.grad_accum):
                    last = m == plan.grad_accum - 1
                    sync_ctx = model.no_sync() if (pm.ddp and not last) else contextlib.nullcontext()
                    with sync_ctx:
                        x, y = inputs[m * mbs : (m + 1) * mbs], labels[m * mbs : (m + 1) * mbs]
                        mb_loss = self._maybe_inject(_loss(model(x), y)) / plan.grad_accum
                        (self.scaler.scale(mb_loss) if self.scaler is not None else mb_loss).backward()
                    total += _plain(mb_loss)
                loss = total
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    # -- cross-rank bookkeeping -----------------------------------------------------------------
    def memory_now(self) -> tuple[float, float, float]:
        """(peak allocated, peak reserved, usable) GiB of this rank; on cpu both peaks are the peak
        RSS and usable is unknown (NaN). Usable: what the allocator could use now, its reserve
        plus what the device has free (``mem_get_info``): the device's memory less what the
        runtime, the communicators and other processes hold (protocol ``USABLE_KEY``)."""
        rt = self.rt
        if rt.device_kind == "cpu":
            rss = measure.peak_rss_gib()
            return rss, rss, math.nan
        usable = math.nan
        mem_get_info = getattr(rt.devmod, "mem_get_info", None)
        if mem_get_info is not None:
            free, _total = mem_get_info(rt.device)
            usable = (free + rt.devmod.memory_reserved(rt.device)) / measure.GIB
        return (
            rt.devmod.max_memory_allocated(rt.device) / measure.GIB,
            rt.devmod.max_memory_reserved(rt.device) / measure.GIB,
            usable,
        )

    def exchange(self, loss: torch.Tensor | None) -> tuple[float, list[list[float]]]:
        """Global mean loss and every rank's memory, with one all-gather.

        The loss lives on the last pipeline stage, identical on its tp ranks, one value per
        dp×cp replica: each such rank contributes loss/(dp·cp·tp) and the sum is the mean.
        """
        plan = self.rt.plan
        share = 0.0
        if loss is not None:
            share = float(loss) / (plan.dp_cp * plan.tp)
        alloc, reserved, usable = self.memory_now()
        mine = torch.tensor([share, alloc, reserved, usable], dtype=torch.float64, device=self.rt.device)
        if self.rt.world_size == 1:
            rows = [mine.tolist()]
        else:
            out = torch.empty(self.rt.world_size * 4, dtype=torch.float64, device=self.rt.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, mine)
            rows = out.view(self.rt.world_size, 4).tolist()
        if not all(math.isfinite(r[0]) for r in rows):
            return float("nan"), rows
        return sum(r[0] for r in rows), rows


def _state_bytes_per_param(tr: _Trainer) -> dict[str, float]:
    """Model-state bytes per parameter of a device's share of the model, measured after the first
    step (all ranks summed, outside the timer): what the ``torch-probe`` memory rule predicts
    (``workers/simulate/_memory.state_bytes_per_param``), and a check of it on every probe."""
    rt = tr.rt
    mine = torch.tensor(tr.state_bytes(), dtype=torch.float64, device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(mine)
    weights, grads, states, params = mine.tolist()
    per_device = params / (rt.plan.tp * rt.plan.pp)  # parameters of one device's share before ZeRO
    denominator = max(per_device * rt.world_size, 1.0)
    return {
        "state_weight_bytes_per_param": weights / denominator,
        "state_grad_bytes_per_param": grads / denominator,
        "state_optimizer_bytes_per_param": states / denominator,
    }


def _check_memory(rt: Runtime, rows: list[list[float]], when: str) -> None:
    if rt.memory_limit_gib is None:
        return
    worst = max(range(len(rows)), key=lambda r: rows[r][1])
    peak = rows[worst][1]
    if peak > rt.memory_limit_gib:
        what = "peak RSS" if rt.device_kind == "cpu" else "peak allocated"
        failure = ProbeFailure(
            "oom",
            f"rank {worst}: out of memory {when}: {what} {peak:.3f} GiB exceeds the soft limit "
            f"AUTOTUNE_MEMORY_LIMIT_GIB={rt.memory_limit_gib:g} GiB (requested {peak:.3f} GiB)",
            collective=True,  # every rank raises it from the exchanged values; rank 0 reports
        )
        raise failure


def _profiled_step(tr: _Trainer, step: int) -> dict[str, float]:
    """One extra step under torch.profiler on rank 0 (the others run it plainly): the share of
    the step spent in collectives, and the trace as an artifact."""
    rt = tr.rt
    inputs, labels = tr.local_batch(step)
    if rt.rank != 0:
        tr.step(inputs, labels)
        rt.sync()
        return {}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if rt.device_kind == "cuda":
        activities.append(ProfilerActivity.CUDA)
    elif rt.device_kind == "npu" and hasattr(ProfilerActivity, "PrivateUse1"):
        activities.append(ProfilerActivity.PrivateUse1)
    with profile(activities=activities) as prof:
        rt.sync()
        t0 = measure.now()
        with torch.profiler.record_function("autotune_step"):
            tr.step(inputs, labels)
            rt.sync()
        wall = measure.now() - t0
    events = list(prof.events())
    marker = [e for e in events if e.name == "autotune_step"]
    start = marker[0].time_range.start if marker else min(e.time_range.start for e in events)
    end = marker[0].time_range.end if marker else max(e.time_range.end for e in events)
    frac, comm_us = measure.comm_fraction([e for e in events if e.name != "autotune_step"], start, end)
    out = {"comm_fraction": frac, "comm_time_s": comm_us / 1e6, "profiled_step_time_s": wall}
    if rt.artifact_dir:
        os.makedirs(rt.artifact_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(rt.artifact_dir, "trace_rank0.json"))
    return out


def run_train(rt: Runtime) -> dict[str, float]:
    """Build, warm up, measure; emit a step event per step (rank 0); return the metrics."""
    plan = rt.plan
    t0 = measure.now()
    tr = _Trainer(rt)
    _, rows = tr.exchange(None)
    rt.sync()
    rt.timings["time_model_build_s"] = measure.now() - t0
    _check_memory(rt, rows, "after model build")

    tokens = plan.tokens_per_step()
    times: list[float] = []
    loss = float("nan")
    phase_time = {"warmup": 0.0, "measure": 0.0}
    n_steps = plan.warmup_steps + plan.measured_steps
    state: dict[str, float] = {}
    for i in range(n_steps):
        phase = "warmup" if i < plan.warmup_steps else "measure"
        tp0 = measure.now()
        inputs, labels = tr.local_batch(i)
        tr.inject = plan.inject_nan_at_step == i
        rt.sync()
        s0 = measure.now()
        local = tr.step(inputs, labels)
        rt.sync()
        dt = measure.now() - s0
        loss, rows = tr.exchange(local)
        phase_time[phase] += measure.now() - tp0
        mem = max(r[1] for r in rows)
        if phase == "measure":
            times.append(dt)
        report_step(measure.emit if rt.rank == 0 else None, i, phase, dt, tokens, loss, mem)
        _check_memory(rt, rows, f"at step {i}")
        if i == 0:
            state = _state_bytes_per_param(tr)

    metrics = measure.summarize_times(times)
    med = metrics["step_time_s"]
    tps = tokens / med
    metrics.update(
        tokens_per_s=tps,
        tokens_per_s_per_device=tps / rt.world_size,
        samples_per_s=plan.global_batch_size / med,
        loss=loss,
        loss_finite=1.0,
        time_warmup_s=phase_time["warmup"],
        time_measure_s=phase_time["measure"],
    )
    peak = rt.peak_tflops.get(plan.precision)
    if peak:
        # the one MFU definition (model FLOPs, recompute not counted), shared with the simulator
        flops = flops_per_token(rt.model_dict, plan.seq_len, True)
        metrics["mfu"] = flops * metrics["tokens_per_s_per_device"] / (float(peak) * 1e12)
    metrics.update(state)
    metrics["peak_memory_gib"] = max(r[1] for r in rows)
    rt.peak_by_rank = [float(r[1]) for r in rows]
    usable = [float(r[3]) for r in rows if math.isfinite(r[3])]
    rt.usable_gib = min(usable) if len(usable) == len(rows) else None  # the rank with least to spare
    if rt.device_kind != "cpu":
        metrics["peak_reserved_gib"] = max(r[2] for r in rows)
    if plan.profile_step:
        p0 = measure.now()
        metrics.update(_profiled_step(tr, n_steps))
        metrics["time_profile_s"] = measure.now() - p0
    metrics.update(rt.timings)
    return metrics
