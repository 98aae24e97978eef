"""How the torch probe turns an exception into a protocol failure (``oom``, ``nan``, ``invalid``, ``crash``).

Kept free of torch imports: exceptions are recognised by class name and message, so the
classification is unit-testable without torch, and it works for ``torch_npu``'s errors too (they
are plain ``RuntimeError``s with recognisable text, not a torch class).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

__all__ = ["ProbeFailure", "classify_exception", "EXIT_CODES", "report_step"]

# Distinct exit statuses make a failure readable from ``echo $?`` too; the driver classifies
# from the ``{"event": "failure"}`` line first (protocol.classify_failure).
EXIT_CODES = {"crash": 1, "invalid": 3, "oom": 4, "nan": 5}


class ProbeFailure(Exception):
    """A failure the probe understood: ``status`` is a protocol status, ``reason`` one line.

    ``collective`` marks failures every rank detects together (from exchanged values); only
    rank 0 reports those, so the output carries one failure line, not one per rank.
    """

    def __init__(self, status: str, reason: str, collective: bool = False) -> None:
        if status not in EXIT_CODES:
            raise ValueError(f"unknown failure status {status!r}")
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.collective = collective


def report_step(
    emit: Callable[[dict[str, Any]], None] | None,
    step: int,
    phase: str,
    step_time_s: float,
    tokens: int,
    loss: float,
    memory_gib: float,
) -> None:
    """One measured step, as every training probe (torch, MindSpore) reports it: the protocol's
    ``{"event": "step"}`` line through ``emit`` (rank 0 passes its printer, the other ranks None),
    then the whole probe ends as ``nan`` on a non-finite loss. The loss is exchanged over the ranks
    before this, so every rank raises together (``collective``: only rank 0 prints the failure).
    A non-finite loss is sent as null (NaN is not JSON) with ``loss_finite`` 0."""
    finite = math.isfinite(loss)
    if emit is not None:
        emit(
            {
                "event": "step",
                "step": step,
                "phase": phase,
                "step_time_s": step_time_s,
                "tokens": tokens,
                "loss": loss if finite else None,
                "loss_finite": int(finite),
                "memory_gib": memory_gib,
            }
        )
    if not finite:
        raise ProbeFailure("nan", f"non-finite loss {loss} at step {step} ({phase})", collective=True)


_REQUESTED = [
    # torch.OutOfMemoryError on cuda, and torch_npu's "NPU out of memory. Tried to allocate 2.00 GiB"
    re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)", re.IGNORECASE),
    # CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456 bytes"
    re.compile(r"you tried to allocate (\d+) bytes", re.IGNORECASE),
]
_OOM_TEXT = re.compile(
    r"out of memory|can't allocate memory|Cannot allocate memory|std::bad_alloc|EL0004|ERR99999", re.IGNORECASE
)
# A peer died or the store went away: the failing rank reports the real cause, so the others
# must not print a competing 'crash' line (protocol.classify_failure takes the last one).
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistNetworkError|"
    r"DistBackendError|recvBytes|sendBytes|Socket Timeout|NCCL communicator was aborted|"
    r"Failed to recv|Failed to send|gloo/transport",
    re.IGNORECASE,
)


def _requested_size(text: str) -> str | None:
    for pattern in _REQUESTED:
        m = pattern.search(text)
        if m:
            size = m.group(1)
            return f"{size} bytes" if size.isdigit() else size
    return None


def classify_exception(exc: BaseException, rank: int) -> tuple[str, str, bool]:
    """``(status, reason, report)`` for an exception raised on ``rank``.

    ``report`` is False for errors that are only the echo of another rank's failure (a
    collective whose peer died); the rank that failed first reports the cause.
    """
    if isinstance(exc, ProbeFailure):
        return exc.status, exc.reason, True
    name = type(exc).__name__
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else name
    if name in ("OutOfMemoryError", "MemoryError") or _OOM_TEXT.search(text):
        size = _requested_size(text)
        what = f"requested {size}" if size else "requested size unknown"
        return "oom", f"rank {rank}: allocator out of memory ({what}): {first[:300]}", True
    if _PEER_GONE.search(f"{name} {text}"):
        return "crash", f"rank {rank}: lost a peer: {first[:300]}", False
    return "crash", f"rank {rank}: {name}: {first[:300]}", True
