"""How a trial's allocator config is read: ``PYTORCH_NPU_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF``.

A leaf read by both sides: the simulator's columns (``workers/simulate/_columns.py``) price what
it parses, and the spec's schema (:mod:`autotune.spec.fields`) refuses, with the field's path, a
value it cannot parse, which ``plan`` would otherwise be the first to find. Imports nothing of
autotune.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["parse_alloc_conf", "truthy"]


def truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@lru_cache(maxsize=256)
def parse_alloc_conf(text: str) -> tuple[bool, float, float]:
    """(expandable_segments, max_split_size_mb, garbage_collection_threshold) of an allocator
    config string such as ``expandable_segments:True,max_split_size_mb:512``. Unknown options are
    ignored here (the allocator itself reports them at process start)."""
    expandable, split, gc = False, 0.0, 0.0
    for part in str(text).split(","):
        key, _, value = part.partition(":")
        key, value = key.strip().lower(), value.strip()
        try:
            if key == "expandable_segments":
                expandable = truthy(value)
            elif key == "max_split_size_mb":
                split = float(value)
            elif key == "garbage_collection_threshold":
                gc = float(value)
        except ValueError:
            raise ValueError(f"allocator config {text!r}: {key} expects a number, got {value!r}") from None
    return expandable, split, gc
