"""The MindSpore probe: ``python probe.py TRIAL_FILE``, or under ``msrun`` for data parallel.

Runs in MindSpore's own environment (MindSpore's PYNATIVE mode needs ``numpy<2``, the rest of
autotune needs ``numpy>=2``), so it imports only the standard library, numpy and MindSpore;
the timing statistics and failure classification it shares with the torch probe, and the parameter
table, are loaded from their files (``../torch_probe/measure.py``, ``failures.py`` and
``../parameters.py`` are standard-library only).

Order: read the trial; resolve and validate the plan (a config MindSpore cannot run here is
``invalid`` before MindSpore starts); put ``env.*`` and ``MS_DEV_GRAPH_KERNEL_FLAGS`` into the
environment; import MindSpore; pick the device (``ms.set_device``), the mode and jit level
(``set_context(mode=..., jit_config={"jit_level": ...})``); join the group under msrun; build the
Llama with random weights; run warm-up and measured steps on synthetic tokens; print the probe
protocol's lines (rank 0): one ``{"event": "step", ...}`` per step, then ``{"metrics": ...}``,
or one ``{"event": "failure", ...}``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEVICES = {"cpu": "CPU", "npu": "Ascend", "cuda": "GPU"}
ASCEND_ONLY_NOTE = (
    "only on Ascend: MindSpore's CPU backend runs data parallel (msrun, mccl) but not the "
    "semi-auto parallel that tensor and pipeline parallelism need"
)


def _load(name: str, relative: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HERE / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


measure = _load("autotune_probe_measure", "../torch_probe/measure.py")
failures = _load("autotune_probe_failures", "../torch_probe/failures.py")
parameters = _load("autotune_probe_parameters", "../parameters.py")
ProbeFailure = failures.ProbeFailure


def resolve_plan(trial: dict[str, Any], world: int) -> dict[str, Any]:
    """The trial's settings with defaults (the parameter table's on the trial's accelerator: precision
    fp32 on a CPU, bf16 on Ascend), checked against what this probe can run (no MindSpore)."""
    p = dict(trial.get("params", {}))
    w = dict(trial.get("workload", {}))
    accelerator = str(trial.get("cluster", {}).get("accelerator", "cpu"))
    value = parameters.value
    tp, pp = value(p, "tp"), value(p, "pp")
    if tp * pp > 1:
        raise ProbeFailure(
            "invalid",
            f"tp={tp} pp={pp}: tensor and pipeline parallelism run through semi-auto "
            f"parallel, which this probe supports {ASCEND_ONLY_NOTE}; on Ascend, measure "
            "them with MindFormers through the command backend",
        )
    dp = int(p.get("dp") or world)
    if dp != world:
        raise ProbeFailure("invalid", f"dp={dp} but {world} processes were started: dp must equal the world size")
    gbs = int(w.get("global_batch_size", dp))
    mbs = value(p, "micro_batch_size")
    if gbs % (mbs * dp):
        raise ProbeFailure("invalid", f"global_batch_size {gbs} is not a multiple of micro_batch_size {mbs} x dp {dp}")
    mode = value(p, "mode")
    if mode not in ("graph", "pynative"):
        raise ProbeFailure("invalid", f"mode {mode!r}: expected graph or pynative")
    flags = value(p, "graph_kernel_flags")
    jit_level = parameters.probe_jit_level(p)
    if jit_level not in ("O0", "O1"):
        raise ProbeFailure(
            "invalid",
            f"jit_level {jit_level}: MindSpore 2.10's ms.jit takes O0 or O1; O2 (whole-graph "
            "sinking, Ascend) is not driven by this probe",
        )
    notes = []
    if flags and (mode != "graph" or jit_level != "O1"):
        notes.append(
            f"graph_kernel_flags have no effect with mode={mode} jit_level={jit_level} "
            "(graph-kernel fusion runs in graph mode at jit level O1)"
        )
    precision = value(p, "precision", accelerator)
    if precision not in ("fp32", "fp16", "bf16"):
        raise ProbeFailure("invalid", f"precision {precision!r}: expected fp32, fp16 or bf16")
    if precision == "bf16" and accelerator == "cpu":
        raise ProbeFailure(
            "invalid",
            "precision bf16: MindSpore's CPU backend has no bf16 kernels (its Gather "
            "rejects BFloat16); bf16 runs on Ascend",
        )
    zero = value(p, "zero_stage")
    if zero > 1:
        raise ProbeFailure(
            "invalid",
            f"zero_stage={zero}: the probe shards optimizer states only (MindSpore's "
            "parallel optimizer, zero_stage 1); sharded weights and gradients need "
            f"semi-auto parallel, {ASCEND_ONLY_NOTE}",
        )
    if zero == 1 and accelerator != "npu":
        raise ProbeFailure(
            "invalid",
            "zero_stage=1: MindSpore's optimizer sharding (parallel optimizer) in data "
            "parallel mode runs only on Ascend (MindSpore 2.10 on CPU: 'parallel optimizer "
            'only supports "Ascend" in data parallel mode\')',
        )
    return {
        "accelerator": accelerator,
        "dp": dp,
        "micro_batch_size": mbs,
        "grad_accum": int(parameters.grad_accum(gbs, mbs, dp)),
        "global_batch_size": gbs,
        "seq_len": int(w.get("seq_len", 128)),
        "mode": mode,
        "jit_level": jit_level,
        "graph_kernel_flags": flags,
        "recompute": value(p, "recompute"),
        "precision": precision,
        "warmup_steps": int(w.get("warmup_steps", 1)),
        "measured_steps": int(w.get("measured_steps", 3)),
        "env": {k[4:]: str(v) for k, v in p.items() if k.startswith("env.")},
        "notes": notes,
        "inject_nan_at_step": int(os.environ.get("AUTOTUNE_INJECT_NAN_STEP", "-1")),
        "zero_stage": zero,
    }


def prepare_env(plan: dict[str, Any]) -> dict[str, str]:
    """The trial's environment, before MindSpore is imported (graph-kernel flags are read then)."""
    applied = dict(plan["env"])
    if plan["graph_kernel_flags"]:
        applied.setdefault("MS_DEV_GRAPH_KERNEL_FLAGS", plan["graph_kernel_flags"])
    os.environ.update(applied)
    return applied


