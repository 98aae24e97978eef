"""DeepSpeed: the engine's throughput timer and progress lines.

From DeepSpeed's sources (deepspeedai/DeepSpeed v0.19.5, cf44300453eb0af79ed84ed8f1cb49d57478bd76,
and edaa7221267243c7be7fb49c5d5f5c4fb97b4641; timer.py and logging.py are byte-identical in the
0.19.8 release on PyPI), through ``deepspeed/utils/logging.py``'s formatter
``[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s``:

- ``deepspeed/utils/timer.py`` ``ThroughputTimer.stop``, on rank 0 every ``steps_per_print``
  global steps once timing started (after ``start_step`` = 2)::

    epoch=0/micro_step=4/global_step=4, RunningAvgSamplesPerSec=12.3, CurrSamplesPerSec=12.5,
    MemAllocated=1.2GB, MaxMemAllocated=3.4GB

  ``CurrSamplesPerSec`` is the global batch over the last step's time;
- ``deepspeed/runtime/engine.py`` ``_report_progress``: ``step=4, skipped=0, lr=[...], mom=[...]``,
  from ``_take_model_step``, so before the same step's timer line (both on rank 0);
- ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``:
  ``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768``.

NaN in DeepSpeed's words is fp16 loss scaling: the engine checks nothing else (a bf16 or fp32
NaN is the training script's to print). A step the loss scaler skipped (``skipped`` went up on
its progress line) did no optimizer step: its time is not measured. Failures in its words:
``deepspeed/runtime/config.py``'s batch check (``Check batch related parameters.
train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size``) and
other config assertions are an invalid config; every measured step skipped by fp16 loss scaling
is a numerics failure.
"""

from __future__ import annotations

import re
from typing import Any

from ._base import StackLog, all_skipped, number

__all__ = ["DeepSpeedLog"]

_TIMER = re.compile(
    r"epoch=(\d+)/micro_step=(\d+)/global_step=(\d+),\s*RunningAvgSamplesPerSec=(\S+),\s*"
    r"CurrSamplesPerSec=(\S+),\s*MemAllocated=([\d.]+)GB,\s*MaxMemAllocated=([\d.]+)GB"
)
_PROGRESS = re.compile(r"\bstep=(\d+), skipped=(\d+),")
_INVALID = re.compile(
    r"Check batch related parameters|DeepSpeedConfigError|"
    r"is not divisible by|error: unrecognized arguments",
    re.IGNORECASE,
)
_COLLECTIVE_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|EI0002", re.IGNORECASE)


class DeepSpeedLog(StackLog):
    name = "deepspeed"
    missing = (
        "no DeepSpeed throughput-timer line: DeepSpeed's logger starts at WARNING and the timer's lines "
        "are INFO; call deepspeed.utils.logging.set_log_level_from_string('info') in the training script"
    )

    def __init__(self, *args: Any, samples_per_iteration: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.samples_per_iteration = float(samples_per_iteration) if samples_per_iteration else None
        self.skipped = 0
        self.last_step = 0
        self._skipped_before = 0  # the skipped count on the progress line before the last one

    def parse(self, line: str) -> list[dict[str, Any]]:
        m = _TIMER.search(line)
        if m:
            step = int(m.group(3))
            samples_per_s = number(m.group(5))
            step_time = (
                self.samples_per_iteration / samples_per_s if self.samples_per_iteration and samples_per_s else None
            )
            self.note_memory(float(m.group(7)))
            # its progress line came first: a step whose skipped count went up did no update
            skipped = True if self.last_step == step and self.skipped > self._skipped_before else None
            return self.step(
                step,
                step_time_s=step_time,
                samples_per_s=samples_per_s,
                peak_memory_gib=float(m.group(7)),
                skipped=skipped,
            )
        m = _PROGRESS.search(line)
        if m:
            self._skipped_before = self.skipped
            self.last_step = int(m.group(1))
            self.skipped = int(m.group(2))
        return []

    def failure(self, lines: list[str]) -> tuple[str, str] | None:
        for line in reversed(lines):
            if _INVALID.search(line):
                return "invalid", f"DeepSpeed refused the config: {line.strip()[:300]}"
            if _COLLECTIVE_TIMEOUT.search(line):
                return "timeout", f"collective timeout: {line.strip()[:300]}"
        return None

    def verdict(self, steps: list[dict[str, Any]]) -> tuple[str, str] | None:
        measured = [s for s in steps if s.get("phase") == "measure"]
        if measured and (all_skipped(steps) or (self.last_step and self.skipped >= self.last_step)):
            return "nan", (
                f"fp16 loss scaling skipped every step ({self.skipped} of {self.last_step}): the gradients "
                "overflow at every loss scale tried"
            )
        return None
