"""The serving engine's canonical parameters, each written once: its default, what it means, each
engine's spelling, and the rule between two of them (issue 43, "one table of parameters").

Why a table: the defaults (``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192) were written in six
files (the space, the simulator, the vLLM and MindIE stacks, both exports) and the rule
``max_num_batched_tokens >= max_num_seqs`` in three; a change to one would have left the others
pricing, checking or launching another engine. The space, the simulator, the stacks and the exports
read this module; ``tests/test_parameter_table.py`` checks that each of them agrees with it.

A leaf module (standard library only): the probes (``autotune.workers``) and the driver both read it.
The defaults are vLLM's (``vllm/engine/arg_utils.py`` / ``vllm/config/scheduler.py``) where it has
one; MindIE's ``config.json`` keys carry the same meaning under their own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Parameter:
    """One canonical serving parameter."""

    name: str  # the canonical name (spec, space, trial params, MLflow)
    default: Any  # the value when the spec does not search it
    meaning: str  # what it sets, in one line
    vllm_flag: str | None  # vLLM's engine argument (``vllm serve``)
    mindie_keys: tuple[str, ...] = ()  # MindIE config.json's ScheduleConfig / ModelConfig keys


SERVING: dict[str, Parameter] = {
    p.name: p
    for p in (
        Parameter(
            "max_num_seqs",
            256,
            "sequences one instance batches at once (its decode batch)",
            "--max-num-seqs",
            ("maxBatchSize", "maxPrefillBatchSize"),
        ),
        Parameter(
            "max_num_batched_tokens",
            8192,
            "tokens one scheduler step may process (the prefill chunk budget)",
            "--max-num-batched-tokens",
            ("maxPrefillTokens",),
        ),
        Parameter(
            "enable_chunked_prefill",
            True,
            "split long prompts into chunks scheduled with decodes (MindIE: the splitfuse plugin)",
            "--enable-chunked-prefill",
        ),
        Parameter(
            "enable_prefix_caching",
            True,
            "reuse the KV cache of a shared prompt prefix (MindIE: the prefix_cache plugin)",
            "--enable-prefix-caching",
        ),
        Parameter(
            "memory_utilization",
            0.9,
            "share of the device memory the engine may take (weights, activations, KV cache)",
            "--gpu-memory-utilization",
        ),
    )
}


def serving_default(name: str) -> Any:
    """The default of a canonical serving parameter (KeyError for a name the table does not hold)."""
    return SERVING[name].default


# the rule between two serving parameters, as vLLM's scheduler config enforces it
BATCHED_COVERS_SEQS = (
    "max_num_batched_tokens >= max_num_seqs (vllm/config/scheduler.py verify_max_model_len: a step must "
    "hold one token of every sequence)"
)


def batched_below_seqs(batched: Any, seqs: Any) -> Any:
    """Where :data:`BATCHED_COVERS_SEQS` is broken (scalars or numpy arrays, element-wise)."""
    return batched < seqs