def _software(ms: Any) -> dict[str, str]:
    info = {"mindspore": ms.__version__}
    for name, path in (
        ("cann", "/usr/local/Ascend/ascend-toolkit/latest/version.cfg"),
        ("driver", "/usr/local/Ascend/driver/version.info"),
    ):
        try:
            for line in open(path).read().splitlines():
                if "=" in line and ("version" in line.lower()):
                    info[name] = line.split("=", 1)[1].strip().strip('"[]')
                    break
        except OSError:
            pass
    return info


def _peak_memory_gib(ms: Any, device: str) -> float:
    if device == "CPU":
        return measure.peak_rss_gib()
    return float(ms.runtime.max_memory_allocated()) / measure.GIB


def run(trial: dict[str, Any], plan: dict[str, Any], distributed: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    t_start = time.perf_counter()
    applied_env = prepare_env(plan)
    import numpy as np

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from model import Llama, apply_recompute  # noqa: E402 (this folder is on sys.path: run as a script)

    device = DEVICES.get(plan["accelerator"], "CPU")
    if device == "CPU":
        ms.set_device("CPU")
    else:  # msrun and Ray make the trial's devices visible; the local rank picks one of them
        ms.set_device(device, int(os.environ.get("DEVICE_ID", os.environ.get("LOCAL_RANK", "0"))))
    ms.set_context(
        mode=ms.GRAPH_MODE if plan["mode"] == "graph" else ms.PYNATIVE_MODE, jit_config={"jit_level": plan["jit_level"]}
    )
    rank, world = 0, 1
    if distributed:
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank, world = get_rank(), get_group_size()
        ms.set_auto_parallel_context(
            parallel_mode=ms.ParallelMode.DATA_PARALLEL,
            gradients_mean=True,
            enable_parallel_optimizer=plan["zero_stage"] >= 1,
        )
    if world != plan["dp"]:
        raise ProbeFailure("invalid", f"dp={plan['dp']} but the group has {world} processes", collective=True)

    t_build = time.perf_counter()
    net = Llama(trial["model"], plan["seq_len"], seed=0)
    notes = list(plan["notes"]) + [apply_recompute(net, plan["recompute"])]
    if plan["zero_stage"] and world > 1:
        notes.append(f"optimizer states sharded over {world} ranks (parallel optimizer)")
    scaler = None
    if plan["precision"] in ("fp16", "bf16"):
        dtype = ms.float16 if plan["precision"] == "fp16" else ms.bfloat16
        net = ms.amp.auto_mixed_precision(net, "O2", dtype=dtype)
        notes.append(f"auto mixed precision O2 ({plan['precision']})")
        if plan["precision"] == "fp16":
            scaler = ms.amp.DynamicLossScaler(scale_value=2.0**16, scale_factor=2, scale_window=1000)
            notes.append("dynamic loss scaling from 2^16")
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-4, weight_decay=0.01)
    reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True) if world > 1 else None

    def forward(tokens, labels, nan_scale):
        logits = net(tokens).astype(ms.float32)
        loss = ops.cross_entropy(logits, labels.reshape(-1)) * nan_scale
        return scaler.scale(loss) if scaler is not None else loss

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    def micro_step(tokens, labels, nan_scale):
        return grad_fn(tokens, labels, nan_scale)

    if plan["mode"] == "graph":
        micro_step = ms.jit(micro_step, jit_level=plan["jit_level"])
    time_build = time.perf_counter() - t_build

    rng = np.random.default_rng(1234 + rank)
    vocab = int(trial["model"]["vocab_size"])
    mbs, ga, seq = plan["micro_batch_size"], plan["grad_accum"], plan["seq_len"]
    tokens_per_step = plan["global_batch_size"] * seq
    limit = measure.memory_limit_gib()
    one, nan = Tensor(1.0, ms.float32), Tensor(float("nan"), ms.float32)
    times: list[float] = []
    phase_time = {"warmup": 0.0, "measure": 0.0}
    n_steps = plan["warmup_steps"] + plan["measured_steps"]
    loss_value = float("nan")
    for i in range(n_steps):
        phase = "warmup" if i < plan["warmup_steps"] else "measure"
        batches = [
            (Tensor(rng.integers(0, vocab, (mbs, seq)), ms.int32), Tensor(rng.integers(0, vocab, (mbs, seq)), ms.int32))
            for _ in range(ga)
        ]
        scale = nan if i == plan["inject_nan_at_step"] else one
        s0 = time.perf_counter()
        total = None
        grads_sum = None
        for tokens, labels in batches:
            loss, grads = micro_step(tokens, labels, scale)
            total = loss if total is None else total + loss
            grads_sum = grads if grads_sum is None else tuple(a + b for a, b in zip(grads_sum, grads))
        if ga > 1:
            grads_sum = tuple(g / ga for g in grads_sum)
            total = total / ga
        if reducer is not None:
            grads_sum = reducer(grads_sum)
        if scaler is not None:
            total = scaler.unscale(total)
            grads_sum = scaler.unscale(grads_sum)
            finite = ms.amp.all_finite(grads_sum)
            scaler.adjust(finite)
            if bool(finite.asnumpy()):
                optimizer(grads_sum)
        else:
            optimizer(grads_sum)
        loss_value = float(total.asnumpy())  # waits for the step (a device sync)
        if device != "CPU":
            ms.runtime.synchronize()
        dt = time.perf_counter() - s0
        phase_time[phase] += dt
        if phase == "measure":
            times.append(dt)
        mem = _peak_memory_gib(ms, device)
        failures.report_step(measure.emit if rank == 0 else None, i, phase, dt, tokens_per_step, loss_value, mem)
        if limit is not None and mem > limit:
            raise ProbeFailure(
                "oom",
                f"rank {rank}: peak memory {mem:.3f} GiB above the limit {limit:.3f} GiB "
                f"(AUTOTUNE_MEMORY_LIMIT_GIB) at step {i}",
            )

    metrics = measure.summarize_times(times)
    med = metrics["step_time_s"]
    metrics.update(
        tokens_per_s=tokens_per_step / med,
        tokens_per_s_per_device=tokens_per_step / med / world,
        samples_per_s=plan["global_batch_size"] / med,
        loss=loss_value,
        loss_finite=1.0,
        peak_memory_gib=_peak_memory_gib(ms, device),
        time_warmup_s=phase_time["warmup"],
        time_measure_s=phase_time["measure"],
        time_model_build_s=time_build,
        time_init_s=t_build - t_start,
    )
    peak = (trial.get("cluster", {}).get("hardware") or {}).get("peak_tflops", {}).get(plan["precision"])
    if peak:
        layers, h = int(trial["model"]["num_hidden_layers"]), int(trial["model"]["hidden_size"])
        params = 12 * layers * h * h + 2 * int(trial["model"]["vocab_size"]) * h  # dense-equivalent, as 6N
        metrics["mfu"] = 6.0 * params * metrics["tokens_per_s_per_device"] / (float(peak) * 1e12)
    info = {
        "software": _software(ms),
        "device": device,
        "mode": plan["mode"],
        "jit_level": plan["jit_level"],
        "env": applied_env,
        "plan_notes": notes,
        # the protocol's PEAK_COUNTS_KEY (this script runs without autotune installed): on a device
        # the peak is MindSpore's max_memory_allocated, on the CPU the process's peak RSS
        "peak_memory_counts": "device" if device == "CPU" else "allocated",
    }
    return metrics, info


