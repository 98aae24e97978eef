"""The spec's space section: the values a study chooses between, per canonical parameter
(docs/ARCHITECTURE.md), with ``env.VAR`` (environment variables) and ``engine.NAME`` (a serving
engine's own settings) besides them.

A range is listable (every value is enumerated: ranking, grid search), a list has no repeats, and
the values of ``env`` and ``engine`` follow the rules of :mod:`autotune.spec.fields` (no control
character, no NaN; an engine value never starts with ``-``). A module of its own because the space
is a large section read on its own (by :mod:`autotune.spec.space`); :mod:`autotune.spec.schema` re-exports it.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from .fields import EngineName, EngineSetting, EnvName, EnvSetting, Strict, _json_word

__all__ = [
    "CANONICAL_PARAMS",
    "COMPILE",
    "DERIVED_PARAMS",
    "MAX_RANGE_VALUES",
    "PRECISION",
    "RECOMPUTE",
    "SERVE_PARAMS",
    "IntRange",
    "SpaceSpec",
    "env_value",
]


def _additional_config_problem(value: Any) -> str | None:
    """Why an ``engine.additional_config`` value is not what vLLM's ``--additional-config`` takes
    (a JSON object, finite numbers only), or None."""
    if not isinstance(value, str) or value == "":
        return None if value in ("", None) else "a JSON object written as a string ('{\"key\": value}')"

    def constant(word: str) -> Any:
        raise ValueError(f"{word} is not JSON (no NaN or Infinity)")

    try:
        parsed = json.loads(value, parse_constant=constant)
    except ValueError as exc:
        return f"not a JSON object: {exc}"
    if not isinstance(parsed, dict):
        return f"a JSON object ('{{\"key\": value}}'), got {_json_word(parsed)}"
    return None


MAX_RANGE_VALUES = 100_000  # every value is enumerated (ranking, grid search): a range must stay listable


class IntRange(Strict):
    """An integer range ``low..high`` (inclusive) by ``step``; ``log`` samples on a log scale."""

    low: int
    high: int
    step: int = Field(1, gt=0)
    log: bool = False

    @model_validator(mode="after")
    def _order(self) -> "IntRange":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) is below low ({self.low})")
        count = (self.high - self.low) // self.step + 1
        if count > MAX_RANGE_VALUES:
            raise ValueError(
                f"the range has {count:,} values; at most {MAX_RANGE_VALUES:,} (raise step, or list "
                "the values worth trying)"
            )
        if self.log and (self.low <= 0 or self.step != 1):
            raise ValueError("log ranges need low > 0 and step 1")
        return self

    def values(self) -> list[int]:
        """Every value of the range, for enumeration and grid search (``log`` only changes how
        Optuna samples it)."""
        return list(range(self.low, self.high + 1, self.step))


PosInt = int
IntChoice = Union[list[PosInt], IntRange]

RECOMPUTE = ("none", "selective", "full")
PRECISION = ("bf16", "fp16", "fp32")
COMPILE = ("none", "default", "reduce-overhead", "max-autotune")


def env_value(value: Any) -> str:
    """An environment variable's value as a process sees it (YAML ``true`` is ``1``)."""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


# the engine settings only a serve workload has (fields of SpaceSpec)
SERVE_PARAMS = (
    "replicas",
    "prefill_replicas",
    "prefill_tp",
    "kv_connector",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "memory_utilization",
    "graph_mode",
)


