"""Compatibility facade: the stacks now live in :mod:`autotune.stacks` (one descriptor per stack).

Only :mod:`autotune.spec` still imports ``default_target`` from here; once it imports from
:mod:`autotune.stacks`, delete this module. The old table names are read from the registry at
each access (a stack registered later is in them).
"""

from __future__ import annotations

from typing import Any

from .stacks import (MINDSPORE_PARAMS, default_target, format_targets, memory_rule, names, supported_versions,
                     target_format, target_violations, unsupported_reasons)

# and, read from the registry at each access: TARGETS, TARGET_FORMATS, FORMAT_TARGETS, SUPPORTED_VERSIONS
__all__ = ["MINDSPORE_PARAMS", "default_target", "memory_rule", "target_violations", "unsupported_reasons"]


def __getattr__(name: str) -> Any:
    if name == "TARGETS":
        return names()
    if name == "TARGET_FORMATS":
        return {target: target_format(target) for target in names()}
    if name == "FORMAT_TARGETS":
        return {fmt: format_targets(fmt) for fmt in dict.fromkeys(target_format(t) for t in names())}
    if name == "SUPPORTED_VERSIONS":
        return supported_versions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
