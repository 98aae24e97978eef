"""torchtitan: the per-step line of ``MetricsProcessor.log``.

From ``torchtitan/components/metrics.py`` (the same f-string in pytorch/torchtitan v0.2.2,
73a0e6979dd10b6b1904098eb3c8f62c18ab87ce, in v0.3.0 as on PyPI and at main,
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a, where ``mfu`` may say ``N/A``), logged by the
``[titan]`` logger of ``torchtitan/tools/logging.py`` on step 1 and every ``--metrics.log_freq``
steps, colour codes and all::

    [titan] 2026-08-22 21:30:21,123 - root - INFO - step:  3  loss:  8.12345  grad_norm:  1.2345
    memory: 12.34GiB(15.60%)  tps: 1,234  tflops: 56.78  mfu: 12.34%

(one line). ``tps`` is tokens per second per device, ``memory`` the peak reserved, ``mfu`` a
percentage (``N/A`` with quantisation). The step time is not printed: it is the tokens of one
iteration over ``tps`` times the devices.

A NaN loss, by version: v0.2.2 checks nothing, logs ``loss:      nan  grad_norm:     nan`` (the
``{:8.5f}`` of a NaN) and exits 0, so :meth:`TorchtitanLog.verdict` calls any logged step with a
non-finite loss or gradient norm ``nan``; main (``torchtitan/trainer.py`` ``train_step``, since
56e7b652, "Stop non-finite steps before optimizer updates") asserts before the optimizer step
with ``torch._assert_async``: ``Loss or gradient norm is not finite on at least one rank at step
3. Stopping training before the optimizer update.`` (a ``RuntimeError`` on CPU; on CUDA the same
words as a device-side assertion). Other failures in its words: ``ParallelDims``' check
(``Invalid parallel dims: ...``) and other configuration errors are an invalid config.
"""

from __future__ import annotations

import re
from typing import Any

from ._base import StackLog, non_finite_loss, number

__all__ = ["TorchtitanLog"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"(?<!validate )\bstep:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)\s+memory:\s*([\d.]+)GiB"
    r"\(([\d.]+)%\)\s+tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*(\S+)"
)
_INVALID = re.compile(
    r"Invalid parallel dims|must divide|is not supported|ValueError: .*(parallel|degree)|"
    r"error: unrecognized arguments",
    re.IGNORECASE,
)
_COLLECTIVE_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout", re.IGNORECASE)
_NON_FINITE = re.compile(r"Loss or gradient norm is not finite")  # torchtitan/trainer.py, main


class TorchtitanLog(StackLog):
    name = "torchtitan"
    peak_counts = "reserved"  # its "memory: X GiB" is max_memory_reserved (components/metrics.py)
    missing = "no torchtitan step line: keep --metrics.log_freq 1 and rank 0's output"

    def parse(self, line: str) -> list[dict[str, Any]]:
        m = _STEP.search(_ANSI.sub("", line))
        if not m:
            return []
        step, loss, grad_norm, memory, _, tps, tflops, mfu = m.groups()
        per_device = number(tps)
        step_time = (
            self.tokens_per_iteration / (per_device * self.devices)
            if self.tokens_per_iteration and per_device
            else None
        )
        mfu_share = number(mfu) / 100.0 if mfu.endswith("%") and number(mfu) is not None else None
        return self.step(
            int(step),
            step_time_s=step_time,
            loss=number(loss),
            grad_norm=number(grad_norm),
            tokens_per_s_per_device=per_device,
            tflops_per_device=number(tflops),
            mfu=mfu_share,
            peak_memory_gib=number(memory),
        )

    def failure(self, lines: list[str]) -> tuple[str, str] | None:
        for line in reversed(lines):
            clean = _ANSI.sub("", line)
            if _NON_FINITE.search(clean):
                return "nan", f"torchtitan stopped a non-finite step: {clean.strip()[:300]}"
        for line in reversed(lines):
            clean = _ANSI.sub("", line)
            if _INVALID.search(clean):
                return "invalid", f"torchtitan refused the config: {clean.strip()[:300]}"
            if _COLLECTIVE_TIMEOUT.search(clean):
                return "timeout", f"collective timeout: {clean.strip()[:300]}"
        return None

    def verdict(self, steps: list[dict[str, Any]]) -> tuple[str, str] | None:
        bad = non_finite_loss(steps, "loss", "grad_norm")
        if bad is not None:
            return "nan", (
                f"torchtitan logged a non-finite loss or gradient norm at step {bad['step']} "
                f"(loss {bad.get('loss')}, grad_norm {bad.get('grad_norm')}) and went on"
            )
        return None
