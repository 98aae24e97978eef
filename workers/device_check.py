"""The device check: how much memory a probe's allocator can use on one device, measured before a
study's first probe (issue 41: the stacks' logs never say it, and a guide that believes the nominal
capacity walks into the wall).

``python -m autotune.workers.device_check --accelerator npu`` starts the runtime the way the torch
probe does (``_device.setup_device``: ``import torch_npu``, the device bound, the trial's allocator
environment already in ``os.environ``), allocates a small tensor so the runtime's context exists,
then reads ``mem_get_info``: free memory plus what the caching allocator holds is what a probe's
allocator could use (the torch probe reports the same figure as ``usable_memory_gib``). On the CPU
the "device" is the host: its available memory, capped by the probe's soft limit
``AUTOTUNE_MEMORY_LIMIT_GIB``. Prints one JSON line. Imports no Optuna, Ray or MLflow: it runs where
probes run.

MindSpore: its runtime exposes no free-memory query before a graph runs (``ms.runtime`` reports the
pool's peak, not the device's free memory), so a MindSpore study learns the usable memory from its
probes' out-of-memory messages instead; the check says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

GIB = 2**30

__all__ = ["measure", "main"]


def _host_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (what the kernel could give a new process), in GiB."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024 / GIB
    except OSError:
        return None
    return None


def measure(accelerator: str) -> dict[str, Any]:
    """``{usable_memory_gib, total_memory_gib, how}`` of one device of ``accelerator`` (cpu, cuda,
    npu), or ``{error}`` saying why it could not be measured."""
    if accelerator == "cpu":
        from .torch_probe import measure as probe_measure

        available = _host_available_gib()
        limit = probe_measure.memory_limit_gib()
        total = None
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        except (ValueError, OSError, AttributeError):
            pass
        candidates = [v for v in (available, limit) if v is not None]
        if not candidates:
            return {"error": "neither /proc/meminfo nor AUTOTUNE_MEMORY_LIMIT_GIB says the host's memory"}
        how = "the host's available memory (/proc/meminfo MemAvailable)"
        if limit is not None and (available is None or limit <= available):
            how = "the probes' soft limit AUTOTUNE_MEMORY_LIMIT_GIB"
        return {"usable_memory_gib": round(min(candidates), 4), "total_memory_gib": total, "how": how}
    if accelerator == "mindspore":
        return {"error": "MindSpore exposes no free-memory query before a graph runs"}
    try:
        import torch

        from .torch_probe._device import device_module, setup_device

        info = setup_device(accelerator, 0)
        mod = device_module(accelerator)
        torch.ones(1, device=info.name)  # the runtime's context exists from here on
        mod.synchronize()
        free, total = mod.mem_get_info(info.index or 0)
        reserved = mod.memory_reserved(info.index or 0)
    except Exception as exc:  # no device, no extension: the caller says why and goes on without
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "usable_memory_gib": round((free + reserved) / GIB, 4),
        "total_memory_gib": round(total / GIB, 4),
        "how": f"{accelerator} mem_get_info after the runtime started (free + the allocator's reserve)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.workers.device_check")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda", "npu", "mindspore"))
    args = parser.parse_args(argv)
    out = measure(args.accelerator)
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
