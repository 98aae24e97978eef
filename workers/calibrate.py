"""Measure this host's device and write a hardware profile the simulator can use.

    autotune calibrate --accelerator cpu --out my_host.yaml      (or python -m autotune.workers.calibrate)

The bundled profiles hold data-sheet figures; a machine in front of the user may differ a lot
(a CPU without native bf16 runs bf16 matmuls 10-50x slower than fp32; a 910B variant clocks
differently). Calibration measures what the simulator's formulas take as inputs:

- **GEMM**: square matmuls of growing size per precision, device-synchronised, median of
  repeats. ``peak_tflops[dtype]`` becomes the sustained rate of the largest size (the plateau),
  and ``gemm_half_dim`` is fitted to the smaller sizes through the simulator's efficiency curve
  ``rate(d) = plateau * (d / (d + half))^3`` (``gemm_efficiency`` is then 1: the peaks are
  already what the device sustains, so MFU against this profile is MFU against the measured
  plateau, which the file's header says).
- **memory bandwidth**: a large device-to-device copy (read + write bytes / time).
- **collectives**: all-reduce and all-gather bus bandwidth between ``--ranks`` processes with the
  device's backend (gloo on the CPU), as ``nccl-tests`` defines bus bandwidth.

Every other figure is taken from the base profile of the accelerator. The measurements go into the
file's header comments, so the profile says where its numbers came from. Device-agnostic: the
device is looked up once (cpu, cuda, npu via torch_npu) and timing synchronises it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from .hardware import load_profile
from .torch_probe._device import ACCELERATORS, device_module, device_name, setup_device, software_versions

__all__ = ["calibrate", "write_profile", "fit_half_dim"]

DTYPES = ("fp32", "bf16", "fp16")
BASE_PROFILE = {"cpu": "cpu", "cuda": "a100-sxm-80gb", "npu": "ascend-910b"}
SIZES = {"cpu": (128, 256, 512, 1024), "cuda": (1024, 2048, 4096, 8192), "npu": (1024, 2048, 4096, 8192)}
QUICK_SIZES = {"cpu": (64, 128, 256), "cuda": (512, 1024, 2048), "npu": (512, 1024, 2048)}


# ------------------------------------------------------------------------------------- device
def _device(accelerator: str, local_rank: int = 0) -> tuple[Any, Any, Callable[[], None]]:
    """(torch, device, synchronize): the torch probe's own device lookup (extension loaded,
    device bound), so calibration measures the device exactly as a probe drives it."""
    import torch

    if accelerator == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("calibrate --accelerator cuda: no CUDA device is visible")
    info = setup_device(accelerator, local_rank)
    return torch, torch.device(info.name), device_module(accelerator).synchronize


def _timed(fn: Callable[[], Any], sync: Callable[[], None], min_time_s: float, repeats: int) -> float:
    """Median seconds per call: warm-up, then ``repeats`` batches of calls lasting >= min_time_s."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(min_time_s / once))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------- measurements
def measure_gemm(accelerator: str, sizes: tuple[int, ...], min_time_s: float, repeats: int) -> dict[str, dict[int, float]]:
    """TFLOPS of a d x d x d matmul per precision and size."""
    torch, device, sync = _device(accelerator)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    out: dict[str, dict[int, float]] = {}
    for name in DTYPES:
        out[name] = {}
        for d in sizes:
            a = torch.randn(d, d, device=device).to(dtypes[name])
            b = torch.randn(d, d, device=device).to(dtypes[name])
            seconds = _timed(lambda: torch.mm(a, b), sync, min_time_s, repeats)
            out[name][d] = 2.0 * d ** 3 / seconds / 1e12
    return out


def measure_memory_bandwidth(accelerator: str, mib: int, min_time_s: float, repeats: int) -> float:
    """GB/s of a device copy (bytes read + bytes written)."""
    torch, device, sync = _device(accelerator)
    n = mib * 2 ** 20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), sync, min_time_s, repeats)
    return 2 * n * 4 / seconds / 1e9


