"""DeepSpeed: a config JSON for ``deepspeed.initialize`` over every rank.

A DeepSpeed config cannot switch on model parallelism (tp/pp/cp live in the model code), nor a
selective or per-layer-count recompute. As the probe: the team's training script with
``--deepspeed_config`` pointing at the trial's JSON (``steps_per_print: 1`` so the throughput timer
prints every step), then ``args``; a DeepSpeed script has no standard flag for its step count:
``{iterations}`` in ``args`` (or ``$AUTOTUNE_ITERATIONS``) is the number of iterations to run.
"""

from __future__ import annotations

import json

from autotune.export._base import ExportContext
from autotune.export._deepspeed import DeepSpeedExporter

from ._base import PresetLaunch, PresetRun, Rule, Stack, compiled, mindspore_only, param, partial_recompute

__all__ = ["DEEPSPEED_CONFIG_FILE", "STACK"]

DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"


def deepspeed_rules(n: int) -> list[Rule]:
    return [
        (
            "a DeepSpeed config cannot express tp/pp/cp > 1 (model parallelism lives in the model code: "
            "Megatron-DeepSpeed or a PipelineModule)",
            lambda c: (
                (param(c, "tp", n).astype(int) * param(c, "pp", n).astype(int) * param(c, "cp", n).astype(int)) > 1
            ),
        ),
        (
            "DeepSpeed has no selective recompute, nor a recomputed-layer count (activation checkpointing is per "
            "block, in the model code)",
            lambda c: (param(c, "recompute", n).astype(str) == "selective") | partial_recompute(c, n),
        ),
        ("torch.compile is not set by the DeepSpeed config", lambda c: compiled(c, n)),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: mindspore_only(c, n)),
    ]


def deepspeed_launch(run: PresetRun) -> PresetLaunch:
    request = run.request
    ctx = ExportContext(
        study=request.study,
        trial=request.number,
        config=dict(run.config),
        metrics={},
        source="probe",
        model=run.model,
        workload=run.workload,
        cluster={**run.cluster, "world_size": run.devices},
    )
    ds = json.loads(DeepSpeedExporter().render(ctx))
    ds["steps_per_print"] = 1  # the throughput timer prints at every step
    argv = [*run.launcher, *run.entry, "--deepspeed_config", f"{{trial_dir}}/{DEEPSPEED_CONFIG_FILE}", *run.user]
    return PresetLaunch(argv, files={DEEPSPEED_CONFIG_FILE: json.dumps(ds, indent=1)})


STACK = Stack(
    name="deepspeed",
    rules=deepspeed_rules,
    memory_rule="deepspeed",
    exporter=DeepSpeedExporter(),
    supported_versions="DeepSpeed 0.14 and later (checked: 0.19.8)",
    launch=deepspeed_launch,
    log_reader="deepspeed",
    entry_example="train.py",
)
