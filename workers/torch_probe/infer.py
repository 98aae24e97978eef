"""The inference probe: prefill + greedy decode with a static KV cache, tensor parallel.

Each repetition serves one batch of ``batch_size`` prompts of ``prompt_len`` tokens and generates
``gen_len`` tokens: the prefill (up to the first generated token) gives the time to first token,
the decode loop the per-token latency. Weights are cast to the trial's precision (inference runs
in half precision, no autocast). With dp > 1 every replica runs its own batch; the figures are
per replica, ``tokens_per_s`` is the total.
"""

from __future__ import annotations

import torch

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
    dp_rank = rt.mesh["dp"].get_local_rank()
    prompt = synthetic_tokens(dp_rank, plan.batch_size, plan.prompt_len - 1, rt.cfg.vocab_size, plan.seed)
    prompt = prompt.to(rt.device)
    rt.sync()
    rt.timings["time_model_build_s"] = measure.now() - t0

    ttfts, per_token, totals = [], [], []
    phase_time = {"warmup": 0.0, "measure": 0.0}
    generated = plan.batch_size * plan.gen_len
    with torch.no_grad():
        for i in range(plan.warmup_steps + plan.measured_steps):
            phase = "warmup" if i < plan.warmup_steps else "measure"
            model.set_kv_cache(plan.batch_size, plan.prompt_len + plan.gen_len, dtype)
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
                        "step": i,
                        "phase": phase,
                        "step_time_s": s2 - s0,
                        "tokens": generated,
                        "ttft_ms": (s1 - s0) * 1e3,
                        "memory_gib": _memory(rt)[0],
                    }
                )
    model.set_kv_cache(None)

    ttft = measure.median(ttfts)
    tok_lat = measure.median(per_token)
    metrics = measure.summarize_times(totals)
    metrics.update(
        ttft_ms=ttft * 1e3,
        decode_tokens_per_s=plan.batch_size / tok_lat if tok_lat > 0 else 0.0,
        decode_latency_ms=tok_lat * 1e3,
        # the definition autotune.objectives.derive_metrics and the simulator use
        time_for_100_tokens_s=ttft + 100 * tok_lat,
        tokens_per_s=generated * plan.dp / metrics["step_time_s"],
        tokens_per_s_per_device=generated * plan.dp / metrics["step_time_s"] / rt.world_size,
        samples_per_s=plan.batch_size * plan.dp / metrics["step_time_s"],
        time_warmup_s=phase_time["warmup"],
        time_measure_s=phase_time["measure"],
    )
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
