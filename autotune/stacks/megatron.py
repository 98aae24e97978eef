"""Megatron-LM: ``pretrain_gpt.py`` under torchrun, launched with ``export._megatron``'s arguments.

The distributed optimizer shards optimizer states only (ZeRO-1); ``--recompute-method block``
counts layers per virtual stage; there is no torch.compile flag. MindSpeed-LLM
(:mod:`autotune.stacks.mindspeed`) shares the rules, the exporter and the launch.
"""

from __future__ import annotations

import numpy as np

from autotune.export._megatron import MegatronExporter, megatron_args, model_args
from autotune.workers.parameters import value

from ._base import (
    PresetLaunch,
    PresetRun,
    Rule,
    Stack,
    compiled,
    mindspore_only,
    param,
    partial_recompute,
    uses_mindspore,
)

__all__ = ["STACK", "megatron_launch", "megatron_rules"]


def megatron_rules(n: int) -> list[Rule]:
    return [
        (
            "ZeRO-2/3 cannot be expressed: Megatron's --use-distributed-optimizer shards optimizer states only "
            "(ZeRO-1)",
            lambda c: param(c, "zero_stage", n).astype(int) >= 2,
        ),
        (
            "recompute_layers must be a multiple of vpp: --recompute-method block counts layers per virtual stage",
            lambda c: (
                partial_recompute(c, n)
                & (param(c, "vpp", n).astype(int) > 1)
                & np.array(
                    [
                        (v or 0) % max(int(p), 1) != 0
                        for v, p in zip(np.asarray(param(c, "recompute_layers", n), dtype=object), param(c, "vpp", n))
                    ]
                )
            ),
        ),
        ("torch.compile has no Megatron flag", lambda c: compiled(c, n)),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: mindspore_only(c, n)),
    ]


def megatron_launch(run: PresetRun, flavour: str = "megatron", stack_args: tuple[str, ...] = ()) -> PresetLaunch:
    """The model's architecture and the trial's parallel, batch, recompute, optimizer-sharding and
    precision arguments, the stack's own flags, ``--train-iters``, ``--log-interval 1``,
    ``--log-throughput``, ``--eval-iters 0``, then ``args`` (data, tokenizer: argparse keeps the
    last value, so the team's own flags win)."""
    config = run.config
    argv = [
        *run.launcher,
        *run.entry,
        *model_args(run.model, run.workload, flavour),
        *stack_args,
        *megatron_args(config, run.global_batch_size, run.layers, flavour),
        "--train-iters",
        str(run.iterations),
        "--log-interval",
        "1",
        "--log-throughput",
        "--eval-iters",
        "0",
        *run.user,
    ]
    env = {}
    if value(config, "tp") > 1 or value(config, "cp") > 1:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron's validate_args requires it for tp/cp > 1
    return PresetLaunch(argv, env)


STACK = Stack(
    name="megatron",
    rules=megatron_rules,
    memory_rule="megatron",
    exporter=MegatronExporter(),
    supported_versions="Megatron-LM core_r0.12 and later (checked: main at d98e8a64, megatron-core 0.16)",
    default_when=lambda backend, accelerator, searched: accelerator != "npu" and not uses_mindspore(backend, searched),
    launch=megatron_launch,
    log_reader="megatron",
    entry_example="pretrain_gpt.py",
    # Megatron-LM core_v0.16+ logs iteration 1 without resetting its timer: the first line after
    # warm-up averages warm-up in and is not measured (stack_logs._megatron), so one more runs
    extra_iterations=1,
)
