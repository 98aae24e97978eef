"""The production stacks a study tunes for (the spec's ``target:``) and runs as the probe (stack presets).

One :class:`Stack` per stack, in its own module, registered here: what the space may contain for
it, its memory rule, its exporter, its preset launch and log reader, its supported versions, the
workloads it is a target of and when it is the default target. The training stacks (Megatron-LM,
MindSpeed-LLM, DeepSpeed, torchtitan, MindFormers) are targets of ``train`` (and ``infer``); the
serving engines (vLLM / vLLM-Ascend, MindIE) of ``serve``.
Everything else asks this registry: :mod:`autotune.spec.space` (rules),
:mod:`autotune.spec.context` (memory rule), :mod:`autotune.export` (exporters and their refusals),
:mod:`autotune.dispatch.backends` and :mod:`autotune.dispatch.stack_presets` (the preset launch). The spec reads
the names ``target:`` and ``backend.kind`` accept from the leaf :mod:`autotune.spec.stack_names`, so it
imports no stack; ``tests/test_import_graph.py`` holds that leaf to this registry, and this
package never imports the spec. Adding a stack is one module, one ``register`` line below and
its names in :mod:`autotune.spec.stack_names` (docs/ARCHITECTURE.md, "Adding a stack").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ._base import MINDSPORE_PARAMS, PresetLaunch, PresetRun, Rule, Stack, fact_columns

if TYPE_CHECKING:
    from autotune.export import Exporter

__all__ = [
    "MINDSPORE_PARAMS",
    "STACKS",
    "target_of",
    "PresetLaunch",
    "PresetRun",
    "Rule",
    "Stack",
    "default_target",
    "exporters",
    "fact_columns",
    "format_targets",
    "get",
    "memory_rule",
    "names",
    "preset",
    "preset_names",
    "register",
    "supported_versions",
    "target_format",
    "targets_of",
    "target_violations",
    "unregister",
    "unsupported_reasons",
]

STACKS: dict[str, Stack] = {}  # by name, in registration order (the first stack of a shared format is its default)

# names a stack cannot take: `target: none` is "no stack in mind"; a preset's name is a backend kind;
# an exporter's name is an export format beside autotune's own
RESERVED_NAMES = ("none", "auto", "simulate", "command", "torch", "mindspore")
OWN_FORMATS = ("yaml", "env")
FALLBACK_MEMORY_RULE = "megatron"  # `target: none`: the simulator's default rule
FALLBACK_FORMAT = "megatron"  # `target: none`: the launch a finished (training) study is exported as
FALLBACK_SERVE_FORMAT = "vllm"  # `target: none` of a serving study


def register(stack: Stack) -> Stack:
    """Add ``stack`` to the registry (its name and its exporter's format must be new; a
    serving engine's exporter writes a serving launch, a training stack's a training one)."""
    if stack.name in STACKS:
        raise ValueError(f"stack {stack.name!r} is registered already")
    if stack.name in RESERVED_NAMES:
        raise ValueError(f"{stack.name!r} cannot name a stack: it means something else ({', '.join(RESERVED_NAMES)})")
    fmt = stack.exporter.name
    if not fmt or fmt in OWN_FORMATS:
        raise ValueError(f"stack {stack.name!r}: its exporter needs a name other than {', '.join(OWN_FORMATS)}")
    clash = [s.name for s in STACKS.values() if s.exporter.name == fmt and s.exporter is not stack.exporter]
    if clash:
        raise ValueError(
            f"stack {stack.name!r}: export format {fmt!r} is another exporter's already "
            f"(stack {clash[0]}); stacks share a format by sharing its exporter"
        )
    launches = "serve" if stack.serving else "train"
    if stack.exporter.launches != launches:
        raise ValueError(
            f"stack {stack.name!r} is a target of {', '.join(stack.workloads)}: its exporter must write a "
            f"{launches} launch (Exporter.launches), not {stack.exporter.launches!r}"
        )
    STACKS[stack.name] = stack
    # the exporter refuses a config by its stacks' rules (the registry tells it: formats never
    # import the stacks, which hold them)
    stack.exporter.targets = (*stack.exporter.targets, stack.name)
    stack.exporter.target_rules = unsupported_reasons
    return stack


def unregister(name: str) -> Stack:
    """Remove a stack (tests, plugins); returns it."""
    stack = STACKS.pop(name)
    stack.exporter.targets = tuple(t for t in stack.exporter.targets if t != name)
    return stack


def get(name: str) -> Stack:
    """The stack called ``name``; a ValueError naming the registered ones otherwise."""
    try:
        return STACKS[name]
    except KeyError:
        raise ValueError(f"unknown target {name!r}; expected one of {', '.join(STACKS)}") from None


def names() -> tuple[str, ...]:
    """Every registered stack: what ``target:`` accepts (besides ``none``)."""
    return tuple(STACKS)


def preset(kind: str) -> Stack | None:
    """The stack that ``backend: {kind: KIND}`` runs as the probe, or None."""
    stack = STACKS.get(kind)
    return stack if stack is not None and stack.preset else None


def preset_names() -> tuple[str, ...]:
    """The backend presets: stacks with a launch and a log reader."""
    return tuple(name for name, stack in STACKS.items() if stack.preset)


def targets_of(workload_kind: str) -> tuple[str, ...]:
    """The stacks ``target:`` may name for a workload of this kind."""
    return tuple(name for name, stack in STACKS.items() if workload_kind in stack.workloads)


def default_target(
    backend_kind: str, accelerator: str, searched: tuple[str, ...] = (), *, workload_kind: str = "train"
) -> str:
    """The stack a spec without ``target:`` is tuned for: the one of the workload's stacks whose
    ``default_when`` holds (training: MindFormers for MindSpore probes or a space over MindSpore's
    own settings, MindSpeed-LLM on Ascend, Megatron-LM elsewhere; serving: vLLM on every
    accelerator, MindIE only for its own preset, ``backend: mindie``); ``none`` when no
    registered stack claims the combination."""
    for stack in STACKS.values():
        if workload_kind not in stack.workloads or stack.default_when is None:
            continue
        if stack.default_when(backend_kind, accelerator, tuple(searched)):
            return stack.name
    return "none"


def target_of(spec: Any) -> str:
    """The stack a spec is tuned for: its ``target:``, or :func:`default_target` for its backend,
    accelerator, searched parameters and workload. The registry answers, not the schema: the spec
    (:mod:`autotune.spec.schema`) imports no stack."""
    return spec.target or default_target(
        spec.backend.kind, spec.cluster.accelerator, tuple(spec.space.choices()), workload_kind=spec.workload.kind
    )


def target_violations(
    target: str, cols: dict[str, np.ndarray], n: int, facts: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """``{reason: bool array}``: which of ``n`` configs (as columns) ``target`` cannot launch;
    ``facts`` (``{"accelerator", "model", "workload"}``) are what the rules know of the study."""
    return get(target).violations(cols, n, facts)


def unsupported_reasons(target: str, config: dict[str, Any], facts: Mapping[str, Any] | None = None) -> list[str]:
    """Why ``target`` cannot launch this one config (empty when it can)."""
    return get(target).unsupported(config, facts)


def memory_rule(target: str, backend_kind: str) -> str:
    """The memory rule the model prices: the probe's own when autotune's torch probe measures
    (its peaks are what a probe can run out of), else the target stack's."""
    if backend_kind == "torch":
        return "torch-probe"
    stack = STACKS.get(target)
    return stack.memory_rule if stack is not None and stack.memory_rule else FALLBACK_MEMORY_RULE


