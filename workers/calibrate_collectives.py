"""The collectives of a calibration: all-reduce, all-gather and a point-to-point hop between ranks,
and the tensor-parallel layer step in context, fitted to the simulator's collective model.

Split from :mod:`.calibrate` (the GEMM and bandwidth measurements and the profile writer) because
it is the part that runs in other processes: ``measure_collectives`` spawns one process per rank
(torch.multiprocessing, the device's backend: gloo on the CPU) running ``_collective_worker``.
``calibration_device`` is the device lookup both share (the torch probe's own).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .calibrate_layer import measure_tp_layer
from .torch_probe._device import ACCELERATORS, device_module, setup_device

__all__ = ["calibration_device", "measure_collectives", "fit_latency_bandwidth", "time_collectives"]


def calibration_device(accelerator: str, local_rank: int = 0) -> tuple[Any, Any, Callable[[], None]]:
    """(torch, device, synchronize): the torch probe's own device lookup (extension loaded,
    device bound), so calibration measures the device exactly as a probe drives it."""
    import torch

    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("calibrate --accelerator cuda: no CUDA device is visible")
    info = setup_device(accelerator, local_rank)
    return torch, torch.device(info.name), device_module(accelerator).synchronize


def _collective_worker(
    rank: int,
    world: int,
    accelerator: str,
    store_path: str,
    sizes_kib: list[int],
    repeats: int,
    result_path: str,
    quick: bool = False,
) -> None:
    """One rank of the collective measurement (run by torch.multiprocessing): all-reduce,
    all-gather and a point-to-point exchange (a pipeline stage's send/recv) at each message size,
    then a tensor-parallel layer step in context (``calibrate_layer``)."""
    torch, device, sync = calibration_device(accelerator, local_rank=rank)
    import torch.distributed as dist

    dist.init_process_group(
        ACCELERATORS[accelerator].backend, init_method=f"file://{store_path}", rank=rank, world_size=world
    )
    try:
        result = time_collectives(torch, dist, device, sync, rank, world, sizes_kib, repeats)
        tp_layer = measure_tp_layer(accelerator, device, sync, world, repeats, quick=quick)
        if rank == 0:
            Path(result_path).write_text(json.dumps({**result, "tp_layer": tp_layer}))
    finally:
        dist.destroy_process_group()
    # Measured and written: skip the interpreter's teardown, as the torch probe does. gloo's threads can
    # abort in static destructors ("terminate called without an active exception"; a rank of a CI run's
    # quick calibration did, 2026-12-01, after the figures were written), and torch.multiprocessing
    # would report the whole measurement as a crash. A failure above still raises, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def time_collectives(
    torch: Any,
    dist: Any,
    device: Any,
    sync: Callable[[], None],
    rank: int,
    world: int,
    sizes_kib: list[int],
    repeats: int,
    names: tuple[str, ...] = ("allreduce", "allgather", "p2p"),
) -> dict[str, dict[int, float]]:
    """Seconds of one all-reduce, all-gather (of the full, gathered buffer) and point-to-point hop
    (those of ``names``) per message size in bytes, on an initialised process group of ``world``
    ranks (this one is ``rank``); every rank runs it. Used by the host's calibration and by the
    measurement across nodes (:mod:`.calibrate_nodes`)."""
    # all_gather_single replaces all_gather_into_tensor from torch 2.13; NPU stacks run older torch
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    peer = rank ^ 1 if (rank ^ 1) < world else rank

    def exchange(buf: Any, recv: Any) -> None:
        if peer == rank:
            return
        if rank % 2 == 0:  # rank 0 sends, rank 1 receives, then back: one hop each way
            dist.send(buf, peer)
            dist.recv(recv, peer)
        else:
            dist.recv(recv, peer)
            dist.send(buf, peer)

    result: dict[str, dict[int, float]] = {name: {} for name in names}
    for kib in sizes_kib:
        n = max(world, kib * 1024 // 4)
        x = torch.ones(n, dtype=torch.float32, device=device)
        gathered = torch.empty((n // world) * world, dtype=torch.float32, device=device)
        shard = torch.ones(n // world, dtype=torch.float32, device=device)
        recv = torch.empty_like(x)
        ops = {
            "allreduce": lambda: dist.all_reduce(x),
            "allgather": lambda: gather(gathered, shard),
            "p2p": lambda: exchange(x, recv),
        }
        # Batches of back-to-back calls after a barrier, as nccl-tests times: one call's sample
        # absorbs whichever rank the scheduler ran late (a 4 KiB all-reduce read 4 ms on two
        # busy cores, longer than 1 MiB), a batch spreads that skew over its calls. Every rank
        # derives the same count from the size, so the collectives pair up.
        calls = max(4, min(32, (4 << 20) // (n * 4)))
        for name in names:
            op = ops[name]
            op()
            op()
            sync()
            samples = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    op()
                sync()
                samples.append((time.perf_counter() - t0) / calls)
            seconds = statistics.median(samples)
            result[name][n * 4] = seconds / (2.0 if name == "p2p" else 1.0)  # p2p: one hop
    return result


def measure_collectives(
    accelerator: str, ranks: int, sizes_kib: tuple[int, ...], repeats: int, quick: bool = False
) -> tuple[dict[str, dict[int, float]], dict[str, Any]]:
    """Seconds of all-reduce, all-gather (of the full, gathered buffer) and one point-to-point hop
    between ``ranks`` processes, per message size in bytes: from the sizes tensor parallelism sends
    per layer up to gradient buckets, so the fit sees both the latency and the bandwidth; and the
    tensor-parallel layer step over the same ranks (``calibrate_layer.measure_tp_layer``)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(
            _collective_worker,
            args=(ranks, accelerator, os.path.join(tmp, "store"), list(sizes_kib), repeats, result_path, quick),
            nprocs=ranks,
            start_method="spawn",
        )
        raw = json.loads(Path(result_path).read_text())
        tp_layer = raw.pop("tp_layer")
        return {name: {int(k): v for k, v in times.items()} for name, times in raw.items()}, tp_layer


def fit_latency_bandwidth(times: dict[int, float], factor: float) -> tuple[float, float]:
    """(latency s, bus bandwidth bytes/s) of ``t(n) = latency + factor * n / bandwidth``, the
    simulator's collective model (``factor`` is the ring's share of the buffer each link carries:
    2(g-1)/g for all-reduce, (g-1)/g for all-gather, 1 for a send). Least squares on the relative
    error, so the small messages (where latency rules) count as much as the large ones."""
    sizes = np.array(sorted(times), dtype=float)
    t = np.array([times[int(n)] for n in sizes])
    design = np.stack([np.ones_like(sizes), factor * sizes], axis=1) / t[:, None]
    (latency, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inv_bw <= 0:  # no size effect measured: all latency, bandwidth from the largest message
        inv_bw = max(t[-1] - max(latency, 0.0), 1e-12) / (factor * sizes[-1])
    if latency < 0:  # bandwidth explains everything: refit through the origin
        latency, inv_bw = 0.0, float(np.median(t / (factor * sizes)))
    return float(latency), float(1.0 / inv_bw)
