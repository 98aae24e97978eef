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

from .oom_messages import oom_evidence

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
    "device_oom_raised",
    "native_cause",
    "oom_evidence",
    "parse_output_line",
    "read_trial_file",
    "write_trial_file",
]

TRIAL_FILE_ENV = "AUTOTUNE_TRIAL_FILE"
# what each node of a multi-node trial is told, as the dispatcher's argv placeholders name it and the
# environment variable that carries it (autotune.dispatch.dispatcher.node_env, the serving probe)
NODE_ENV = {"nnodes": "NNODES", "node_rank": "NODE_RANK", "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT"}

# The one rule for an environment variable's name, wherever it comes from (the spec checks it, the
# exports refuse any other): a POSIX shell name, so that `export NAME=...` and a process
# environment read it as a name, never as code (`X=1;touch y;#`, `$(cmd)`).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# ok: metrics measured; oom: allocator ran out of memory; timeout: killed at the deadline;
# nan: the loss (numerics) broke; crash: any other failure; invalid: the config cannot run at all
# (rejected by a rule, or the probe said so); pruned: stopped early by the driver as a loser.
# infra: the infrastructure failed under the probe (a Ray worker or node died), not the config;
# set by the dispatcher, never claimed by a probe. oom_predicted: the trial's memory profile (a run of
# its layout with fewer layers, autotune.guide.memory_profile) says the full model does not fit, so it was
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
# The words of a device allocator's own out-of-memory error, as it raises it: the line that says a rank
# has failed, not a warning that memory is short (``_OOM_PATTERNS`` reads a finished probe's output and
# is wider). torch and torch_npu (c10/cuda/CUDACachingAllocator.cpp, NPUCachingAllocator.cpp: "CUDA out
# of memory. Tried to allocate", the exception torch.OutOfMemoryError / torch.cuda.OutOfMemoryError),
# the CUDA runtime's error string, MindSpore's memory adapter ("Out of Memory!!!", "memory isn't enough
# and alloc failed", "Malloc device memory failed") and Ascend's EL0004 (the words of oom_messages.py).
_DEVICE_OOM_RAISED = re.compile(
    r"OutOfMemoryError|(?:CUDA|NPU|XPU|HIP) out of memory\. (?:Tried to allocate|Allocation was preemptively"
    r"|NPUWorkspaceAllocator tried)|CUDA error: out of memory|Out of Memory!!!|Out of memory!!! total\["
    r"|memory isn't enough and alloc failed|Malloc device memory failed|\bEL0004\b"
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


def device_oom_raised(line: str) -> bool:
    """Whether a probe's output line is a device allocator raising out-of-memory (not a warning about
    memory): the rank that printed it has failed, and the probe will end as ``oom`` whatever follows.
    The command runner stops a probe that does not exit soon after such a line
    (:data:`autotune.workers.command.OOM_EXIT_GRACE_S`): the other ranks would otherwise wait in a
    collective until its timeout (NCCL's 10 minutes, HCCL's 30) with the devices held."""
    return bool(_DEVICE_OOM_RAISED.search(line))


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
