"""Megatron-LM and MindSpeed-LLM: ``training_log`` lines and ``report_memory`` lines.

The formats, from the stacks' sources (tests/fixtures/stack_logs/megatron*.log and
mindspeed*.log reproduce them, one per version, each naming its commit):

- Megatron-LM ``megatron/training/training.py`` ``training_log``, printed on the last rank every
  ``--log-interval`` iterations (one line)::

     [2026-08-22 15:22:22.123456] iteration        3/      10 | consumed samples:          192 |
     elapsed time per iteration (ms): 13105.3 | throughput per GPU (TFLOP/s/GPU): 180.2 |
     learning rate: 1.500000E-04 | global batch size:    64 | lm loss: 1.043863E+01 |
     loss scale: 1.0 | grad norm: 26.203 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

  The same fields since core_r0.8.0 (baf94af3c667248865f23df73b9fb8e2395e6fd0) up to main
  (d98e8a64ddf34856e74b24714e3bedb2f5a39553); the timestamp has microseconds from core_v0.16.0
  on (commit 6cf285b2, January 2026). MindSpeed-LLM 2.0.0 (3a712f58635be8825189c65a89f27a90dc458765)
  runs core_r0.8.0's ``training_log``; 2.3.0 (1bdd97003882083da7c951fceedd71f96116be2f) has its
  own in ``mindspeed_llm/training/training.py``, which adds ``core attn ratio (%)``; its FSDP2
  trainer adds ``max_memory_allocated(GB)``;
- ``report_memory`` (``megatron/training/utils.py``, ``utils/common_utils.py`` in main), after
  the first logged iteration(s): ``[Rank 0] (after 2 iterations) memory (MB) | allocated: ... |
  max allocated: ... | reserved: ... | max reserved: ...``.

What a line's figures cover. ``elapsed time per iteration`` is the ``interval-time`` timer's
time since it was last reset over the iterations counted since then (advanced + skipped), and
the loss the mean over the advanced ones. Up to core_v0.15 every line resets both, so a line
covers the iterations since the line before (with ``--log-interval`` > 1 the first line covers
iteration 1 too). From core_v0.16.0 on (commit c40b6ea0, "better time accounting of startup
operations") ``train`` logs the first iteration with ``is_first_iteration``, which prints
without resetting (``elapsed(reset=False)``, counters kept): the next line is the mean over
iteration 1 and itself, warm-up included (1.604 s where the iteration took 1.101 s). So the line
after the first one covers from where the first one did, unless the first line is known to have
reset: its timestamp has no microseconds (every release before core_v0.16.0, MindSpeed-LLM up to
26.x) and the line after it is where an interval would put it. A line is measured only when all
it covers is past warm-up (:meth:`StackLog.step` ``covers_from``).

A skipped iteration (fp16 loss scaling found inf/NaN gradients: the optimizer returns before
clipping, stepping and copying the parameters, ``megatron/core/optimizer/optimizer.py``
``MixedPrecisionOptimizer.step``) is not an iteration's time, and its loss is not printed up to
core_v0.16 (``avg > 0.0``) and printed as ``0.000000E+00`` from core_v0.17.0 on (``avg >= 0.0``,
b09ee64a): a line that counts skipped iterations is ``skipped``, and one that counts only skipped
ones has no loss.

Failures in the stack's own words: its argument parser (``error: unrecognized arguments``) and
``validate_args`` assertions (an invalid config, not a crash), the NCCL watchdog's collective
timeout and HCCL's notify-wait timeout; its NaN check (``--check-for-nan-in-loss-and-grad``, on
by default), which stops the run rather than count the iteration:

- core_r0.8.0 ``pretrain_gpt.py`` ``loss_func``: ``AssertionError: Rank 0: found NaN in local
  forward loss calculation. Device: 0, node: ...`` (``megatron/core/distributed/
  param_and_grad_buffer.py``: ``found NaN in local grad norm in backward pass ...``);
- MindSpeed-LLM 2.0.0 ``pretrain_gpt.py``: the same words as a ``ValueError``;
- core_r0.10.0 up to main, MindSpeed-LLM 2.3.0: ``megatron/core/rerun_state_machine.py``
  ``validate_result``; with ``--rerun-mode disabled`` (the default up to core_v0.13)
  ``RuntimeError: Rank 1, node ..., device 1, iteration 4: Unexpected result nan
  (message='found NaN in local forward loss calculation')`` (a 0-dim tensor formats as its
  item); with ``validate_results`` (the default from core_v0.14.0 on) the same words logged
  (``Unexpected result nan on rank 0 at iteration #4 ... (message='found NaN in ...')``), a
  rerun, and exit status 16 or 17;

and fp16 loss scaling that skipped every measured iteration, or NaN iterations counted in them
(``--no-check-for-nan-in-loss-and-grad``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from ._base import StackLog, all_skipped, number

__all__ = ["MegatronLog"]

_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)")
# training_log's timestamp: '%Y-%m-%d %H:%M:%S' up to core_v0.15, '%Y-%m-%d %H:%M:%S.%f' after
_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\]\s*iteration\b")
_MEMORY = re.compile(r"memory \(MB\)\s*\|(.*)")
# where an iteration line begins inside another line: its timestamp, or "iteration N/M" without one
_JOINED_ITERATION = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\]|\biteration\s+\d+\s*/\s*\d+")
_ARGPARSE = re.compile(r"error: (unrecognized arguments|argument --|the following arguments are required)")
_COLLECTIVE_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|EI0002|HCCL[^\n]*time(?:d)? ?out", re.IGNORECASE
)
# the NaN/Inf checks of pretrain_gpt.py's loss_func and of the DDP grad buffers, in every
# version's words (AssertionError, ValueError, RuntimeError or the rerun machine's log line)
_NAN_CHECK = re.compile(r"found (?:NaN|Inf) in local (?:forward loss calculation|grad norm)")


class MegatronLog(StackLog):
    name = "megatron"
    missing = "no Megatron iteration line: keep --log-interval 1 and the last rank's output"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nan_iterations = 0
        self.skipped_iterations = 0
        # the last line: (iteration, first iteration it covers, whether it reset the timer), and how many
        self._last: tuple[int, int, bool] | None = None
        self._lines = 0

    def parse(self, line: str) -> list[dict[str, Any]]:
        # the memory report, on its own line or joined to an iteration line: rank 0 prints it to
        # another stream, and two streams read through one pipe can interleave without a newline
        # between them (a loaded machine's test run read "... nan iterations: 0 |[Rank 0] (after 1
        # iterations) memory (MB) | ..." and kept no peak; another, the report first, lost a step)
        memory = _MEMORY.search(line)
        if memory:
            # ... in either order: an iteration line joined after the report starts at its
            # timestamp (or at "iteration N/M" without one), where the report's fields end
            tail = memory.group(1)
            joined = _JOINED_ITERATION.search(tail)
            self._memory(_fields(tail[: joined.start()] if joined else tail))
            line = line[: memory.start()] + (tail[joined.start() :] if joined else "")
        m = _ITERATION.search(line)
        if m:
            return self._iteration(int(m.group(1)), _fields(m.group(3)), _STAMP.search(line))
        return []

    def _memory(self, fields: dict[str, float]) -> None:
        peak = fields.get("max allocated")
        if peak is not None:
            self.note_memory(peak / 1024.0)
        reserved = fields.get("max reserved")
        if reserved is not None and math.isfinite(reserved):
            gib = reserved / 1024.0
            self.peak_reserved_gib = gib if self.peak_reserved_gib is None else max(self.peak_reserved_gib, gib)

    def _covers_from(self, iteration: int, stamp: re.Match | None) -> int:
        """The first iteration the line at ``iteration`` averages over (see the module's docstring)."""
        if iteration in self._seen:  # a repeat; step() drops it
            return iteration
        self._lines += 1
        if self._last is None:
            # the first line covers the run's start; it reset the timer where its timestamp says
            # a release before core_v0.16.0 (no microseconds), else maybe not
            self._last = (iteration, 1, bool(stamp) and stamp.group(1) is None)
            return 1
        previous, previous_from, previous_reset = self._last
        if self._lines == 2 and previous_reset and iteration > previous and previous % (iteration - previous):
            # a version that resets prints on multiples of --log-interval only: a first line off
            # that grid was main's first-iteration line (one that did not reset)
            previous_reset = False
        covers_from = previous + 1 if previous_reset else previous_from
        self._last = (iteration, covers_from, True)
        return covers_from

    def _iteration(self, iteration: int, fields: dict[str, float], stamp: re.Match | None) -> list[dict[str, Any]]:
        covers_from = self._covers_from(iteration, stamp)
        span = max(1, iteration - covers_from + 1)  # the iterations the line's counters count
        ms = fields.get("elapsed time per iteration (ms)")
        loss = fields.get("lm loss")
        if loss is None:
            loss = next((v for k, v in fields.items() if k.endswith("loss") and k != "loss scale"), None)
        skipped = int(fields.get("number of skipped iterations", 0) or 0)
        nans = int(fields.get("number of nan iterations", 0) or 0)
        if skipped >= span:
            loss = None  # the mean over no advanced iteration: absent up to core_v0.16, 0.0 in main
        memory = fields.get("max_memory_allocated(GB)")
        events = self.step(
            iteration,
            covers_from=covers_from,
            step_time_s=ms / 1000.0 if ms is not None else None,
            loss=loss,
            tflops_per_device=fields.get("throughput per GPU (TFLOP/s/GPU)"),
            skipped_iterations=skipped,
            nan_iterations=nans,
            peak_memory_gib=memory,
            skipped=True if skipped else None,
        )
        if events and events[0]["phase"] == "measure":
            self.skipped_iterations += skipped
            self.nan_iterations += nans
        return events

    def failure(self, lines: list[str]) -> tuple[str, str] | None:
        for line in reversed(lines):  # first: a NaN stops a run that may then time out, and it
            if _NAN_CHECK.search(line):  # raises an AssertionError that is not validate_args'
                return "nan", f"Megatron's NaN check stopped the run: {line.strip()[:300]}"
        for line in reversed(lines):
            if _ARGPARSE.search(line):
                return "invalid", f"Megatron's argument parser refused the launch: {line.strip()[:300]}"
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].lstrip().startswith("AssertionError") and any(
                "arguments.py" in earlier for earlier in lines[max(0, i - 40) : i]
            ):
                return (
                    "invalid",
                    f"Megatron's argument checks (validate_args) refused the config: {lines[i].strip()[:300]}",
                )
        for line in reversed(lines):
            if _COLLECTIVE_TIMEOUT.search(line):
                return "timeout", f"collective timeout: {line.strip()[:300]}"
        return None

    def verdict(self, steps: list[dict[str, Any]]) -> tuple[str, str] | None:
        if self.nan_iterations:
            return "nan", f"Megatron counted {self.nan_iterations} NaN iteration(s) in the measured steps"
        if all_skipped(steps):
            return "nan", (
                f"fp16 loss scaling skipped every measured iteration ({self.skipped_iterations}): the "
                "gradients overflow at every loss scale tried"
            )
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
