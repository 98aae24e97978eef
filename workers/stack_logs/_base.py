"""The contract of a stack's log reader, and what every reader shares."""

from __future__ import annotations

import abc
import math
import re
import statistics
from typing import Any, Iterable

__all__ = ["StackLog", "number", "all_skipped", "non_finite_loss"]

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
    iteration's time, loss, throughput and memory as the stack printed them; a line whose figures
    cover any of the first ``warmup`` iterations is marked ``phase: warmup`` and never measured:
    a stack that averages its time over the iterations since its last line leaks warm-up into the
    next line otherwise); ``failure`` names a failure only this stack words so (an argument check,
    a collective timeout, its NaN check); ``verdict`` judges a run that exited 0 (a non-finite
    loss, NaN or skipped iterations). ``metrics`` summarises the measured iterations the way
    autotune's own probe does (median step time).

    A step the stack skipped (fp16 loss scaling found an overflow and left the weights alone) is
    marked ``skipped: true``: it did no optimizer update, so its time is not an iteration's time
    and its loss is not the model's loss (Megatron-LM main prints ``lm loss: 0.000000E+00`` for
    it); ``metrics`` leaves it out.

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
    def step(self, iteration: int, *, covers_from: int | None = None, **fields: Any) -> list[dict[str, Any]]:
        """The step event for ``iteration`` with the fields given (None ones left out), its phase,
        and tokens/s per device derived from the step time when the stack printed no rate; none
        for an iteration already reported (a stack that logs on every rank).

        ``covers_from``: the first iteration the line's figures are averaged over (default: the
        line's own); the line is measured only when that one is past warm-up."""
        if iteration in self._seen:
            return []
        self._seen.add(iteration)
        self.iterations = max(self.iterations, iteration)
        first = iteration if covers_from is None else min(int(covers_from), iteration)
        event: dict[str, Any] = {
            "event": "step",
            "step": int(iteration),
            "phase": "warmup" if first <= self.warmup else "measure",
        }
        if first != iteration:
            event["covers_from"] = first
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
        """The probe's metrics from its measured iterations, skipped ones left out (None when none
        was measured).

        When every measured iteration was skipped there is no step time, but the run did measure
        its memory: ``{"measured_steps": 0}`` and the peak seen (the config fitted; :meth:`verdict`
        says ``nan``, and the memory model still learns from the peak)."""
        steps = list(steps)
        in_phase = [s for s in steps if s.get("phase") == "measure"]
        measured = [s for s in in_phase if not s.get("skipped") and _finite(s.get("step_time_s"))]
        if not measured:
            if in_phase and all(s.get("skipped") for s in in_phase):
                out = {"measured_steps": 0.0}
                if self.peak_memory_gib is not None:
                    out["peak_memory_gib"] = self.peak_memory_gib
                return out
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


def all_skipped(steps: Iterable[dict[str, Any]]) -> int:
    """How many measured steps there were when every one of them was skipped (else 0)."""
    measured = [s for s in steps if s.get("phase") == "measure"]
    return len(measured) if measured and all(s.get("skipped") for s in measured) else 0


def non_finite_loss(steps: Iterable[dict[str, Any]], *keys: str) -> dict[str, Any] | None:
    """The first step whose ``keys`` (default: loss) hold a NaN or an infinity, warm-up included:
    once a loss is non-finite the weights that follow are too."""
    for s in steps:
        for key in keys or ("loss",):
            value = s.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                return s
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
