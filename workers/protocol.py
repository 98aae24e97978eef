"""The probe protocol shared by the driver and every probe (see docs/ARCHITECTURE.md, "The probe protocol").

A probe gets one resolved trial as a JSON file (path in ``AUTOTUNE_TRIAL_FILE``) and answers with
JSON lines on stdout: ``{"event": "step", ...}`` per measured step, then exactly one
``{"metrics": {...}}``. This module holds the value types of that exchange and the pure functions
that read it, so that the dispatcher, the command backend and the in-repo probes agree on one
definition. It imports only the standard library: probes run on worker nodes (or in a MindSpore
environment) where nothing else of the driver is installed.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "STATUSES",
    "FAILURE_STATUSES",
    "PEAK_COUNTS",
    "PEAK_COUNTS_KEY",
    "USABLE_KEY",
    "PEAK_LEAVES_OUT",
    "TRIAL_FILE_ENV",
    "ENV_NAME",
    "ProbeResult",
    "TrialRequest",
    "attach_requests_file",
    "classify_failure",
    "native_cause",
    "oom_evidence",
    "parse_output_line",
    "read_trial_file",
    "write_trial_file",
]

TRIAL_FILE_ENV = "AUTOTUNE_TRIAL_FILE"

# The one rule for an environment variable's name, wherever it comes from (the spec checks it, the
# exports refuse any other): a POSIX shell name, so that `export NAME=...` and a process
# environment read it as a name, never as code (`X=1;touch y;#`, `$(cmd)`).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# ok: metrics measured; oom: allocator ran out of memory; timeout: killed at the deadline;
# nan: the loss (numerics) broke; crash: any other failure; invalid: the config cannot run at all
# (rejected by a rule, or the probe said so); pruned: stopped early by the driver as a loser.
# infra: the infrastructure failed under the probe (a Ray worker or node died), not the config;
# set by the dispatcher, never claimed by a probe. oom_predicted: the trial's memory profile (a run of
# its layout with fewer layers, autotune.memory_profile) says the full model does not fit, so it was
# never run in full; set by the driver
STATUSES = ("ok", "oom", "timeout", "nan", "crash", "invalid", "pruned", "infra", "oom_predicted")
FAILURE_STATUSES = frozenset({"oom", "timeout", "nan", "crash", "invalid"})

# What a probe's ``peak_memory_gib`` counts, said in its info as ``{"peak_memory_counts": ...}``.
# A framework's own counter sees only its caching allocator: "allocated" (torch's and MindSpore's
# max_memory_allocated, the figure Megatron-LM's and DeepSpeed's logs print) leaves out the
# allocator's fragmentation and what lives outside it (the runtime's context, HCCL/NCCL buffers);
# "reserved" (max_memory_reserved, torchtitan's log) only the latter; "device" (the default: the
# simulator, npu-smi, a CPU probe's peak RSS) nothing. The search compares a config's whole need
# with the device's capacity, so it must know which part a probe measured.
PEAK_COUNTS_KEY = "peak_memory_counts"
# ... and, where the device says, the memory its allocator could have used at the peak: what it had
# reserved plus what the device still had free (torch.cuda/torch.npu mem_get_info + memory_reserved):
# the usable memory, learnt without an OOM (what the runtime and communicators hold is not in it)
USABLE_KEY = "usable_memory_gib"
PEAK_COUNTS = ("allocated", "reserved", "device")
# ... and the simulator's memory components (``mem_<name>``) each kind leaves out
PEAK_LEAVES_OUT = {
    "device": (),
    "reserved": ("comm_buffers", "runtime_reserve"),
    "allocated": ("fragmentation", "comm_buffers", "runtime_reserve"),
}

_OOM_PATTERNS = re.compile(
    r"out of memory|OutOfMemoryError|CUDA error: out of memory|NPU out of memory|"
    r"Cannot allocate memory|std::bad_alloc|MemoryError|ERR99999|"
    r"Allocation on device .* would exceed|EL0004|"  # EL0004: Ascend 'Failed to allocate memory'
    r"Killed process .* total-vm|"
    # MindSpore (Out of Memory!!! is above): the runtime's refusal, the GPU allocator's exception (its
    # capital C: the pool's own "current free memory size[...]" is a warning it may recover from), the
    # Ascend adapter's when the device refused its share
    r"memory isn't enough and alloc failed|(?-i:Current free memory size)\[\d+B?\] is smaller than required|"
    r"Malloc device memory failed|"
    # vLLM's engine start-up (v1/core/kv_cache_utils.py, v1/worker/utils.py and cpu_worker.py; v0's KV words)
    r"KV cache is needed, which is larger than the available KV cache memory|"
    r"No available memory for the cache blocks|"
    r"on startup is less than (?:desired (?:GPU|CPU) memory utilization|the engine's budget)|"
    r"larger than the maximum number of tokens that can be stored in KV cache",
    re.IGNORECASE,
)
_NAN_PATTERNS = re.compile(r"\bloss is (nan|inf)\b|non-finite loss|loss=nan|loss: nan|\bNaN detected", re.IGNORECASE)
_DECORATION = re.compile(r"^[=\-_*#~\s]+$")
_CAUSE = re.compile(
    r"\w(Error|Exception)\b|\berror:|terminate called|Segmentation fault|Aborted|"
    r"failed \(exitcode",
    re.IGNORECASE,
)
_LAUNCHER = re.compile(r"ChildFailedError|torch[./]distributed[./]elastic|error_file:")  # torchrun's own report
_INVALID_PATTERNS = re.compile(r"\binvalid config(uration)?\b|not divisible by", re.IGNORECASE)


@dataclass
class TrialRequest:
    """One resolved trial as the probe sees it: the content of the trial file.

    ``params`` holds canonical names (docs/ARCHITECTURE.md), derived ones included (``dp``, ``grad_accum``)
    and environment settings flattened as ``env.VAR``. ``model``, ``workload`` and ``cluster`` are
    plain mappings (the resolved spec sections; ``cluster["hardware"]`` is the resolved hardware
    profile), so a probe needs no import from the driver.
    """

    params: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    cluster: dict[str, Any]
    study: str = ""
    number: int = -1
    backend: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The trial's environment variables (``env.VAR`` params), as strings."""
        return {k[4:]: str(v) for k, v in self.params.items() if k.startswith("env.")}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_trial_file(request: TrialRequest, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(request.to_json(), indent=1, sort_keys=True, default=str))
    tmp.replace(path)
    return path


