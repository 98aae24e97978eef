"""MindFormers on MindSpore: the parallel section of its YAML config.

MindSpore's parallel optimizer shards the optimizer (ZeRO-1) and nothing more; torch.compile does
not apply. The default target for the MindSpore probe, or a space over MindSpore's own settings.
Not a backend preset: the ``mindspore`` backend is autotune's own MindSpore probe.
"""

from __future__ import annotations

from autotune.export._mindformers import MindFormersExporter

from ._base import Rule, Stack, compiled, param, uneven_pipeline, uses_mindspore

__all__ = ["STACK"]


def mindformers_rules(n: int) -> list[Rule]:
    return [
        (
            "ZeRO-2/3 cannot be expressed: MindSpore's parallel optimizer shards the optimizer (ZeRO-1)",
            lambda c: param(c, "zero_stage", n).astype(int) >= 2,
        ),
        ("torch.compile does not apply to MindSpore", lambda c: compiled(c, n)),
        (
            "the MindFormers export writes no first_stage_layers (MindFormers' model_config.offset is not mapped)",
            lambda c: uneven_pipeline(c, n),
        ),
    ]


STACK = Stack(
    name="mindformers",
    rules=mindformers_rules,
    memory_rule="mindspore",
    exporter=MindFormersExporter(),
    supported_versions="MindFormers 1.3 and later on MindSpore 2.4+ (checked against MindFormers' own batch rules)",
    default_when=lambda backend, accelerator, searched: uses_mindspore(backend, searched),
)
