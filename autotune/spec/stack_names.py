"""The built-in stacks as the spec's schema names them: a leaf, so the schema needs no registry.

:mod:`autotune.spec.schema` builds the values ``target:`` and ``backend.kind`` accept (``Literal`` types)
and the rule "a stack preset without a default entry point needs ``backend.entry``" from these
names; :mod:`autotune.stacks` (the registry, which imports every exporter and, through them, the
simulator's columns) registers the stacks themselves. This module imports nothing of either, so
the schema stays below the registry. ``tests/test_import_graph.py`` asserts that it agrees with
the registry (names, order, presets, entry points): a stack added there is added here too.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["PresetEntry", "PRESET_ENTRIES", "STACK_NAMES", "preset_names"]


class PresetEntry(NamedTuple):
    """A backend preset's entry point: ``default`` when the spec names none (else the spec must
    name one, such as ``example``)."""

    default: str | None
    example: str


# every built-in stack, in registration order (autotune/stacks/__init__.py): what `target:` accepts
STACK_NAMES: tuple[str, ...] = ("mindspeed", "megatron", "deepspeed", "torchtitan", "mindformers", "vllm", "mindie")

# the stacks autotune runs as the probe (backend.kind), in registration order
PRESET_ENTRIES: dict[str, PresetEntry] = {
    "mindspeed": PresetEntry(None, "pretrain_gpt.py"),
    "megatron": PresetEntry(None, "pretrain_gpt.py"),
    "deepspeed": PresetEntry(None, "train.py"),
    "torchtitan": PresetEntry("-m torchtitan.train", ""),
    "vllm": PresetEntry("-m vllm.entrypoints.openai.api_server", "-m vllm.entrypoints.openai.api_server"),
    "mindie": PresetEntry("mindieservice_daemon", "mindieservice_daemon"),
}


def preset_names() -> tuple[str, ...]:
    """The backend presets, in registration order."""
    return tuple(PRESET_ENTRIES)
