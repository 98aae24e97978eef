"""The numbers in a framework's out-of-memory message: ``oom_evidence``.

Split from :mod:`.protocol` (the protocol's value types and the classification of a failure):
these are the readers of ten message formats, each from its framework's source (the comment above
``_TORCH_FIELDS``; tests/test_oom_messages.py holds one golden line of each). ``protocol``
re-exports ``oom_evidence``. Standard library only: it runs where probes run.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["oom_evidence"]


_SIZE = r"([\d.,]+)\s*([KMGT]?i?B|bytes)"
_UNITS = {
    "b": 1,
    "bytes": 1,
    "kb": 1e3,
    "kib": 2**10,
    "mb": 1e6,
    "mib": 2**20,
    "gb": 1e9,
    "gib": 2**30,
    "tb": 1e12,
    "tib": 2**40,
}
_GIB = 2**30
_MIB = 2**20  # MindSpore's "M" (kMBToByte = 1 << 20)

# The out-of-memory messages whose numbers ``oom_evidence`` reads, each from its framework's source
# (tests/test_oom_messages.py holds one golden line of each, tests/fixtures/oom_messages/ the source
# file and version it was built from):
#
# torch's caching allocators (c10/cuda/CUDACachingAllocator.cpp; torch_npu's NPUCachingAllocator.cpp
# and NPUWorkspaceAllocator.cpp; XPU/HIP/MUSA say it in the same words), torch >= 2.1:
#   CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which
#     1.12 GiB is free. Process 41872 has 1.50 GiB memory in use. Including non-PyTorch memory, this
#     process has 76.55 GiB memory in use. [47.51 GiB allowed; ]Of the allocated memory 71.84 GiB is
#     allocated by PyTorch, [with 6.00 GiB allocated in private pools (e.g., CUDA Graphs), ]and 3.91 GiB
#     is reserved by PyTorch but unallocated.   (torch 2.1 spelled it "total capacty of")
# torch < 2.1 and torch_npu, parenthesised:
#   NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.97 GiB total capacity; 58.12 GiB already
#     allocated; 58.12 GiB current active; 1.02 GiB free; [47.51 GiB allowed; ]59.40 GiB reserved in
#     total by PyTorch)
#   NPU out of memory. NPUWorkspaceAllocator tried to allocate 1.50 GiB(NPU 0; 60.97 GiB total
#     capacity; 0.87 GiB free).
#   CUDA out of memory. Allocation was preemptively rejected because it would exceed
#     per_process_memory_fraction limit. Requested size: 2.00 GiB
# MindSpore (bytes, and "M" for MiB):
#   Out of Memory!!! Request memory size: 1073741824B, Memory Statistic:   (Ascend memory adapter;
#   Device HBM memory size: 62432M                                          the statistics follow,
#   MindSpore Used memory size: 58196M                                      one a line; newer
#   MindSpore memory base address: 0x12c0c0000000                           versions say MOC for
#   Total Static Memory size: 20480M                                        HBM)
#   Total Dynamic memory size: 37504M
#   Dynamic memory size of this graph: 37200M
#   Out of memory!!! total[32212254720] (dynamic[0] memory pool[524288000]) malloc [32611480064] failed!
#   Device(id:0) memory isn't enough and alloc failed, kernel name: <node>, alloc size: 2147483648B.
#   Memory not enough: current free memory size[536870912] is smaller than required size[2147483648].
#   Malloc device memory failed, size[61203267584], ret[207001], Device 0 Available HBM size:65452113920
#     free size:59055800320 may be other processes occupying this card, check as: ps -ef|grep python
# vLLM's engine start-up (vllm/v1/core/kv_cache_utils.py, vllm/v1/worker/utils.py, cpu_worker.py):
#   To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed,
#     which is larger than the available KV cache memory (9.05 GiB). Based on the available memory, the
#     estimated maximum model length is 74112. Try increasing `gpu_memory_utilization` ...
#   Free memory on device cuda:0 (15.32/79.19 GiB) on startup is less than desired GPU memory
#     utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by ...
# and torch's CUDA message inside vLLM's own ("Failed to load model - not enough GPU memory. ...
# (original error: CUDA out of memory. Tried to allocate ...)").
_TORCH_FIELDS = {
    "requested": re.compile(r"tried to allocate\s*" + _SIZE, re.IGNORECASE),
    "capacity": re.compile(r"total capaci?ty of " + _SIZE + r"|" + _SIZE + r" total capacity", re.IGNORECASE),
    "free": re.compile(r"of which " + _SIZE + r" is free|" + _SIZE + r" free\b", re.IGNORECASE),
    "allowed": re.compile(_SIZE + r" allowed\b", re.IGNORECASE),
    "allocated": re.compile(_SIZE + r" already allocated|" + _SIZE + r" is allocated by PyTorch", re.IGNORECASE),
    "reserved": re.compile(_SIZE + r" reserved in total", re.IGNORECASE),
    "unallocated": re.compile(_SIZE + r" is reserved by PyTorch but unallocated", re.IGNORECASE),
    "process_in_use": re.compile(r"this process has " + _SIZE + r" memory in use", re.IGNORECASE),
}
_TORCH_OTHER_PROCESS = re.compile(r"Process \d+ has " + _SIZE + r" memory in use", re.IGNORECASE)
_TORCH_REJECTED = re.compile(r"preemptively rejected\b.*?Requested size: " + _SIZE, re.IGNORECASE)
_MS_ADAPTER = re.compile(r"Out of Memory!!! Request memory size: (\d+)", re.IGNORECASE)
_MS_ADAPTER_STATS = {  # MiB
    "capacity": re.compile(r"Device (?:HBM|MOC) memory size: (\d+)\s*M"),
    "reserved": re.compile(r"MindSpore Used memory size: (\d+)\s*M"),
    "static": re.compile(r"Total Static Memory size: (\d+)\s*M"),
    "graph_dynamic": re.compile(r"Dynamic memory size of this graph: (\d+)\s*M"),
}
_MS_ADAPTER_LINES = 12  # the statistics' lines after the header, at most
_MS_OLD = re.compile(
    r"Out of memory!!! total\[(\d+)\]\s*\(dynamic\[(\d+)\]\s*(?:static|memory pool)\[(\d+)\]\)\s*malloc \[(\d+)\]",
    re.IGNORECASE,
)
_MS_ALLOC_FAILED = re.compile(r"memory isn't enough and alloc failed\b.*?alloc size:\s*(\d+)", re.IGNORECASE)
_MS_POOL = re.compile(r"free memory size\[(\d+)B?\] is smaller than required size\[(\d+)B?\]", re.IGNORECASE)
_MS_RTS = re.compile(
    r"Malloc device memory failed, size\[(\d+)\].*?Available HBM size:\s*(\d+)\s*free size:\s*(\d+)", re.IGNORECASE
)
_MS_RTS_HALF = re.compile(r"Device HBM total size:\s*(\d+)\s*Device HBM free size:\s*(\d+)", re.IGNORECASE)
_VLLM_KV = re.compile(
    r"max seq len \((\d+)\),\s*\(?([\d.]+) GiB KV cache is needed, which is larger than the available KV cache "
    r"memory \((-?[\d.]+) GiB\)",
    re.IGNORECASE,
)
_VLLM_ESTIMATED_LEN = re.compile(r"estimated maximum model length is (\d+)", re.IGNORECASE)
_VLLM_BUDGET = re.compile(
    r"(?:Free|Available) memory on (?:device|node)\b[^(]*\(([\d.]+)/([\d.]+) GiB\) on startup is less than "
    r"[^(]*\(([\d.]+), ([\d.]+) GiB\)",
    re.IGNORECASE,
)


def _bytes(match: re.Match) -> float | None:
    groups = [g for g in match.groups() if g is not None]
    if len(groups) < 2:
        return None
    try:
        return float(groups[0].replace(",", "")) * _UNITS[groups[1].lower()]
    except (KeyError, ValueError):
        return None


def _with_needed(found: dict[str, float], in_use: float | None) -> dict[str, float]:
    """``found`` with ``needed_at_least`` (in use + requested) where both are known."""
    if in_use is not None and "requested" in found:
        found["needed_at_least"] = in_use + found["requested"]
    return found


def _torch_allocator(lines: list[str], i: int) -> dict[str, float] | None:
    """torch's caching allocators (CUDA, torch_npu, XPU, ...), every vintage: in use is the device's
    (total capacity - free), else what the allocator holds; None without the request's size."""
    line = lines[i]
    found: dict[str, float] = {}
    for name, pattern in _TORCH_FIELDS.items():
        m = pattern.search(line)
        value = _bytes(m) if m else None
        if value is not None:
            found[name] = value / _GIB
    if "requested" not in found:
        return None
    unallocated = found.pop("unallocated", None)
    if unallocated is not None and "allocated" in found and "reserved" not in found:
        # torch >= 2.1 says reserved - allocated ("reserved by PyTorch but unallocated")
        found["reserved"] = found["allocated"] + unallocated
    others = [v for v in (_bytes(m) for m in _TORCH_OTHER_PROCESS.finditer(line)) if v is not None]
    if others:
        found["other_processes_in_use"] = sum(others) / _GIB
    in_use = None
    if "capacity" in found and "free" in found:
        in_use = found["capacity"] - found["free"]
    elif "reserved" in found or "allocated" in found:
        in_use = max(found.get("reserved", 0.0), found.get("allocated", 0.0))
    return _with_needed(found, in_use)


