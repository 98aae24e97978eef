"""The inference probe: prefill + greedy decode with a static KV cache, tensor parallel.

Every config is measured at each of the workload's batch sizes (``plan.batch_sizes``, measurement
points, not a knob). Each repetition serves one batch of prompts of ``prompt_len`` tokens and generates
``gen_len`` tokens: the prefill (up to the first generated token) gives the time to first token,
the decode loop the per-token latency. Weights are cast to the trial's precision (inference runs
in half precision, no autocast). With dp > 1 every replica runs its own batch; the figures are
per replica (``<metric>_bs<N>``; the headline figures by :func:`autotune.objectives.infer_headline`:
latency at the smallest batch, throughput at the largest, per device = per instance / tp), and
``tokens_per_s`` is the total at the largest batch.
"""

from __future__ import annotations

from typing import Any

import torch
from autotune.objectives import infer_headline

from . import measure
from .failures import ProbeFailure
from .model import synthetic_tokens
from .parallelize import parallelize_llama
from .train import Runtime

__all__ = ["run_infer"]


def run_infer(rt: Runtime) -> dict[str, float]:
    plan = rt.plan
    t0 = measure.now()
    pm = parallelize_llama(rt.cfg, plan, rt.mesh, rt.device, rt.device_index)
    model = pm.parts[0]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision, torch.float32)
    model.to(dtype)
    model.rope_cos.data = model.rope_cos.float()  # keep RoPE tables exact
    model.rope_sin.data = model.rope_sin.float()
    model.eval()
    rt.sync()
    rt.timings["time_model_build_s"] = measure.now() - t0

    sizes = plan.batch_sizes or [plan.batch_size]
    phase_time = {"warmup": 0.0, "measure": 0.0}
    points: dict[int, dict[str, float]] = {}
    totals: list[float] = []
    step = 0
    with torch.no_grad():
        for batch in sizes:
            point, point_totals, step = _measure_batch(rt, model, dtype, batch, phase_time, step)
            points[batch] = point
            if batch == max(sizes):
                totals = point_totals
    model.set_kv_cache(None)

    largest = max(sizes)
    metrics = measure.summarize_times(totals)
    generated = largest * plan.gen_len
    # the per-batch figures and the headline ones, by the one definition the simulator uses too
    metrics.update(infer_headline(points, float(plan.tp), {}))
    metrics.update(
        decode_latency_ms=1e3 * largest / points[largest]["decode_tokens_per_s"]
        if points[largest]["decode_tokens_per_s"] > 0
        else 0.0,
        tokens_per_s=generated * plan.dp / metrics["step_time_s"],
        tokens_per_s_per_device=generated * plan.dp / metrics["step_time_s"] / rt.world_size,
        samples_per_s=largest * plan.dp / metrics["step_time_s"],
        time_warmup_s=phase_time["warmup"],
        time_measure_s=phase_time["measure"],
    )
    if len(sizes) == 1:  # one batch measured (a batch_size param): its figures are the headline ones
        metrics = {k: v for k, v in metrics.items() if "_bs" not in k}
    alloc, reserved = _max_over_ranks(rt, _memory(rt))
    if rt.memory_limit_gib is not None and alloc > rt.memory_limit_gib:
        raise ProbeFailure(
            "oom",
            f"out of memory: peak RSS {alloc:.3f} GiB exceeds the soft limit "
            f"AUTOTUNE_MEMORY_LIMIT_GIB={rt.memory_limit_gib:g} GiB (requested {alloc:.3f} GiB)",
            collective=True,
        )
    metrics["peak_memory_gib"] = alloc
    if rt.device_kind != "cpu":
        metrics["peak_reserved_gib"] = reserved
    metrics.update(rt.timings)
    return metrics


def _measure_batch(
    rt: Runtime, model: Any, dtype: torch.dtype, batch: int, phase_time: dict[str, float], step: int
) -> tuple[dict[str, float], list[float], int]:
    """One batch size: warm-up and measured repetitions of prefill + greedy decode (a device sync
    around each timer); the medians of TTFT and per-token latency, each repetition's wall, and the
    next step number for the step events."""
    plan = rt.plan
    dp_rank = rt.mesh["dp"].get_local_rank()
    prompt = synthetic_tokens(dp_rank, batch, plan.prompt_len - 1, rt.cfg.vocab_size, plan.seed).to(rt.device)
    ttfts, per_token, totals = [], [], []
    for i in range(plan.warmup_steps + plan.measured_steps):
        phase = "warmup" if i < plan.warmup_steps else "measure"
        model.set_kv_cache(batch, plan.prompt_len + plan.gen_len, dtype)
        rt.sync()
        s0 = measure.now()
        logits = model(prompt, pos0=0)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        rt.sync()
        s1 = measure.now()
        for j in range(plan.gen_len - 1):
            logits = model(nxt, pos0=plan.prompt_len + j)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
        rt.sync()
        s2 = measure.now()
        phase_time[phase] += s2 - s0
        if phase == "measure":
            ttfts.append(s1 - s0)
            per_token.append((s2 - s1) / max(1, plan.gen_len - 1))
            totals.append(s2 - s0)
        if rt.rank == 0:
            measure.emit(
                {
                    "event": "step",
                    "step": step,
                    "phase": phase,
                    "batch_size": batch,
                    "step_time_s": s2 - s0,
                    "tokens": batch * plan.gen_len,
                    "ttft_ms": (s1 - s0) * 1e3,
                    "memory_gib": _memory(rt)[0],
                }
            )
        step += 1
    ttft = measure.median(ttfts)
    tok_lat = measure.median(per_token)
    point = {
        "ttft_ms": ttft * 1e3,
        "decode_tokens_per_s": batch / tok_lat if tok_lat > 0 else 0.0,
        # the definition autotune.objectives.derive_metrics and the simulator use
        "time_for_100_tokens_s": ttft + 100 * tok_lat,
    }
    return point, totals, step


def _memory(rt: Runtime) -> tuple[float, float]:
    if rt.device_kind == "cpu":
        rss = measure.peak_rss_gib()
        return rss, rss
    return (
        rt.devmod.max_memory_allocated(rt.device) / measure.GIB,
        rt.devmod.max_memory_reserved(rt.device) / measure.GIB,
    )


def _max_over_ranks(rt: Runtime, values: tuple[float, float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    if rt.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])
