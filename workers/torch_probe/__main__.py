"""Entry point: ``torchrun --nproc-per-node N -m autotune.workers.torch_probe TRIAL_FILE``.

Order is the point of this module: read the trial file and put its ``env.*`` settings into the
environment *before* torch is imported (allocator settings are read once, at start), then pick
the device, set the threads, join the process group, resolve and validate the plan, and run the
train or infer probe. Rank 0 prints the protocol lines; any failure becomes one
``{"event": "failure", ...}`` line and a non-zero exit (see failures.py for who reports).
The trial path comes from argv or ``AUTOTUNE_TRIAL_FILE``; without torchrun's variables the probe
runs as a single process.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from ..protocol import PEAK_COUNTS_KEY, TRIAL_FILE_ENV, USABLE_KEY, read_trial_file
from . import measure
from ._device import (
    accelerator_of,
    device_module,
    device_name,
    prepare_env,
    setup_device,
    software_versions,
    threads_per_rank,
)
from .failures import EXIT_CODES, ProbeFailure, classify_exception
from .plan import ModelConfig, resolve_plan
from .spawn import DIST_INIT_ENV

log = logging.getLogger("autotune.torch_probe")
_COLLECTIVE_EXIT_DELAY_S = 2.0


def _setup_logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[torch_probe rank {rank}] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def _run(path: str, rank: int, local_rank: int, world: int, local_world: int) -> dict[str, Any]:
    request = read_trial_file(path)
    kind = accelerator_of(request.cluster)
    applied_env = prepare_env(request.env(), kind)  # before torch is imported
    plan = resolve_plan(request, world, dict(os.environ))  # an invalid config fails before torch starts
    cfg = ModelConfig.from_dict(request.model)

    t_start = measure.now()
    import datetime

    import torch
    import torch.distributed as dist

    dev = setup_device(kind, local_rank)
    devmod = device_module(kind)
    threads = threads_per_rank(request.cluster, local_world)
    torch.set_num_threads(threads)
    device = torch.device(dev.name)

    for note in plan.notes:
        log.info("plan: %s", note)

    limit = measure.memory_limit_gib()
    if limit is not None and kind != "cpu":
        # A real allocator limit on devices: the OOM comes from the allocator, with the size.
        total = devmod.get_device_properties(dev.index).total_memory / measure.GIB
        devmod.set_per_process_memory_fraction(min(1.0, limit / total), dev.index)

    timeout = datetime.timedelta(seconds=max(120.0, float(request.workload.get("timeout_s", 600))))
    if "RANK" in os.environ:
        # torchrun: env:// rendezvous; spawn.py: a file store in its private temp dir
        store_file = os.environ.get(DIST_INIT_ENV)
        dist.init_process_group(
            dev.backend,
            init_method=f"file://{store_file}" if store_file else None,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if kind != "cpu" else None,
        )
    else:  # single process without torchrun: an in-memory store, no ports
        dist.init_process_group(dev.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    from .parallelize import build_mesh
    from .train import Runtime, run_train

    mesh = build_mesh(plan, kind)
    hardware = request.cluster.get("hardware") or {}
    rt = Runtime(
        plan=plan,
        cfg=cfg,
        rank=rank,
        world_size=world,
        device=device,
        device_kind=kind,
        device_index=dev.index,
        devmod=devmod,
        mesh=mesh,
        model_dict=dict(request.model),
        peak_tflops={k: float(v) for k, v in (hardware.get("peak_tflops") or {}).items() if v},
        memory_limit_gib=limit if kind == "cpu" else None,
        artifact_dir=os.environ.get("AUTOTUNE_ARTIFACT_DIR") or None,
    )
    # start-up = everything before the model build: interpreter, imports, process group, mesh
    age = measure.process_age_s()
    rt.timings["time_init_s"] = measure.now() - t_start  # the torch import + init part of it
    if age is not None:
        rt.timings["time_startup_s"] = age
    log.info(
        "plan: tp=%d pp=%d dp=%d cp=%d vpp=%d mbs=%d ga=%d sp=%s recompute=%s zero=%d %s compile=%s "
        "threads/rank=%d device=%s",
        plan.tp,
        plan.pp,
        plan.dp,
        plan.cp,
        plan.vpp,
        plan.micro_batch_size,
        plan.grad_accum,
        plan.sequence_parallel,
        plan.recompute,
        plan.zero_stage,
        plan.precision,
        plan.compile,
        threads,
        dev.name,
    )
    if plan.kind == "train":
        metrics = run_train(rt)
    else:
        from .infer import run_infer

        metrics = run_infer(rt)
    info = {
        "software": software_versions(kind),
        "device": device_name(kind, devmod),
        "threads_per_rank": threads,
        "env": applied_env,
        "plan_notes": plan.notes,
        # on a device the peak is torch's max_memory_allocated (the reserved one beside it); on the
        # cpu the process's peak RSS, everything it held
        PEAK_COUNTS_KEY: "device" if kind == "cpu" else "allocated",
    }
    if plan.kind == "train" and rt.usable_gib is not None:
        info[USABLE_KEY] = rt.usable_gib
    if plan.kind == "train" and len(rt.peak_by_rank) == world:
        # the mesh is (pp, dp, cp, tp) over ranks 0..world-1 in order: a rank's stage is its
        # row; a stage's peak is its worst rank's (what a memory profile fits per stage)
        per_stage = world // plan.pp
        info["peak_memory_gib_by_stage"] = [
            max(rt.peak_by_rank[s * per_stage : (s + 1) * per_stage]) for s in range(plan.pp)
        ]
    dist.destroy_process_group()
    return {"metrics": metrics, "info": info}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    _setup_logging(rank)
    try:
        path = argv[0] if argv else os.environ.get(TRIAL_FILE_ENV)
        if not path:
            raise ProbeFailure(
                "invalid", f"usage: python -m autotune.workers.torch_probe TRIAL_FILE (or set {TRIAL_FILE_ENV})"
            )
        result = _run(path, rank, local_rank, world, local_world)
    except BaseException as exc:  # noqa: BLE001 - every failure must become a protocol line
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        status, reason, report = classify_exception(exc, rank)
        collective = getattr(exc, "collective", False) or status == "invalid"
        if report and (rank == 0 or not collective):
            measure.emit({"event": "failure", "status": status, "reason": reason})
        if not isinstance(exc, ProbeFailure):
            log.error("probe failed", exc_info=exc)
        else:
            log.warning("probe failed: %s: %s", status, reason)
        sys.stdout.flush()
        sys.stderr.flush()
        if collective and rank != 0:
            # Every rank found this failure at the same moment; give rank 0 time to print its
            # line before our exit makes torchrun tear the group down (rank 0 included).
            time.sleep(_COLLECTIVE_EXIT_DELAY_S)
        return EXIT_CODES[status]
    if rank == 0:
        measure.emit(result)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The answer is out (or the failure line is). Skip interpreter teardown: a process group
    # with a dead peer can hang in its destructor, and gloo's/FSDP's background threads can
    # abort in static destructors ("terminate called without an active exception"), which
    # would turn a measured trial into a crash.
    os._exit(code)