def read_trial_file(path: str | Path) -> TrialRequest:
    data = json.loads(Path(path).read_text())
    known = {k: data[k] for k in ("params", "model", "workload", "cluster", "study", "number", "backend") if k in data}
    return TrialRequest(**known)


@dataclass
class ProbeResult:
    """What one probe produced. ``source`` says whether the numbers were measured or simulated;
    a simulated number is never presented as a measured one."""

    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    source: str = "measured"
    log_tail: str = ""
    wall_s: float = 0.0
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # e.g. software fingerprint, memory breakdown

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown probe status {self.status!r}; expected one of {STATUSES}")
        if self.source not in ("measured", "simulated"):
            raise ValueError(f"unknown probe source {self.source!r}; expected measured or simulated")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def feasible(self) -> bool:
        """False when the config itself cannot run (oom, invalid): the sampler must learn that."""
        return self.status not in ("oom", "invalid")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ProbeResult":
        return cls(**data)


def parse_output_line(line: str) -> dict[str, Any] | None:
    """One line of probe output as a protocol message, or None for ordinary log text.

    A message is a JSON object with either ``"event"`` or ``"metrics"``; anything else
    (including JSON that is not an object) is log text.
    """
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if isinstance(obj, dict) and ("event" in obj or "metrics" in obj):
        return obj
    return None


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
    holds ``reserved`` ("MindSpore Used memory size") from the device; in use of it is the static
    memory and this graph's dynamic memory, which with the request did not fit."""
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
    if "static" in stats:
        found["allocated"] = stats["static"] + stats.get("graph_dynamic", 0.0)
    return _with_needed(found, found.get("allocated"))


