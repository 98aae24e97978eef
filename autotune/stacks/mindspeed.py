"""MindSpeed-LLM: Megatron-LM on Ascend, with MindSpeed-LLM's Llama fusion flags.

Megatron's rules, exporter (``launch_megatron.sh``, ``STACK_ARGS`` for this target) and launch,
plus ``export._megatron.MINDSPEED_FLAGS`` and MindSpeed's context-parallel algorithm; the default
target on NPUs.
"""

from __future__ import annotations

from autotune.export._megatron import MINDSPEED_FLAGS
from autotune.workers.parameters import value

from ._base import PresetLaunch, PresetRun, Stack, uses_mindspore
from .megatron import STACK as MEGATRON, megatron_launch, megatron_rules

__all__ = ["STACK"]


def mindspeed_launch(run: PresetRun) -> PresetLaunch:
    stack_args = list(MINDSPEED_FLAGS)
    if value(run.config, "cp") > 1:
        stack_args += ["--context-parallel-algo", "megatron_cp_algo"]
    return megatron_launch(run, "mindspeed", tuple(stack_args))


STACK = Stack(
    name="mindspeed",
    rules=megatron_rules,
    memory_rule="megatron",
    exporter=MEGATRON.exporter,  # the same launch_megatron.sh
    supported_versions="MindSpeed-LLM 2.x on Megatron core_r0.8+ (flags of examples/mcore/llama2 at a9547f61)",
    default_when=lambda backend, accelerator, searched: accelerator == "npu" and not uses_mindspore(backend, searched),
    launch=mindspeed_launch,
    log_reader="mindspeed",
    entry_example="pretrain_gpt.py",
    extra_iterations=MEGATRON.extra_iterations,  # the same training_log
)