class SpaceSpec(Strict):
    """Values per canonical parameter (docs/ARCHITECTURE.md). A parameter left out keeps its default
    (``tp``/``pp``/``cp``/``vpp`` 1, ``recompute`` none, ``zero_stage`` 0, ``precision`` bf16...)."""

    tp: IntChoice | None = None
    pp: IntChoice | None = None
    cp: IntChoice | None = None
    vpp: IntChoice | None = None
    first_stage_layers: IntChoice | None = Field(
        default=None,
        description="layers on the first pipeline stage, the rest split evenly over the others (unset: an even "
        "split); pp > 1 and vpp = 1 only",
    )
    micro_batch_size: IntChoice | None = None
    sequence_parallel: list[bool] | None = None
    recompute: list[Literal["none", "selective", "full"]] | None = None
    recompute_layers: IntChoice | None = None
    zero_stage: list[Literal[0, 1, 2, 3]] | None = None
    precision: list[Literal["bf16", "fp16", "fp32"]] | None = None
    compile: list[Literal["none", "default", "reduce-overhead", "max-autotune"]] | None = None
    graph_kernel_flags: list[str] | None = None
    jit_level: list[Literal["O0", "O1", "O2"]] | None = None
    mode: list[Literal["graph", "pynative"]] | None = None
    batch_size: IntChoice | None = None
    kv_cache_dtype: list[Literal["auto", "bf16", "fp16", "fp8", "int8"]] | None = None
    quantization: list[Literal["none", "int8", "w8a8", "int4"]] | None = None
    replicas: IntChoice | None = Field(None, description="serving: engine instances on the node, one load balancer")
    prefill_replicas: IntChoice | None = Field(
        None,
        description="serving: prefill-only instances of a disaggregated deployment (0: aggregated; from 1 the "
        "replicas decode, the KV cache sent by kv_connector)",
    )
    prefill_tp: IntChoice | None = Field(
        None, description="serving: tensor-parallel size of each prefill instance (0: the decode instances' tp)"
    )
    kv_connector: list[Literal["auto", "nixl", "mooncake", "lmcache", "shared_storage", "d2d"]] | None = Field(
        None,
        description="serving: the KV connector of a disaggregated deployment (auto: the accelerator's own; "
        "d2d: MindIE's own transfer, what auto is for target mindie)",
    )
    max_num_seqs: IntChoice | None = Field(None, description="serving: sequences the engine batches at once")
    max_num_batched_tokens: IntChoice | None = Field(None, description="serving: tokens one engine step processes")
    block_size: list[Literal[16, 32, 64, 128]] | None = Field(None, description="serving: KV-cache block, tokens")
    enable_chunked_prefill: list[bool] | None = None
    enable_prefix_caching: list[bool] | None = None
    memory_utilization: list[float] | None = Field(
        None, description="serving: device memory share the engine takes (vLLM gpu_memory_utilization)"
    )
    graph_mode: list[Literal["eager", "graph", "torchair"]] | None = Field(
        None, description="serving: eager, the engine's graph capture, or vLLM-Ascend's torchair graph"
    )
    env: dict[EnvName, list[EnvSetting]] = Field(default_factory=dict)
    engine: dict[EngineName, list[EngineSetting]] = Field(
        default_factory=dict,
        description="serving: an engine's own settings by its own names (MindIE maxIterTimes, a vLLM flag)",
    )

    @field_validator(
        "tp",
        "pp",
        "cp",
        "vpp",
        "first_stage_layers",
        "micro_batch_size",
        "recompute_layers",
        "batch_size",
        "sequence_parallel",
        "recompute",
        "zero_stage",
        "precision",
        "compile",
        "graph_kernel_flags",
        "jit_level",
        "mode",
        "kv_cache_dtype",
        "quantization",
        *SERVE_PARAMS,
    )
    @classmethod
    def _non_empty_unique(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("needs at least one value")
            if len(set(map(repr, v))) != len(v):
                raise ValueError(f"values repeat: {v}")
        return v

    @field_validator("prefill_replicas", "prefill_tp")
    @classmethod
    def _non_negative(cls, v: Any) -> Any:
        low = v.low if isinstance(v, IntRange) else min(v) if isinstance(v, list) else 0
        if low < 0:
            raise ValueError(f"values must be integers >= 0 (0: aggregated / the decode tp), got {v}")
        return v

    @field_validator("memory_utilization")
    @classmethod
    def _fraction(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(not (0 < x <= 1) for x in v):
            raise ValueError(f"memory_utilization is a share of device memory, in (0, 1]; got {v}")
        return v

    @field_validator("engine")
    @classmethod
    def _engine_values(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for name, values in v.items():
            if not values:
                raise ValueError(f"engine.{name} needs at least one value")
            if name == "additional_config":  # vLLM's --additional-config: merged into one JSON object
                for i, value in enumerate(values):
                    problem = _additional_config_problem(value)
                    if problem:
                        raise ValueError(f"engine.additional_config[{i}]: {problem}")
        return v

    @field_validator(
        "tp",
        "pp",
        "cp",
        "vpp",
        "first_stage_layers",
        "micro_batch_size",
        "recompute_layers",
        "batch_size",
        "replicas",
        "max_num_seqs",
        "max_num_batched_tokens",
    )
    @classmethod
    def _positive(cls, v: Any) -> Any:
        low = v.low if isinstance(v, IntRange) else min(v) if isinstance(v, list) else 1
        if low <= 0:
            raise ValueError(f"values must be positive integers, got {v if isinstance(v, list) else f'low={low}'}")
        return v

    @field_validator("env")
    @classmethod
    def _env_values(cls, v: dict[str, list[Any]]) -> dict[str, list[str]]:
        out = {}
        for var, values in v.items():
            if not values:
                raise ValueError(f"env.{var} needs at least one value")
            out[var] = [env_value(x) for x in values]
        return out

    def choices(self) -> dict[str, list[Any]]:
        """Every searched parameter with its values; env flattened to ``env.VAR``."""
        out: dict[str, list[Any]] = {}
        for name in type(self).model_fields:
            if name in ("env", "engine"):
                continue
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = value.values() if isinstance(value, IntRange) else list(value)
        for var, values in self.env.items():
            out[f"env.{var}"] = list(values)
        for name, values in self.engine.items():
            out[f"engine.{name}"] = list(values)
        return out

    def searched(self) -> dict[str, list[Any]]:
        """The parameters the study chooses between (more than one value), in the spec's order."""
        return {name: values for name, values in self.choices().items() if len(values) > 1}


CANONICAL_PARAMS = tuple(n for n in SpaceSpec.model_fields if n not in ("env", "engine"))
DERIVED_PARAMS = ("dp", "grad_accum", "world_size")