def _torch_rejected(lines: list[str], i: int) -> dict[str, float] | None:
    """torch's (and torch_npu's) refusal of a request past ``per_process_memory_fraction``: the size only."""
    m = _TORCH_REJECTED.search(lines[i])
    value = _bytes(m) if m else None
    return None if value is None else {"requested": value / _GIB}


def _mindspore_adapter(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore's Ascend memory adapter: the request, then its statistics a line each. MindSpore
    holds ``reserved`` ("MindSpore Used memory size": ``ms_used_hbm_size_``, 15/16 of the free memory
    or ``max_device_memory``, taken from the device once at start) and never grows it: that is the
    ``allocator_usable`` memory, and HCCL's buffers and the runtime's live beside it. In use of it is
    the static memory and this graph's dynamic memory, which with the request did not fit, so
    ``needed_at_least`` counts within the pool, as the allocator's reserve does, not the device's."""
    m = _MS_ADAPTER.search(lines[i])
    if not m:
        return None
    window = "\n".join(lines[i : i + _MS_ADAPTER_LINES])
    found = {"requested": int(m.group(1)) / _GIB}
    stats = {}
    for name, pattern in _MS_ADAPTER_STATS.items():
        s = pattern.search(window)
        if s:
            stats[name] = int(s.group(1)) * _MIB / _GIB
    for name in ("capacity", "reserved"):
        if name in stats:
            found[name] = stats[name]
    if "reserved" in stats:  # the pool, taken from the device once at start: all the allocator may use
        found["allocator_usable"] = stats["reserved"]
    if "static" in stats:
        found["allocated"] = stats["static"] + stats.get("graph_dynamic", 0.0)
    return _with_needed(found, found.get("allocated"))


def _mindspore_old(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore 1.x's memory manager: its total (``reserved`` from the device at start, all it may
    use: ``allocator_usable``), the dynamic and the static (GPU) or memory pool (Ascend) part in use,
    and the request that did not fit beside them (``needed_at_least`` within that total)."""
    m = _MS_OLD.search(lines[i])
    if not m:
        return None
    total, dynamic, other, request = (int(g) / _GIB for g in m.groups())
    found = {"requested": request, "reserved": total, "allocated": dynamic + other, "allocator_usable": total}
    return _with_needed(found, found["allocated"])


def _mindspore_alloc_failed(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore's runtime (actors, PyNative) when the pool gave nothing: the size only."""
    m = _MS_ALLOC_FAILED.search(lines[i])
    return {"requested": int(m.group(1)) / _GIB} if m else None


def _mindspore_pool(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore's memory pool and GPU allocator: what it had free (of its share) and the request."""
    m = _MS_POOL.search(lines[i])
    return {"free": int(m.group(1)) / _GIB, "requested": int(m.group(2)) / _GIB} if m else None


def _mindspore_rts(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore's Ascend adapter when the runtime refused it its share of the device at start-up:
    the share asked for, the device's total and free memory; or (less than half free) the total and
    free only. No ``needed_at_least``: what was in use then was other processes', not the config's."""
    m = _MS_RTS.search(lines[i])
    if m:
        request, capacity, free = (int(g) / _GIB for g in m.groups())
        return {"requested": request, "capacity": capacity, "free": free}
    m = _MS_RTS_HALF.search(lines[i])
    return {"capacity": int(m.group(1)) / _GIB, "free": int(m.group(2)) / _GIB} if m else None


def _vllm_kv(lines: list[str], i: int) -> dict[str, float] | None:
    """vLLM's start-up refusal of a KV cache too small for one request of ``max_model_len``: the KV
    cache needed and the KV cache memory available (after the weights and the profiled activations,
    within ``gpu_memory_utilization``), in GiB, and the token counts it names. No
    ``needed_at_least``: the message does not say what the rest of the engine holds, so it bounds no
    device memory."""
    m = _VLLM_KV.search(lines[i])
    if not m:
        return None
    found: dict[str, float] = {
        "kv_cache_needed": float(m.group(2)),
        "kv_cache_available": float(m.group(3)),
        "max_model_len": int(m.group(1)),
    }
    estimated = _VLLM_ESTIMATED_LEN.search(lines[i], m.end())
    if estimated:
        found["estimated_max_model_len"] = int(estimated.group(1))
    return found


def _vllm_budget(lines: list[str], i: int) -> dict[str, float] | None:
    """vLLM's start-up refusal when the device (the CPU backend: the NUMA node) has less free memory
    than ``gpu_memory_utilization`` of its total: free, total and the budget it asked for. No
    ``needed_at_least``: a check before anything was loaded, what was in use was other processes'."""
    m = _VLLM_BUDGET.search(lines[i])
    if not m:
        return None
    free, capacity, _fraction, budget = (float(g) for g in m.groups())
    return {"free": free, "capacity": capacity, "requested": budget}


# the torch probe's own soft limit on the CPU (workers/torch_probe: ``AUTOTUNE_MEMORY_LIMIT_GIB``, which
# tests and CPU studies use to stand in for a device's capacity):
#   out of memory: peak RSS 3.214 GiB exceeds the soft limit AUTOTUNE_MEMORY_LIMIT_GIB=3 GiB (requested 3.214 GiB)
_SOFT_LIMIT = re.compile(
    r"peak RSS ([\d.]+) GiB exceeds the soft limit AUTOTUNE_MEMORY_LIMIT_GIB=([\d.]+) GiB", re.IGNORECASE
)


def _soft_limit(lines: list[str], i: int) -> dict[str, float] | None:
    """The CPU probe's soft limit: the limit is the capacity, the peak it reached what it needed."""
    m = _SOFT_LIMIT.search(lines[i])
    if not m:
        return None
    peak, limit = float(m.group(1)), float(m.group(2))
    return {"capacity": limit, "needed_at_least": peak}


_OOM_FORMATS = (
    _soft_limit,
    _torch_allocator,
    _torch_rejected,
    _mindspore_adapter,
    _mindspore_old,
    _mindspore_alloc_failed,
    _mindspore_pool,
    _mindspore_rts,
    _vllm_kv,
    _vllm_budget,
)
_TOKEN_KEYS = ("max_model_len", "estimated_max_model_len")


def oom_evidence(output: Iterable[str] | str) -> dict[str, float] | None:
    """The numbers of the last out-of-memory message in ``output`` that gives any, in GiB: the
    ``requested`` allocation, the device's total ``capacity`` and ``free`` memory, what the
    framework had ``allocated`` and ``reserved`` (and ``allowed``: a memory fraction's limit;
    ``process_in_use``/``other_processes_in_use``: torch's per-process figures) -- those the message
    gives -- and ``needed_at_least``: what the config needed at that moment, at least (in use +
    requested), where the message tells both and what was in use was the config's own (an allocator
    refusing a request as it ran; not a start-up check of the free memory against a share, where
    what is in use is other processes'). vLLM's KV cache refusal gives ``kv_cache_needed`` and
    ``kv_cache_available`` (GiB) and ``max_model_len``/``estimated_max_model_len`` (tokens), and no
    ``needed_at_least``. Where the framework took a fixed pool from the device at start (MindSpore),
    the message gives it as ``allocator_usable``, and ``needed_at_least`` counts within that pool: the
    runtime's and the communicators' memory beside it is in neither (protocol ``USABLE_KEY``'s sense).
    None when no message gives a number (the caller then brackets the usable memory itself). A probe
    that fails this way tells the search how far over the limit the config was, not only that it was
    over. The formats: the comment above ``_TORCH_FIELDS``."""
    lines = output.splitlines() if isinstance(output, str) else [str(line) for line in output]
    for i in range(len(lines) - 1, -1, -1):
        for parse in _OOM_FORMATS:
            found = parse(lines, i)
            if found:
                return {k: v if k in _TOKEN_KEYS else round(v, 4) for k, v in found.items()}
    return None