def _mindspore_old(lines: list[str], i: int) -> dict[str, float] | None:
    """MindSpore 1.x's memory manager: its total (``reserved`` from the device), the dynamic and the
    static (GPU) or memory pool (Ascend) part in use, and the request that did not fit beside them."""
    m = _MS_OLD.search(lines[i])
    if not m:
        return None
    total, dynamic, other, request = (int(g) / _GIB for g in m.groups())
    found = {"requested": request, "reserved": total, "allocated": dynamic + other}
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
    ``needed_at_least``. None when no message gives a number (the caller then brackets the usable
    memory itself). A probe that fails this way tells the search how far over the limit the config
    was, not only that it was over. The formats: the comment above ``_TORCH_FIELDS``."""
    lines = output.splitlines() if isinstance(output, str) else [str(line) for line in output]
    for i in range(len(lines) - 1, -1, -1):
        for parse in _OOM_FORMATS:
            found = parse(lines, i)
            if found:
                return {k: v if k in _TOKEN_KEYS else round(v, 4) for k, v in found.items()}
    return None


# A native runtime's own error lines (MindSpore/CANN/TVM's C++ logging, glibc, the C++ runtime):
# they hold the cause when the Python exception only says that a worker went away ("Response is
# empty.", "Connection reset"), and they never reach the exception text.
_NATIVE_CAUSE = re.compile(
    r"Check failed:|^\s*\[(?:ERROR|CRITICAL)\]|terminate called|Segmentation fault|"
    r"core dumped|Fatal Python error|\bE[EILZ]\d{4}\b"
)


def native_cause(lines: Iterable[str], reason: str = "") -> str | None:
    """The first line of the output that a native runtime printed as an error (a ``Check failed``,
    a ``[ERROR]``/``[CRITICAL]`` log line, an Ascend error code), when ``reason`` does not already
    say it: what a crash's one-line reason should add. The first such line is the cause; what
    follows is usually its echo."""
    for line in lines:
        text = line.strip()
        if text and _NATIVE_CAUSE.search(text) and text[:80] not in reason:
            return text[:300]
    return None


def classify_failure(returncode: int | None, output: Iterable[str] | str, timed_out: bool = False) -> tuple[str, str]:
    """Status and one-line reason for a probe that did not report metrics.

    Order matters: a deadline beats everything (the output may be incomplete), then an explicit
    ``{"event": "failure", "status": ...}`` message from the probe, then recognisable out-of-memory,
    non-finite loss and invalid-config messages, else a crash with the exit status.
    """
    lines = output.splitlines() if isinstance(output, str) else list(output)
    if timed_out:
        return "timeout", "probe exceeded its timeout and was killed"
    for line in reversed(lines):
        msg = parse_output_line(line)
        if msg and msg.get("event") == "failure" and msg.get("status") in FAILURE_STATUSES:
            return msg["status"], str(msg.get("reason", ""))[:500]
    for status, pattern in (("oom", _OOM_PATTERNS), ("nan", _NAN_PATTERNS), ("invalid", _INVALID_PATTERNS)):
        for line in reversed(lines):
            if pattern.search(line):
                return status, line.strip()[:500]
    if returncode is not None and returncode < 0:
        return "crash", f"probe killed by signal {-returncode}"
    if returncode == 137:
        # SIGKILL from outside, usually the kernel's OOM killer on host memory
        return "oom", "probe killed (exit 137), most likely by the host OOM killer"
    # the line that says what went wrong, not a launcher's closing banner ("=====", "-----")
    said = [ln.strip() for ln in lines if ln.strip() and not _DECORATION.match(ln.strip())]
    tail = next(
        (ln for ln in reversed(said) if _CAUSE.search(ln) and not _LAUNCHER.search(ln)), said[-1] if said else ""
    )
    return "crash", f"probe exited with status {returncode}" + (f": {tail[:300]}" if tail else "")


MAX_REQUESTS_FILE_BYTES = 256 << 20  # a serving probe's per-request records: a long study at a high rate


def attach_requests_file(result: ProbeResult) -> ProbeResult:
    """On the worker, before the trial's folder goes: a serving probe's per-request records
    (``info["serving"]["requests_file"]``) carried in the result (``requests_jsonl``), so the
    driver keeps them beside the study wherever the probe ran (the evidence every SLO verdict is
    recomputed from). Larger than :data:`MAX_REQUESTS_FILE_BYTES`: left out, and said so."""
    serving = result.info.get("serving") if isinstance(result.info, dict) else None
    source = serving.get("requests_file") if isinstance(serving, dict) else None
    if not source or "requests_jsonl" in serving:
        return result
    path = Path(source)
    try:
        size = path.stat().st_size
        if size > MAX_REQUESTS_FILE_BYTES:
            serving["requests_file_note"] = f"{size:,} bytes: above {MAX_REQUESTS_FILE_BYTES:,}, not carried back"
        else:
            serving["requests_jsonl"] = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        serving["requests_file_note"] = f"not readable on the worker: {exc}"
    return result