def exporters() -> dict[str, Exporter]:
    """Each stack's exporter by format name, in registration order (a shared one once)."""
    out: dict[str, Exporter] = {}
    for stack in STACKS.values():
        out.setdefault(stack.exporter.name, stack.exporter)
    return out


def format_targets(fmt: str) -> tuple[str, ...]:
    """The stacks export format ``fmt`` launches (empty for autotune's own yaml and env)."""
    return tuple(name for name, stack in STACKS.items() if stack.exporter.name == fmt)


def target_format(target: str, workload_kind: str = "train") -> str | None:
    """The export format that launches ``target`` for a workload of this kind (``target: none``:
    Megatron-LM's for training, vLLM's for serving); None when no launch fits (an inference
    study, or a stack that is no target of the workload)."""
    stack = STACKS.get(target)
    if stack is None:
        fallback = {"train": FALLBACK_FORMAT, "serve": FALLBACK_SERVE_FORMAT}.get(workload_kind)
        return fallback if fallback in exporters() else None
    if workload_kind not in stack.workloads or (workload_kind == "infer"):
        return None
    return stack.exporter.name


def supported_versions() -> dict[str, str]:
    """What each stack's export was checked against (tests/test_export_targets.py; docs/EXPORTS.md says the same)."""
    return {name: stack.supported_versions for name, stack in STACKS.items()}


# ---------------------------------------------------------------------------- the built-in stacks
# after the registry they register into (each stack module imports only _base)
from . import deepspeed, megatron, mindformers, mindie, mindspeed, torchtitan, vllm  # noqa: E402

register(mindspeed.STACK)
register(megatron.STACK)
register(deepspeed.STACK)
register(torchtitan.STACK)
register(mindformers.STACK)
register(vllm.STACK)
register(mindie.STACK)