def _collective_worker(rank: int, world: int, accelerator: str, store_path: str, mib: int, repeats: int,
                       result_path: str) -> None:
    """One rank of the collective measurement (run by torch.multiprocessing)."""
    torch, device, sync = _device(accelerator, local_rank=rank)
    import torch.distributed as dist

    dist.init_process_group(ACCELERATORS[accelerator].backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    try:
        n = mib * 2 ** 20 // 4
        x = torch.ones(n, dtype=torch.float32, device=device)
        gathered = torch.empty(n * world, dtype=torch.float32, device=device)
        shard = torch.ones(n // world, dtype=torch.float32, device=device)
        # all_gather_single replaces all_gather_into_tensor from torch 2.13; NPU stacks run older torch
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        ops = {"allreduce": lambda: dist.all_reduce(x),
               "allgather": lambda: gather(gathered[: (n // world) * world], shard)}
        result: dict[str, float] = {}
        for name, op in ops.items():
            op()
            sync()
            dist.barrier()
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                op()
                sync()
                samples.append(time.perf_counter() - t0)
            seconds = statistics.median(samples)
            size = n * 4
            # nccl-tests' bus bandwidth: what each link carries, comparable across world sizes
            factor = 2 * (world - 1) / world if name == "allreduce" else (world - 1) / world
            result[name] = size * factor / seconds / 1e9
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_collectives(accelerator: str, ranks: int, mib: int, repeats: int) -> dict[str, float]:
    """Bus bandwidth (GB/s) of all-reduce and all-gather between ``ranks`` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.start_processes(_collective_worker, args=(ranks, accelerator, os.path.join(tmp, "store"), mib, repeats,
                                                     result_path), nprocs=ranks, start_method="spawn")
        return json.loads(Path(result_path).read_text())


# ------------------------------------------------------------------------------------------- fit
def fit_half_dim(rates: dict[int, float]) -> float:
    """``half`` of ``rate(d) = plateau * (d / (d + half))^3`` (the simulator's GEMM efficiency
    curve for a d x d x d GEMM), least squares in log space over a grid; plateau = the largest
    size's rate scaled up by its own efficiency."""
    sizes = sorted(rates)
    best, best_err = 0.0, math.inf
    for half in [0.0] + [2 ** (k / 8) for k in range(0, 8 * 14)]:  # 1 .. 16k
        eff = {d: (d / (d + half)) ** 3 for d in sizes}
        plateau = rates[sizes[-1]] / eff[sizes[-1]]
        err = sum((math.log(rates[d]) - math.log(plateau * eff[d])) ** 2 for d in sizes)
        if err < best_err:
            best, best_err = half, err
    return round(best, 2)


def calibrate(accelerator: str, *, quick: bool = False, ranks: int = 2, threads: int | None = None,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Measure and return ``{"profile": ..., "measured": ...}`` (the profile ready to write).

    On the CPU one "device" is one probe process: ``threads`` (default: cores / ranks, what the
    torch probe gives each rank) is the intra-op thread count the GEMMs and the copy run with."""
    if accelerator not in BASE_PROFILE:
        raise ValueError(f"accelerator must be one of {', '.join(BASE_PROFILE)}, got {accelerator!r}")
    if accelerator == "cpu":
        import torch

        threads = threads or max(1, (os.cpu_count() or 1) // max(1, ranks))
        torch.set_num_threads(threads)
    sizes = (QUICK_SIZES if quick else SIZES)[accelerator]
    min_time, repeats = (0.02, 3) if quick else (0.2, 5)
    progress(f"GEMM {', '.join(DTYPES)} at sizes {', '.join(map(str, sizes))}")
    gemm = measure_gemm(accelerator, sizes, min_time, repeats)
    progress("memory bandwidth (device copy)")
    bandwidth = measure_memory_bandwidth(accelerator, 64 if quick else 512, min_time, repeats)
    collectives: dict[str, float] = {}
    if ranks > 1:
        progress(f"all-reduce / all-gather between {ranks} processes")
        collectives = measure_collectives(accelerator, ranks, 4 if quick else 64, repeats)

    profile = load_profile(BASE_PROFILE[accelerator])
    largest = max(sizes)
    half = fit_half_dim(gemm["fp32"])
    profile["name"] = f"calibrated-{platform.node() or accelerator}"
    name = device_name(accelerator, device_module(accelerator))  # the device measure_gemm bound
    profile["description"] = (f"calibrated on {platform.node()} ({name}) "
                              f"{_dt.date.today().isoformat()}")
    # plateau per precision: the largest size's rate scaled by the fitted curve
    eff = (largest / (largest + half)) ** 3
    profile["peak_tflops"] = {**profile["peak_tflops"],
                              **{k: round(gemm[k][largest] / eff, 4) for k in DTYPES}}
    profile["gemm_efficiency"] = 1.0
    profile["gemm_half_dim"] = half
    profile["memory_bandwidth_gbps"] = round(bandwidth, 2)
    profile["memory_bandwidth_efficiency"] = 1.0
    if collectives:
        profile["intra_node_bandwidth_gbps"] = round(collectives["allreduce"], 3)
        profile["allreduce_efficiency"] = 1.0
        profile["allgather_efficiency"] = min(1.0, round(collectives["allgather"] / collectives["allreduce"], 3))
    measured = {"gemm_tflops": gemm, "memory_bandwidth_gbps": bandwidth, "collective_busbw_gbps": collectives,
                "sizes": list(sizes), "quick": quick, "ranks": ranks, "threads_per_device": threads,
                "software": {**software_versions(accelerator), "python": platform.python_version()}}
    return {"profile": profile, "measured": measured}


def write_profile(result: dict[str, Any], path: Path) -> Path:
    """The profile as YAML with the raw measurements in its header comments."""
    m = result["measured"]
    lines = [
        f"# Hardware profile written by `autotune calibrate` on {_dt.datetime.now().isoformat(timespec='seconds')}.",
        "# peak_tflops are the sustained matmul rates measured here (gemm_efficiency 1), not data-sheet",
        "# peaks: MFU against this profile is MFU against what this device sustains.",
        f"# software: {json.dumps(m['software'])}; threads per device: {m['threads_per_device'] or 'all'}",
        "# GEMM TFLOPS measured (d x d x d): " + "; ".join(
            f"{k} " + ", ".join(f"{d}:{v:.4g}" for d, v in rates.items()) for k, rates in m["gemm_tflops"].items()),
        f"# device copy: {m['memory_bandwidth_gbps']:.1f} GB/s; collective bus bandwidth (GB/s): "
        f"{json.dumps({k: round(v, 3) for k, v in m['collective_busbw_gbps'].items()}) or 'not measured'}",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(result["profile"], sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accelerator", choices=tuple(BASE_PROFILE), default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="CPU: threads per device (default cores / ranks)")
    args = ap.parse_args(argv)
    result = calibrate(args.accelerator, quick=args.quick, ranks=args.ranks, threads=args.threads,
                       progress=lambda text: print(text, file=sys.stderr))
    print(write_profile(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
