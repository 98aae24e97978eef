"""Timing, statistics, memory and communication share: how the probe measures (nanoGPT bench.py style).

Warm-up steps are run and discarded (allocator growth, autotuning, compile), measured steps are
timed between device synchronisations, and the answer is the median with its p10–p90 spread: on
shared CPUs identical runs differ by up to ±30 %, so one number is never trusted and the
driver can re-measure close calls. Statistics are plain Python (no numpy needed on workers).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import time
from typing import Any, Callable

__all__ = [
    "emit",
    "median",
    "percentile",
    "summarize_times",
    "peak_rss_gib",
    "process_age_s",
    "comm_fraction",
    "COMM_PATTERN",
    "peak_allocated_bytes",
    "memory_limit_gib",
]

GIB = float(1 << 30)

# Op/kernel names of collectives in profiler traces: c10d ops (send/recv of the pipeline
# included), gloo/nccl/hccl work and kernels, functional collectives (FSDP2 and TP use those).
# Not plain "broadcast": aten::broadcast_tensors is compute.
COMM_PATTERN = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|c10d::|c10d_functional|gloo:|nccl|hccl|"
    r"record_param_comms",
    re.IGNORECASE,
)


def emit(obj: dict[str, Any]) -> None:
    """One protocol line on stdout, flushed at once (the driver streams it for progress)."""
    sys.stdout.write(json.dumps(obj, default=float) + "\n")
    sys.stdout.flush()


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), ``q`` in [0, 100]."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_times(times: list[float]) -> dict[str, float]:
    med = median(times)
    p10, p90 = percentile(times, 10), percentile(times, 90)
    return {
        "step_time_s": med,
        "step_time_p10_s": p10,
        "step_time_p90_s": p90,
        "step_time_spread": (p90 - p10) / med if med > 0 else 0.0,
    }


def peak_rss_gib() -> float:
    """Peak resident set of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (GIB if sys.platform == "darwin" else GIB / 1024)


def process_age_s() -> float | None:
    """Seconds since this process was created (Linux /proc), for the start-up share of a trial."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def memory_limit_gib(environ: dict[str, str] | None = None) -> float | None:
    """The soft memory limit (``AUTOTUNE_MEMORY_LIMIT_GIB``): lets tests force an OOM, and lets a
    user emulate a smaller device on a bigger one."""
    environ = os.environ if environ is None else environ
    value = environ.get("AUTOTUNE_MEMORY_LIMIT_GIB", "").strip()
    return float(value) if value else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def comm_fraction(events: list[Any], step_start_us: float, step_end_us: float) -> tuple[float, float]:
    """``(fraction, comm_us)``: share of the step's wall time during which at least one collective
    was in flight (union over threads and streams, so communication overlapped with compute
    counts as communication time; nested op/kernel events are not double-counted).

    ``events`` are profiler events with ``name`` and ``time_range.start``/``end`` in µs.
    """
    span = step_end_us - step_start_us
    if span <= 0:
        return 0.0, 0.0
    intervals = []
    for ev in events:
        if COMM_PATTERN.search(ev.name):
            s, e = max(ev.time_range.start, step_start_us), min(ev.time_range.end, step_end_us)
            if e > s:
                intervals.append((s, e))
    comm = _union_length(intervals)
    return min(1.0, comm / span), comm


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes held by torch's allocator while ``fn`` runs, above what was live before it.

    Deterministic (unlike RSS): it replays the profiler's allocation/free records in time order.
    Used to compare recompute modes on CPU, where torch keeps no allocator statistics.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []
    for ev in prof.profiler.kineto_results.events():
        if ev.name() == "[memory]":
            records.append((ev.start_ns(), ev.nbytes()))
    live = peak = 0
    for _, nbytes in sorted(records, key=lambda r: r[0]):
        live += nbytes
        peak = max(peak, live)
    del torch
    return peak


def now() -> float:
    return time.perf_counter()
