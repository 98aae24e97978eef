"""The contract of a stack's log reader, and what every reader shares."""

from __future__ import annotations

import abc
import math
import re
import statistics
from typing import Any, Iterable

__all__ = ["StackLog", "number"]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf", re.IGNORECASE)


def number(text: str) -> float | None:
    """The first number in ``text`` (thousands separators allowed: torchtitan prints ``tps: 1,234``)."""
    m = _NUMBER.search(text)
    if not m:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


class StackLog(abc.ABC):
    """Reads one stack's own log lines as the probe protocol.

    ``parse`` turns a log line into protocol messages (``{"event": "step", ...}`` with the
    iteration's time, loss, throughput and memory as the stack printed them; the first
    ``warmup`` iterations are marked ``phase: warmup`` and never measured); ``failure`` names a
    failure only this stack words so (an argument check, a collective timeout); ``verdict``
    judges a run that exited 0 (NaN or skipped iterations). ``metrics`` summarises the measured
    iterations the way autotune's own probe does (median step time).

    ``tokens_per_iteration``: global batch x sequence length, for tokens/s when the stack prints
    only a time; ``devices``: the trial's world size (per-device figures)."""

    name = "stack"
    missing = "the stack printed no iteration line"  # why a run that exited 0 gave no metrics
    # what the memory figure the stack prints counts (the protocol's PEAK_COUNTS): most print
    # torch's max_memory_allocated, which leaves out fragmentation and what is outside the allocator
    peak_counts = "allocated"

    def __init__(self, warmup: int = 1, tokens_per_iteration: float | None = None, devices: int = 1):
        self.warmup = max(0, int(warmup))
        self.tokens_per_iteration = float(tokens_per_iteration) if tokens_per_iteration else None
        self.devices = max(1, int(devices))
        self.peak_memory_gib: float | None = None
        self.peak_reserved_gib: float | None = None  # where the stack prints the allocator's reserve too
        self.iterations = 0
        self._seen: set[int] = set()

    @abc.abstractmethod
    def parse(self, line: str) -> list[dict[str, Any]]:
        """Protocol messages this log line says (usually none)."""

    @abc.abstractmethod
    def failure(self, lines: list[str]) -> tuple[str, str] | None:
        """(status, reason) of a failed run, where this stack's own words decide it."""

    def verdict(self, steps: list[dict[str, Any]]) -> tuple[str, str] | None:
        """(status, reason) of a run that exited 0 but must not count (default: none)."""
        return None

    # ---- shared -----------------------------------------------------------------------------------
    def step(self, iteration: int, **fields: Any) -> list[dict[str, Any]]:
        """The step event for ``iteration`` with the fields given (None ones left out), its phase,
        and tokens/s per device derived from the step time when the stack printed no rate; none
        for an iteration already reported (a stack that logs on every rank)."""
        if iteration in self._seen:
            return []
        self._seen.add(iteration)
        self.iterations = max(self.iterations, iteration)
        event: dict[str, Any] = {"event": "step", "step": int(iteration),
                                 "phase": "warmup" if iteration <= self.warmup else "measure"}
        event.update({k: v for k, v in fields.items() if v is not None})
        step_time = event.get("step_time_s")
        if "tokens_per_s_per_device" not in event and self.tokens_per_iteration and step_time:
            event["tokens_per_s_per_device"] = self.tokens_per_iteration / step_time / self.devices
        if event.get("peak_memory_gib") is not None:
            self.note_memory(event["peak_memory_gib"])
        return [event]

    def note_memory(self, gib: float) -> None:
        if gib is not None and math.isfinite(gib):
            self.peak_memory_gib = gib if self.peak_memory_gib is None else max(self.peak_memory_gib, gib)

    def metrics(self, steps: Iterable[dict[str, Any]]) -> dict[str, float] | None:
        """The probe's metrics from its measured iterations (None when none was measured)."""
        measured = [s for s in steps if s.get("phase") == "measure" and _finite(s.get("step_time_s"))]
        if not measured:
            return None
        step_time = statistics.median(float(s["step_time_s"]) for s in measured)
        out: dict[str, float] = {"step_time_s": step_time, "measured_steps": float(len(measured))}
        rates = [float(s["tokens_per_s_per_device"]) for s in measured if _finite(s.get("tokens_per_s_per_device"))]
        if rates:
            out["tokens_per_s_per_device"] = statistics.median(rates)
            out["tokens_per_s"] = out["tokens_per_s_per_device"] * self.devices
        for key in ("mfu", "tflops_per_device"):
            values = [float(s[key]) for s in measured if _finite(s.get(key))]
            if values:
                out[key] = statistics.median(values)
        losses = [float(s["loss"]) for s in measured if _finite(s.get("loss"))]
        if losses:
            out["loss"] = losses[-1]
        if self.peak_memory_gib is not None:
            out["peak_memory_gib"] = self.peak_memory_gib
        if self.peak_reserved_gib is not None:
            out["peak_reserved_gib"] = self.peak_reserved_gib
        return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
