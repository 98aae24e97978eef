"""A production stack's own log, read as the probe protocol (issue #15's stack presets).

A team measures the stack it ships (MindSpeed-LLM / Megatron-LM, torchtitan, DeepSpeed) rather
than autotune's probe Llama. Those stacks print their own lines, not autotune's JSON: a
:class:`StackLog` turns them into step events (streamed to the driver, so pruning works), the
probe's metrics from the measured iterations (warm-up excluded) and the stack's own failure
words (an argument check is an invalid config, not a crash). One reader per stack, each with its
source file and commit; ``tests/fixtures/stack_logs/`` holds golden logs of each format.

Runs on worker nodes: standard library only.
"""

from __future__ import annotations

from typing import Any

from ._base import StackLog
from ._deepspeed import DeepSpeedLog
from ._megatron import MegatronLog
from ._torchtitan import TorchtitanLog

__all__ = ["StackLog", "STACK_LOGS", "stack_log", "MegatronLog", "TorchtitanLog", "DeepSpeedLog"]

STACK_LOGS: dict[str, type[StackLog]] = {
    "megatron": MegatronLog,
    "mindspeed": MegatronLog,
    "torchtitan": TorchtitanLog,
    "deepspeed": DeepSpeedLog,
}


def stack_log(options: dict[str, Any]) -> StackLog:
    """The reader for ``options["kind"]`` with the rest of ``options`` (warmup, tokens_per_iteration,
    devices; samples_per_iteration for DeepSpeed)."""
    options = dict(options)
    kind = options.pop("kind")
    if kind not in STACK_LOGS:
        raise ValueError(f"no log reader for stack {kind!r}; expected one of {', '.join(STACK_LOGS)}")
    cls = STACK_LOGS[kind]
    if cls is not DeepSpeedLog:
        options.pop("samples_per_iteration", None)
    return cls(**options)
