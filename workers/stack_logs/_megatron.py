"""Megatron-LM and MindSpeed-LLM: ``training_log`` lines and ``report_memory`` lines.

The formats, from the stacks' sources (tests/fixtures/stack_logs/megatron.log reproduces them):

- Megatron-LM ``megatron/training/training.py`` ``training_log`` (NVIDIA/Megatron-LM
  d98e8a64ddf34856e74b24714e3bedb2f5a39553), printed on the last rank every ``--log-interval``::

     [2026-08-22 15:22:22.123456] iteration        3/      10 | consumed samples:          192 |
     elapsed time per iteration (ms): 13105.3 | throughput per GPU (TFLOP/s/GPU): 180.2 |
     learning rate: 1.500000E-04 | global batch size:    64 | lm loss: 1.043863E+01 |
     loss scale: 1.0 | grad norm: 26.203 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

  (one line; MindSpeed-LLM's ``mindspeed_llm/training/training.py`` ``training_log``,
  Ascend/MindSpeed-LLM c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91, prints the same fields, and
  its FSDP2 trainer adds ``max_memory_allocated(GB)``);
- ``report_memory`` (``megatron/training/utils/common_utils.py``, same commit), after the first
  iterations: ``[Rank 0] (after 2 iterations) memory (MB) | allocated: ... | max allocated: ...
  | reserved: ... | max reserved: ...``.

Failures in the stack's own words: its argument parser (``error: unrecognized arguments``) and
``validate_args`` assertions (an invalid config, not a crash), the NCCL watchdog's collective
timeout and HCCL's notify-wait timeout, NaN iterations and fp16 loss scaling that skipped every
measured iteration.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ._base import StackLog, number

__all__ = ["MegatronLog"]

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)")
_MEMORY = re.compile(r"memory \(MB\)\s*\|(.*)")
_ARGPARSE = re.compile(r"error: (unrecognized arguments|argument --|the following arguments are required)")
_COLLECTIVE_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|EI0002|HCCL[^\n]*time(?:d)? ?out",
                                 re.IGNORECASE)


class MegatronLog(StackLog):
    name = "megatron"
    missing = "no Megatron iteration line: keep --log-interval 1 and the last rank's output"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nan_iterations = 0
        self.skipped_iterations = 0

    def parse(self, line: str) -> list[dict[str, Any]]:
        m = _ITERATION.search(line)
        if m:
            return self._iteration(int(m.group(1)), _fields(m.group(3)))
        m = _MEMORY.search(line)
        if m:
            fields = _fields(m.group(1))
            peak = fields.get("max allocated")
            if peak is not None:
                self.note_memory(peak / 1024.0)
            reserved = fields.get("max reserved")
            if reserved is not None and math.isfinite(reserved):
                gib = reserved / 1024.0
                self.peak_reserved_gib = gib if self.peak_reserved_gib is None else max(self.peak_reserved_gib, gib)
        return []

    def _iteration(self, iteration: int, fields: dict[str, float]) -> list[dict[str, Any]]:
        ms = fields.get("elapsed time per iteration (ms)")
        loss = next((v for k, v in fields.items() if k.endswith("loss") and k != "loss scale"), None)
        skipped = int(fields.get("number of skipped iterations", 0) or 0)
        nans = int(fields.get("number of nan iterations", 0) or 0)
        memory = fields.get("max_memory_allocated(GB)")
        events = self.step(iteration, step_time_s=ms / 1000.0 if ms is not None else None, loss=loss,
                         tflops_per_device=fields.get("throughput per GPU (TFLOP/s/GPU)"),
                         skipped_iterations=skipped, nan_iterations=nans, peak_memory_gib=memory)
        if events and iteration > self.warmup:
            self.skipped_iterations += skipped
            self.nan_iterations += nans
        return events

    def failure(self, lines: list[str]) -> tuple[str, str] | None:
        for line in reversed(lines):
            if _ARGPARSE.search(line):
                return "invalid", f"Megatron's argument parser refused the launch: {line.strip()[:300]}"
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].lstrip().startswith("AssertionError") and any(
                    "arguments.py" in earlier for earlier in lines[max(0, i - 40):i]):
                return "invalid", f"Megatron's argument checks (validate_args) refused the config: {lines[i].strip()[:300]}"
        for line in reversed(lines):
            if _COLLECTIVE_TIMEOUT.search(line):
                return "timeout", f"collective timeout: {line.strip()[:300]}"
        return None

    def verdict(self, steps: list[dict[str, Any]]) -> tuple[str, str] | None:
        measured = [s for s in steps if s.get("phase") == "measure"]
        if self.nan_iterations:
            return "nan", f"Megatron counted {self.nan_iterations} NaN iteration(s) in the measured steps"
        if measured and self.skipped_iterations >= len(measured):
            return "nan", (f"fp16 loss scaling skipped every measured iteration ({self.skipped_iterations}): the "
                           "gradients overflow at every loss scale tried")
        return None


def _fields(text: str) -> dict[str, float]:
    """``| name: value |`` segments as numbers (a segment without a number is left out)."""
    out: dict[str, float] = {}
    for part in text.split("|"):
        if ":" not in part:
            continue
        name, _, value = part.rpartition(":")
        parsed = number(value)
        if parsed is not None:
            out[name.strip()] = parsed
    return out