def _readable(exc: BaseException) -> BaseException:
    """MindSpore's errors start with a rule of dashes and a C++ stack banner: lead with the first
    line that says something, so the failure reason is that line."""
    if isinstance(exc, ProbeFailure):
        return exc
    lines = [ln.strip() for ln in str(exc).splitlines()]
    useful = [ln for ln in lines if ln and not set(ln) <= set("-= ") and not ln.startswith("- C++ Call Stack")]
    if not useful or useful[0] == lines[0] or not isinstance(exc, Exception):
        return exc
    try:
        return type(exc)("\n".join(useful))
    except Exception:  # an exception class that takes other arguments: keep it as it is
        return exc


def _serve_as_scheduler() -> int:
    """msrun runs this script once more as its scheduler: join the cluster, print nothing."""
    from mindspore.communication import init

    try:
        init()
    except RuntimeError as exc:  # a worker died: the worker reports why, not the scheduler
        print(f"msrun scheduler: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return _serve_as_scheduler()
    distributed = os.environ.get("MS_ROLE") == "MS_WORKER"  # started by msrun
    rank = int(os.environ.get("RANK_ID") or os.environ.get("MS_NODE_ID") or 0) if distributed else 0
    try:
        path = argv[0] if argv else os.environ.get("AUTOTUNE_TRIAL_FILE")
        if not path:
            raise ProbeFailure("invalid", "usage: python probe.py TRIAL_FILE (or set AUTOTUNE_TRIAL_FILE)")
        trial = json.loads(Path(path).read_text())
        world = int(os.environ.get("MS_WORKER_NUM", "1")) if distributed else 1
        plan = resolve_plan(trial, world)
        metrics, info = run(trial, plan, distributed)
    except BaseException as exc:  # noqa: BLE001 - every failure must become a protocol line
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        status, reason, report = failures.classify_exception(_readable(exc), rank)
        if report and (rank == 0 or not getattr(exc, "collective", False)):
            measure.emit({"event": "failure", "status": status, "reason": reason})
        if not isinstance(exc, ProbeFailure):
            import traceback

            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        return failures.EXIT_CODES[status]
    if rank == 0:
        measure.emit({"metrics": metrics, "info": info})
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("MS_ROLE"):
        sys.exit(code)  # under msrun: a normal exit, so the scheduler sees this worker finish
    os._exit(code)  # alone: skip teardown, nothing to wait for
