"""torchtitan: its trainer (``-m torchtitan.train``) with the trial as CLI overrides.

FSDP2 shards parameters too (no ZeRO-1), bf16 mixed precision comes only through FSDP, there is
no fp16 training, activation checkpointing is per block and compile has no mode. As the probe:
``args`` first (``--module``/``--config`` of the team's job), the trial's overrides
(``export._torchtitan``), ``--training.steps``, ``--metrics.log_freq 1`` and the
activation-checkpoint subcommand last; rank 0's log only (as its run_train.sh does).
"""

from __future__ import annotations

import numpy as np

from autotune.export._torchtitan import TorchtitanExporter, activation_checkpoint_subcommand, torchtitan_args

from ._base import PresetLaunch, PresetRun, Rule, Stack, mindspore_only, param, partial_recompute, uneven_pipeline

__all__ = ["STACK"]


def torchtitan_rules(n: int) -> list[Rule]:
    def zero(c):
        return param(c, "zero_stage", n).astype(int)

    def precision(c):
        return param(c, "precision", n).astype(str)

    return [
        ("torchtitan has no ZeRO-1 (FSDP2 shards parameters too)", lambda c: zero(c) == 1),
        ("torchtitan has no fp16 training (no loss scaling)", lambda c: precision(c) == "fp16"),
        (
            "torchtitan applies bf16 mixed precision only through FSDP: bf16 needs zero_stage 2 or 3",
            lambda c: (precision(c) == "bf16") & (zero(c) < 2),
        ),
        ("torchtitan 0.3 checkpoints every block: no recomputed-layer count", lambda c: partial_recompute(c, n)),
        (
            "the torchtitan export writes no first_stage_layers (its stages are even: "
            "--parallelism.pipeline_parallel_first_stage_less_layers 0; torchtitan spreads the layers it takes "
            "off the first stage by its own rule, which is not mapped)",
            lambda c: uneven_pipeline(c, n),
        ),
        (
            "torchtitan's compile has no mode: only compile 'default' is expressible",
            lambda c: np.isin(param(c, "compile", n).astype(str), ["reduce-overhead", "max-autotune"]),
        ),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: mindspore_only(c, n)),
    ]


def torchtitan_launch(run: PresetRun) -> PresetLaunch:
    launcher = [*run.launcher[:-2], "--local-ranks-filter", "0", *run.launcher[-2:]]  # torchtitan logs on every rank
    return PresetLaunch(
        [
            *launcher,
            *run.entry,
            *run.user,
            *torchtitan_args(run.config, run.workload, run.layers),
            "--training.steps",
            str(run.iterations),
            "--metrics.log_freq",
            "1",
            activation_checkpoint_subcommand(run.config),
        ]
    )


STACK = Stack(
    name="torchtitan",
    rules=torchtitan_rules,
    memory_rule="fsdp2",
    exporter=TorchtitanExporter(),
    supported_versions="torchtitan 0.3.x (config_registry modules + CLI overrides; the TOML files of <= 0.2 are "
    "not written)",
    launch=torchtitan_launch,
    log_reader="torchtitan",
    default_entry="-m torchtitan.train",
)
