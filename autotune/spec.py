"""The tuning spec: one YAML file that says what to tune, where, for what, and with what budget.

Every section is a typed pydantic model with ``extra="forbid"`` so a misspelt key is an error,
never silently ignored. :func:`load_spec` turns any problem into a :class:`SpecError` whose lines
name the file, the line (where the YAML parser knows it), the dotted path of the field and what
was expected, e.g.::

    spec.yaml:14: space.recompute[1]: Input should be 'none', 'selective' or 'full' (got 'ful')

What the reader accepts (issue #31): a regular file of at most ``MAX_SPEC_BYTES`` (1 MiB; a spec
is a few KiB), never a directory, FIFO or device (refused before it is opened for reading), in
UTF-8, with or without a UTF-8 byte-order mark. A UTF-16 or UTF-32 file (with a byte-order mark,
or recognised by its NUL bytes) is refused with the way to convert it, not decoded: every other
reader of the spec (the copy kept in the run directory, ``report``, ``export``) reads UTF-8, so
one encoding keeps them all reading the same text. YAML is read with PyYAML's safe loader only
(``!!python/...`` and unknown tags are errors naming their line), as YAML 1.1 (``yes``/``no``/
``on``/``off`` are booleans, ``1:20`` is 80). A key written twice in one mapping, at any depth,
is an error naming the line of the second one and the key's path (YAML parsers silently keep
the last). Aliases (``*name``) and merge keys (``<<: *name``, ``<<: [*a, *b]``) are allowed; a key
that a merge brings in and the mapping also writes out is YAML's documented override (the
written one wins), not a duplicate, while a second ``<<`` key in one mapping is one.

Every environment variable name, wherever it enters the spec (``space.env``, ``backend.env``,
``backend.secret_env``, the ``env.VAR`` keys of ``baseline``), follows one rule,
:data:`ENV_NAME_RULE`: a POSIX shell name. The values the simulator reads
(``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_CUDA_ALLOC_CONF``, ``HCCL_BUFFSIZE``,
``MULTI_STREAM_MEMORY_REUSE``) are checked here, with their field path, not first in ``plan``.

A rendered error never carries a control, bidi or other invisible character as it is: they are
written as escapes (``\u202e``), so the text a terminal shows is the text the spec holds.

``spec`` starts no cluster and logs nothing (docs/ARCHITECTURE.md, data flow).
"""

from __future__ import annotations


import codecs
import math
import os
import re
import stat
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .models import MODEL_ALIASES, PRESETS, ModelSpec, load_hf_config
from .safe_expr import ExpressionError, compile_expression
from .stacks import STACKS, default_target, names as stack_names, preset_names

__all__ = [
    "Spec",
    "SpecError",
    "load_spec",
    "parse_spec",
    "TrainWorkload",
    "InferWorkload",
    "ClusterSpec",
    "BackendSpec",
    "SpaceSpec",
    "ObjectiveSpec",
    "SearchSpec",
    "TrackingSpec",
    "RaySpec",
    "CANONICAL_PARAMS",
    "DERIVED_PARAMS",
    "ENV_NAME_RULE",
    "MAX_SPEC_BYTES",
    "decode_spec_bytes",
    "env_name_problem",
    "env_value_problem",
    "escape_text",
    "parse_spec_text",
    "path_problem",
    "read_spec_text",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _read_hf_config(path: Path) -> dict:
    """A Hugging Face config.json, read with the spec's own bounds (a regular file, at most
    MAX_SPEC_BYTES, UTF-8); every problem is a ValueError naming the file."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ValueError(f"config.json file {path}: {exc.strerror or exc}") from None
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"config.json file {path} is {size:,} bytes; a model config is a few KiB "
                         f"(at most {MAX_SPEC_BYTES:,} bytes read)")
    try:
        return load_hf_config(path)
    except OSError as exc:
        raise ValueError(f"config.json file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config.json file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (ValueError, TypeError, LookupError, AttributeError) as exc:  # json.JSONDecodeError included
        raise ValueError(f"config.json file {path}: {exc}") from None


# ----------------------------------------------------------------------- names, values and paths
ENV_NAME_RULE = "letters A-Z a-z, digits and '_', not starting with a digit (a POSIX shell name)"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_ENV_BYTES = 128 * 1024 - 1  # Linux MAX_ARG_STRLEN: one NAME=value string of a process environment
MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX: one component of a path


def env_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be an environment variable's name, or None. The one rule for every
    name a spec gives (``space.env``, ``backend.env``, ``backend.secret_env``, ``baseline`` env.VAR):
    a name reaches ``export NAME=...`` lines and process environments, where ``X=1;touch y;#``
    or ``$(cmd)`` would be code, not a name."""
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        return f"not an environment variable name: {ENV_NAME_RULE}"
    return None


def _env_name(name: str) -> str:
    problem = env_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


EnvName = Annotated[str, AfterValidator(_env_name)]

# what the simulator reads of a trial's environment (workers/simulate/_columns.py, _row_env)
_ALLOC_CONF = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_BOOL_WORDS = ("1", "true", "yes", "on", "0", "false", "no", "off")  # _truthy's true words, and false ones
MULTI_STREAM_MEMORY_REUSE_VALUES = (0, 1, 2)


def env_value_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot be the value of environment variable ``name``, or None: a NUL (no
    process environment holds one), longer than an environment string may be, or a value the
    simulator reads (allocator configs, ``HCCL_BUFFSIZE``, ``MULTI_STREAM_MEMORY_REUSE``) and
    cannot parse, which ``plan`` would otherwise be the first to find."""
    if "\x00" in value:
        return "contains a NUL character, which no environment variable can hold"
    size = len(name) + 1 + len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_ENV_BYTES:
        return f"{name}=... is {size:,} bytes; an environment variable holds at most {MAX_ENV_BYTES:,}"
    if name in _ALLOC_CONF and value != "":
        from autotune.workers.simulate._columns import parse_alloc_conf

        try:
            parse_alloc_conf(value)
        except ValueError as exc:
            return f"{exc} (options: expandable_segments:True|False, max_split_size_mb:N, garbage_collection_threshold:F)"
        for part in value.split(","):
            key, _, option = part.partition(":")
            key, option = key.strip().lower(), option.strip()
            if key == "expandable_segments" and option.lower() not in _BOOL_WORDS:
                return f"allocator config {_short(value)}: expandable_segments expects True or False, got {_short(option)}"
            if key in ("max_split_size_mb", "garbage_collection_threshold") and not (
                    math.isfinite(float(option)) and float(option) >= 0):
                return f"allocator config {_short(value)}: {key} expects a finite number >= 0, got {_short(option)}"
    if name == "HCCL_BUFFSIZE" and value != "":
        try:
            size_mb = float(value)
        except ValueError:
            size_mb = math.nan
        if not (math.isfinite(size_mb) and size_mb > 0):
            return f"HCCL_BUFFSIZE is a buffer size in MB, a number > 0 (got {_short(value)})"
    if name == "MULTI_STREAM_MEMORY_REUSE" and value != "":
        try:
            reuse = int(value)
        except ValueError:
            reuse = None
        if reuse not in MULTI_STREAM_MEMORY_REUSE_VALUES:
            return (f"MULTI_STREAM_MEMORY_REUSE is one of {', '.join(map(str, MULTI_STREAM_MEMORY_REUSE_VALUES))} "
                    f"(got {_short(value)})")
    return None


def _env_values_of_backend(v: dict[str, str]) -> dict[str, str]:
    for name, value in v.items():
        problem = env_value_problem(name, value)
        if problem:
            raise ValueError(f"{name}: {problem}")
    return v


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot be a file system path, or None (a NUL, longer than PATH_MAX, or a
    component longer than NAME_MAX: the OS refuses those with an error, not "no such file")."""
    if "\x00" in text:
        return "a path cannot hold a NUL character"
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_PATH_BYTES:
        return f"too long for a path ({len(raw):,} bytes; at most {MAX_PATH_BYTES:,})"
    longest = max((len(part) for part in raw.split(b"/")), default=0)
    if longest > MAX_NAME_BYTES:
        return f"a path component of {longest:,} bytes is too long for a file name (at most {MAX_NAME_BYTES})"
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, shortened: an error quotes what the spec says, not megabytes of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, (str, bytes)) else f"{len(text):,} characters shown"
    return f"{text[:limit - 40]}...{text[-20:]} ({size})"


# --------------------------------------------------------------------------------------- workload
class TrainWorkload(_Strict):
    """A pre-training / fine-tuning step: what one optimizer step processes and how to probe it."""

    kind: Literal["train"] = "train"
    seq_len: int = Field(gt=0, description="tokens per sequence")
    global_batch_size: int = Field(gt=0, description="sequences per optimizer step, all data-parallel ranks")
    warmup_steps: int = Field(2, ge=0, description="probe steps run before timing starts")
    measured_steps: int = Field(5, gt=0, description="probe steps timed (median reported)")
    timeout_s: float = Field(900.0, gt=0, description="a probe running longer is killed and recorded as timeout")
    flash_attention: bool = Field(True, description="fused attention (no s^2 activation term)")
    profile_step: bool = Field(False, description="profile one step and report comm_fraction (torch probe)")


class InferWorkload(_Strict):
    """Serving: one prefill of ``prompt_len`` tokens then ``gen_len`` decode steps per batch."""

    kind: Literal["infer"] = "infer"
    prompt_len: int = Field(gt=0)
    gen_len: int = Field(gt=0)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=1)
    warmup_steps: int = Field(1, ge=0)
    measured_steps: int = Field(3, gt=0)
    timeout_s: float = Field(600.0, gt=0)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v):
            raise ValueError("batch sizes must be positive")
        return v


Workload = Union[TrainWorkload, InferWorkload]


# ---------------------------------------------------------------------------------------- cluster
class ClusterSpec(_Strict):
    """Where trials run. ``profile`` names a hardware profile (workers/hardware/*.yaml);
    ``overrides`` replaces fields of it, e.g. ``device_memory_gib: 32`` for 32 GB 910B parts."""

    accelerator: Literal["npu", "cuda", "cpu"] = "npu"
    profile: str | None = Field(None, description="hardware profile: a bundled name, or the path of a profile file "
                                                   "(relative to the spec), e.g. from `autotune calibrate`; "
                                                   "default per accelerator")
    nodes: int = Field(1, gt=0)
    devices_per_node: int = Field(8, gt=0)
    overrides: dict[str, Any] = Field(default_factory=dict)
    threads_per_rank: int | None = Field(None, gt=0, description="CPU threads per probe process (default: cores / ranks)")
    calibrate: Literal["auto", "never"] | None = Field(
        None, description="auto: a study with a real backend on a data-sheet profile first measures this host "
                          "(`autotune calibrate --quick`, cached per host and software) and ranks with that; never: "
                          "use the profile as it is. Default: the AUTOTUNE_CALIBRATE environment variable, else auto")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @field_validator("profile")
    @classmethod
    def _profile_file_relative_to_spec(cls, v: str | None, info: Any) -> str | None:
        from autotune.workers.hardware import is_profile_file

        if v is None or not is_profile_file(v):
            return v
        problem = path_problem(v)
        if problem:
            raise ValueError(f"the hardware profile file's path: {problem}")
        path = Path(v) if Path(v).is_absolute() else Path((info.context or {}).get("base_dir", ".")) / v
        if not _is_file(path):
            raise ValueError(f"hardware profile file {path} does not exist (write one with `autotune calibrate`)")
        return str(path.resolve())

    @property
    def profile_name(self) -> str:
        return self.profile or {"npu": "ascend-910b", "cuda": "a100-sxm-80gb", "cpu": "cpu"}[self.accelerator]


# ---------------------------------------------------------------------------------------- backend
STACK_PRESETS: tuple[str, ...] = preset_names()  # the stacks autotune runs as the probe (autotune.stacks)
BackendKind = Literal[("auto", "simulate", "command", "torch", "mindspore", *STACK_PRESETS)]  # type: ignore[valid-type]
BACKEND_KINDS: tuple[str, ...] = get_args(BackendKind)  # what `backend.kind` and `run --backend` accept
TargetName = Literal[(*stack_names(), "none")]  # type: ignore[valid-type]  # the registered stacks, or none


class BackendSpec(_Strict):
    """How a trial is measured. ``command`` runs ``argv`` (``{trial_file}`` is replaced by the
    trial file path) and reads the probe protocol's JSON lines, or ``metric_patterns`` regexes."""

    kind: BackendKind = "auto"
    argv: list[str] | None = None
    timeout_s: float | None = Field(None, gt=0, description="overrides workload.timeout_s")
    env: Annotated[dict[EnvName, str], AfterValidator(_env_values_of_backend)] = Field(
        default_factory=dict, description="extra environment for every probe; values of "
                                "keys that look secret (TOKEN, PASSWORD, SECRET, KEY, CREDENTIAL, AUTH) or named in "
                                "secret_env reach the probe only, and are masked in every copy autotune keeps")
    secret_env: list[EnvName] = Field(default_factory=list, description="more env keys whose values are secret")
    resources: dict[str, Any] | None = Field(
        None, description="Ray resources per trial, replacing the default derived from the cluster"
    )
    metric_patterns: dict[str, str] = Field(default_factory=dict, description="metric -> regex with one group")
    python: str | None = Field(None, description="interpreter for the mindspore/torch probe")
    launcher: Literal["auto", "warm", "spawn", "torchrun"] = Field(
        "auto", description="how the torch probe's ranks start: 'warm' forks them from a server that has imported "
                            "torch already (single node), 'spawn' starts fresh processes (single node), 'torchrun' "
                            "(any); 'auto' = warm on a single cpu node, spawn on a single accelerator node, torchrun "
                            "across nodes")
    cwd: str | None = Field(None, description="working directory of the probe; a relative path is relative to the "
                                             "spec file (default: where autotune runs)")
    entry: str | None = Field(None, description="stack presets (megatron, mindspeed, torchtitan, deepspeed): the "
                              "training entry point, a script path (pretrain_gpt.py, train.py) or '-m package.module' "
                              "(torchtitan's default: -m torchtitan.train); run under torchrun --standalone")
    args: list[str] = Field(default_factory=list, description="stack presets: the job's own arguments (data, "
                            "tokenizer, --module/--config), after autotune's (Megatron keeps the last of a repeated flag); "
                            "'{iterations}' is replaced by the iterations to run (also $AUTOTUNE_ITERATIONS)")
    iterations: int | None = Field(None, gt=0, description="stack presets: training iterations per probe (default: "
                                   "workload.warmup_steps + measured_steps; the warm-up ones are not measured)")

    @field_validator("python", "cwd", "entry")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        problem = path_problem(v.removeprefix("-m ")) if v is not None else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("metric_patterns")
    @classmethod
    def _patterns_compile(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        for metric, pattern in v.items():
            try:
                groups = re.compile(pattern).groups
            except re.error as exc:
                raise ValueError(f"the pattern for {metric!r} is not a regular expression: {exc}") from None
            if groups < 1:
                raise ValueError(f"the pattern for {metric!r} needs a group around the number, e.g. "
                                 f"'{metric}[=:] *([0-9.eE+-]+)'")
        return v

    @model_validator(mode="after")
    def _argv_for_command(self) -> "BackendSpec":
        if self.kind == "command" and not self.argv:
            raise ValueError("backend kind 'command' needs argv, a list such as [python, train.py, --trial, '{trial_file}']")
        if self.kind != "command" and self.argv:
            raise ValueError(f"argv is only used by backend kind 'command', not {self.kind!r}")
        if self.kind in STACK_PRESETS and not STACKS[self.kind].default_entry and not self.entry:
            raise ValueError(f"backend kind {self.kind!r} needs entry, the training script "
                             f"({STACKS[self.kind].entry_example})")
        if self.kind not in STACK_PRESETS and (self.entry or self.args or self.iterations):
            raise ValueError(f"entry, args and iterations are for the stack presets (kind {', '.join(STACK_PRESETS)}), "
                             f"not {self.kind!r}")
        return self


# ------------------------------------------------------------------------------------------ space
MAX_RANGE_VALUES = 100_000  # every value is enumerated (ranking, grid search): a range must stay listable
MAX_SPEC_INT = 2**53 - 1  # beyond this an integer cannot be a size, and JSON (Optuna storage) cannot keep it


class IntRange(_Strict):
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
            raise ValueError(f"the range has {count:,} values; at most {MAX_RANGE_VALUES:,} (raise step, or list "
                             "the values worth trying)")
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


class SpaceSpec(_Strict):
    """Values per canonical parameter (docs/ARCHITECTURE.md). A parameter left out keeps its default
    (``tp``/``pp``/``cp``/``vpp`` 1, ``recompute`` none, ``zero_stage`` 0, ``precision`` bf16...)."""

    tp: IntChoice | None = None
    pp: IntChoice | None = None
    cp: IntChoice | None = None
    vpp: IntChoice | None = None
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
    kv_cache_dtype: list[Literal["bf16", "fp16", "fp8", "int8"]] | None = None
    quantization: list[Literal["none", "int8", "w8a8", "int4"]] | None = None
    env: dict[EnvName, list[Union[str, int, float, bool]]] = Field(default_factory=dict)

    @field_validator(
        "tp", "pp", "cp", "vpp", "micro_batch_size", "recompute_layers", "batch_size",
        "sequence_parallel", "recompute", "zero_stage", "precision", "compile", "graph_kernel_flags",
        "jit_level", "mode", "kv_cache_dtype", "quantization",
    )
    @classmethod
    def _non_empty_unique(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("needs at least one value")
            if len(set(map(repr, v))) != len(v):
                raise ValueError(f"values repeat: {v}")
        return v

    @field_validator("tp", "pp", "cp", "vpp", "micro_batch_size", "recompute_layers", "batch_size")
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
            if name == "env":
                continue
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = value.values() if isinstance(value, IntRange) else list(value)
        for var, values in self.env.items():
            out[f"env.{var}"] = list(values)
        return out


CANONICAL_PARAMS = tuple(n for n in SpaceSpec.model_fields if n != "env")
DERIVED_PARAMS = ("dp", "grad_accum", "world_size")


# ------------------------------------------------------------------------------------- objectives
class ObjectiveSpec(_Strict):
    metric: str
    direction: Literal["maximize", "minimize"] | None = Field(None, description="default: the metric's own")


class SearchSpec(_Strict):
    """Budget and strategy. ``auto`` lets autotune choose (simulator ranking, then model-guided)."""

    n_trials: int = Field(20, gt=0, description="probes to run (configs measured)")
    parallel_trials: int = Field(1, gt=0)
    sampler: Literal["auto", "tpe", "nsga2", "gp", "random", "grid", "exhaustive"] = "auto"
    seed: int | None = Field(0, ge=0, lt=2**32, description="sampler seed (numpy's range: 0 <= seed < 2**32)")
    timeout_s: float | None = Field(None, gt=0, description="stop starting new trials after this long")
    exhaustive_limit: int = Field(2_000_000, gt=0, description="largest space ranked exhaustively by the simulator")
    prune: bool = Field(True, description="stop a real probe early once its measured steps are confidently slower "
                                          "than the best trial's (throughput and step-time objectives)")
    prune_margin: float = Field(0.5, gt=0, description="stop when the median measured step time exceeds the best's "
                                                       "by more than this fraction (0.5: 50 %, above run-to-run noise)")
    prune_min_steps: int = Field(2, ge=1, description="measured steps a probe shows before it may be stopped")
    stop_early: bool = Field(True, description="sampler auto: stop before the budget when the model's optimistic "
                                               "bound of every remaining config is below the best measured")
    explore_kappa: float = Field(1.0, ge=0, description="sampler auto: optimism of the next pick, in standard "
                                                        "deviations of the model's uncertainty")
    fit_confidence: float = Field(0.95, gt=0, lt=1, description="sampler auto: probability of fitting in memory the "
                                                                "first probe needs (nothing measured yet)")
    min_fit_probability: float = Field(0.5, gt=0, lt=1, description="sampler auto: the least probability of fitting "
                                       "in memory a config needs to be probed while likelier ones remain; higher: "
                                       "fewer OOM probes, a near-limit optimum found later (benchmarks/README.md)")
    max_oom_share: float | None = Field(0.05, gt=0, lt=1, description="sampler auto: cap on OOM probes, as a share "
                                        "of n_trials (at least one); past it only configs fit_confidence likely to fit "
                                        "are probed; null: no cap (benchmarks/README.md shows the trade-off)")


class RecommendSpec(_Strict):
    """Which config the study recommends and exports (autotune/recommend.py states the rule)."""

    min_headroom_gib: float | None = Field(4.0, ge=0, description="when the best leaves less device memory free, "
                                           "recommend the best config within `tolerance` of it that leaves this much; "
                                           "null: always the best")
    tolerance: float | None = Field(None, gt=0, lt=1, description="how close to the best counts as as good (a share); "
                                    "default: the simulator's error on published runs (5.3 %) for predictions, the "
                                    "measurement noise (3 %) for measured trials")


class TrackingSpec(_Strict):
    mlflow_uri: str | None = Field(None, description="default: SQLite file in the run directory")
    experiment: str | None = Field(None, description="default: the spec name")
    storage: str | None = Field(None, description="Optuna storage URL; default: a journal file in the run directory")


class RaySpec(_Strict):
    address: str | None = Field(None, description="None starts a local Ray; 'auto' or ray://host:port connects")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray (default: the machine's)")
    enabled: bool = Field(True, description="false runs real probes as local subprocesses without Ray")
    placement_timeout_s: float = Field(120.0, gt=0, description="how long a trial spanning several nodes waits for "
                                       "its placement group (one bundle per node) before it is an infrastructure "
                                       "failure")


def _baseline_key(key: str) -> str:
    if key.startswith("env."):
        problem = env_name_problem(key[4:])
        if problem:
            raise ValueError(f"{problem} (an env.VAR key sets the environment variable VAR)")
    return key


BaselineKey = Annotated[str, AfterValidator(_baseline_key)]


class Spec(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    model: ModelSpec
    workload: Workload = Field(discriminator="kind")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    backend: BackendSpec = Field(default_factory=BackendSpec)
    space: SpaceSpec = Field(default_factory=SpaceSpec)
    constraints: list[str] = Field(default_factory=list)
    objectives: list[ObjectiveSpec] = Field(default_factory=list)
    baseline: dict[BaselineKey, Any] | None = None
    target: TargetName | None = Field(
        None, description="the stack that will run the chosen config in production; the space keeps only configs it can "
                          "launch and the exports launch exactly the measured config (default: mindformers for the "
                          "mindspore backend, mindspeed on npu, megatron elsewhere); 'none': no stack in mind, the "
                          "space is not restricted and each export format refuses what it cannot launch")
    search: SearchSpec = Field(default_factory=SearchSpec)
    recommend: RecommendSpec = Field(default_factory=RecommendSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    ray: RaySpec = Field(default_factory=RaySpec)

    source_path: Path | None = Field(None, exclude=True, description="set by load_spec")

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, v: Any, info: Any) -> Any:
        base = Path((info.context or {}).get("base_dir", "."))
        if isinstance(v, str):
            if v in PRESETS:
                return {"name": v, **PRESETS[v]}
            problem = path_problem(v)
            if problem:  # neither a preset nor a path the OS could open
                raise ValueError(f"unknown model preset {_short(v)}; presets: {', '.join(PRESETS)}; or a path to "
                                 f"a config.json, and as a path: {problem}")
            path = Path(v) if Path(v).is_absolute() else base / v
            if v.endswith(".json") or _is_file(path):
                if not _is_file(path):
                    raise ValueError(f"config.json file {path} does not exist (or is not a regular file)")
                return _read_hf_config(path)
            raise ValueError(f"unknown model preset {_short(v)}; presets: {', '.join(PRESETS)}; or a path to a "
                             "config.json")
        if isinstance(v, dict) and "preset" in v:
            preset = v["preset"]
            if not isinstance(preset, str) or preset not in PRESETS:
                raise ValueError(f"unknown model preset {_short(preset)}; presets: {', '.join(PRESETS)}")
            rest = {k: x for k, x in v.items() if k != "preset"}
            return {"name": preset, **PRESETS[preset], **rest}
        return v

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_name(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v

    @field_validator("objectives", mode="before")
    @classmethod
    def _objective_names(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [{"metric": x} if isinstance(x, str) else x for x in v]
        return v

    # ---- derived views -----------------------------------------------------------------------
    @property
    def is_training(self) -> bool:
        return self.workload.kind == "train"

    @property
    def target_stack(self) -> str:
        """``target``, or the default for the backend and accelerator (:func:`autotune.stacks.default_target`)."""
        return self.target or default_target(self.backend.kind, self.cluster.accelerator, tuple(self.space.choices()))

    def objective_list(self) -> list[tuple[str, str]]:
        """(metric, direction) pairs with defaults applied."""
        from autotune.objectives import get_metric

        objectives = self.objectives or [
            ObjectiveSpec(metric="tokens_per_s_per_device" if self.is_training else "decode_tokens_per_s")
        ]
        return [(o.metric, o.direction or get_metric(o.metric).direction) for o in objectives]

    def summary(self) -> str:
        w = self.workload
        work = (f"train seq {w.seq_len} gbs {w.global_batch_size}" if isinstance(w, TrainWorkload)
                else f"infer prompt {w.prompt_len} gen {w.gen_len}")
        objs = ", ".join(f"{m} ({d[:3]})" for m, d in self.objective_list())
        n = self.model.num_parameters()
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        return (f"{self.name}: {self.model.name} ({size} params), {work}, "
                f"{self.cluster.nodes}x{self.cluster.devices_per_node} {self.cluster.accelerator} "
                f"({self.cluster.profile_name}), {len(self.space.choices())} searched params, "
                f"backend {self.backend.kind}, target {self.target_stack}, objectives {objs}, "
                f"budget {self.search.n_trials} trials")


# ----------------------------------------------------------------------------------------- errors
@dataclass
class SpecProblem:
    loc: tuple[Any, ...]
    message: str
    line: int | None = None

    def render(self, file: str) -> str:
        """``file:line: path: message`` on one line, every control, bidi or invisible character
        escaped (a U+202E in a key would otherwise reverse the text the terminal shows)."""
        where = f"{escape_text(file)}:{self.line}" if self.line else escape_text(file)
        path = escape_text(_dotted(self.loc))
        message = escape_text(self.message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS - 500]} ... {message[-400:]}"
        return f"{where}: {path}: {message}" if path else f"{where}: {message}"


MAX_MESSAGE_CHARS = 2000
# C0/C1 controls, format characters (bidi overrides and isolates, zero-width ones, the BOM), lone
# surrogates, line and paragraph separators
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def escape_text(text: str) -> str:
    """``text`` with every character a terminal would not show as itself written as an escape
    (``\\n``, ``\\x1b``, ``\\u202e``); everything else, non-ASCII letters included, as it is."""
    if text.isprintable():  # the usual case; isprintable() is False for all of the above
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) not in _UNSAFE_CATEGORIES:
            out.append(ch)
        elif ch in "\n\t\r":
            out.append(repr(ch)[1:-1])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


class SpecError(ValueError):
    """The spec cannot be used; ``problems`` has one entry per thing to fix."""

    def __init__(self, file: str, problems: list[SpecProblem]):
        self.file = file
        self.problems = problems
        super().__init__("\n".join(p.render(file) for p in problems))


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            text = str(part)
            out += ("." if out else "") + (text if len(text) <= 100 else f"{text[:60]}...({len(text):,} characters)")
    return out


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at ``loc``, or of its nearest existing parent."""
    best = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            # the last of the keys that match: a key written out after a merge (<<) brought the same one
            nxt = next((v for k, v in reversed(node.value) if getattr(k, "value", None) == str(part)), None)
            if nxt is None:
                return best
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            continue  # pydantic adds union/tag names (e.g. 'train', 'list[int]') that YAML lacks
        node = nxt
        best = node.start_mark.line + 1
    return best


_LABELS = ("IntRange", "train", "infer", "function-after[_check_shapes(), ModelSpec]", "BackendSpec")


def _clean_loc(loc: tuple[Any, ...], data: Any = None) -> tuple[Any, ...]:
    """Drop pydantic's union-branch labels (``list[int]``, ``IntRange``, ``train``, ``[key]``) from
    a path. A part that is a key of the spec's own data at that point is the user's, kept
    whatever it holds (a key ``"\x1b[31mtp"`` has a bracket, and is no label)."""
    out = []
    node = data
    for part in loc:
        if isinstance(node, dict) and not isinstance(part, int) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(part, int) or ("[" not in str(part) and str(part) not in _LABELS):
            node = None  # a field the data lacks (missing), or one made by a validator: no data below
        else:
            continue
        out.append(part)
    return tuple(out)


def _format_pydantic(exc: ValidationError, data: Any = None) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    seen: set[tuple] = set()
    for err in exc.errors(include_url=False):
        loc = _clean_loc(tuple(err["loc"]), data)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {loc[-1]!r}" if loc else "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg += f" (got {_short(err['input'])})"
        key = (loc, msg)
        if key in seen:
            continue
        seen.add(key)
        problems.append(SpecProblem(loc, msg))
    # A value that fits no branch of a union yields one error per branch; keep the most specific.
    by_loc: dict[tuple, list[SpecProblem]] = {}
    for p in problems:
        by_loc.setdefault(p.loc, []).append(p)
    out = []
    for ps in by_loc.values():
        # a mapping given where a list or a range fits: the list branch's "valid list" says nothing
        specific = [p for p in ps if not p.message.startswith(("Input should be a valid list",
                                                                "Input should be a valid dictionary"))]
        out += specific or ps
    return out


def _sample_env(choices: dict[str, list[Any]], names: frozenset[str]) -> dict[str, Any]:
    """One value of the right type for each name a constraint reads (the first searched value,
    else the default, else 1): evaluating on it finds type errors at validation, not in ``plan``."""
    from .space import INFER_DEFAULTS, TRAIN_DEFAULTS

    defaults = {**INFER_DEFAULTS, **TRAIN_DEFAULTS}
    return {n: choices[n][0] if choices.get(n) else defaults.get(n, 1) for n in names}


def _semantic_problems(spec: Spec) -> list[SpecProblem]:
    """Checks across sections that field types cannot express."""
    from autotune.objectives import METRICS
    from autotune.workers.hardware import available_profiles, is_profile_file, load_profile

    problems: list[SpecProblem] = []
    cluster = spec.cluster
    if not is_profile_file(cluster.profile_name) and cluster.profile_name not in available_profiles():
        problems.append(SpecProblem(("cluster", "profile"), f"unknown hardware profile {cluster.profile_name!r}; "
                                    f"available: {', '.join(available_profiles())}"))
    else:
        try:
            profile = load_profile(cluster.profile_name, cluster.overrides)
            if profile.get("accelerator") != cluster.accelerator:
                problems.append(SpecProblem(("cluster", "profile"), f"profile {cluster.profile_name!r} is for "
                                            f"{profile.get('accelerator')}, but cluster.accelerator is {cluster.accelerator}"))
        except ValueError as exc:
            problems.append(SpecProblem(("cluster", "overrides"), str(exc)))

    kind = spec.workload.kind
    for i, obj in enumerate(spec.objectives):
        metric = METRICS.get(obj.metric)
        if metric is None:
            problems.append(SpecProblem(("objectives", i, "metric"), f"unknown metric {obj.metric!r}; "
                                        f"known: {', '.join(sorted(METRICS))}"))
        elif metric.workload != kind:
            problems.append(SpecProblem(("objectives", i, "metric"), f"{obj.metric} is a {metric.workload} metric "
                                        f"but the workload is {kind}"))

    choices = spec.space.choices()
    train_only = {"tp": False, "pp": True, "cp": True, "vpp": True, "micro_batch_size": True, "sequence_parallel": True,
                  "recompute": True, "recompute_layers": True, "zero_stage": True}
    infer_only = {"batch_size", "kv_cache_dtype", "quantization"}
    for name in choices:
        if kind == "infer" and train_only.get(name):
            problems.append(SpecProblem(("space", name), f"{name} is a training parameter; the workload is infer"))
        if kind == "train" and name in infer_only:
            problems.append(SpecProblem(("space", name), f"{name} is an inference parameter; the workload is train"))
    world = cluster.world_size
    for name in ("tp", "pp", "cp"):
        values = choices.get(name, [])
        if values and not any(world % v == 0 for v in values):
            problems.append(SpecProblem(("space", name), f"no value of {values} divides the world size {world} "
                                        f"({cluster.nodes} nodes x {cluster.devices_per_node} devices)"))

    names = set(CANONICAL_PARAMS) | set(DERIVED_PARAMS) | set(MODEL_ALIASES) | set(choices)
    names |= {"seq_len", "global_batch_size", "prompt_len", "gen_len", "nodes", "devices_per_node"}
    for i, source in enumerate(spec.constraints):
        try:
            expression = compile_expression(source, names)
            expression.evaluate(_sample_env(choices, expression.names))  # types: a string in arithmetic
        except ExpressionError as exc:
            problems.append(SpecProblem(("constraints", i), str(exc)))

    for var, values in spec.space.env.items():  # the values the simulator reads: found here, not in plan
        for i, value in enumerate(values):
            problem = env_value_problem(var, value)
            if problem:
                problems.append(SpecProblem(("space", "env", var, i), problem))

    if spec.baseline is not None:
        unknown = [key for key in spec.baseline if key not in CANONICAL_PARAMS and not key.startswith("env.")]
        for key in unknown:
            problems.append(SpecProblem(("baseline", key), f"unknown parameter {_short(key)}; use canonical names "
                                        f"({', '.join(CANONICAL_PARAMS)}) or env.VAR"))
        for key, value in spec.baseline.items():
            if not key.startswith("env."):
                continue
            if isinstance(value, (dict, list)) or value is None:
                problem = f"an environment variable's value is a string, number or boolean (got {_short(value)})"
            else:
                problem = env_value_problem(key[4:], env_value(value))
            if problem:
                unknown.append(key)
                problems.append(SpecProblem(("baseline", key), problem))
        for key, value in spec.baseline.items():  # the baseline is a trial of the study: its values are searched ones
            values = choices.get(key)
            if values is None:
                continue
            shown = env_value(value) if key.startswith("env.") else value
            if not any(shown == v and type(shown) is type(v) for v in values):
                listed = values if len(values) <= 12 else [*values[:5], "...", *values[-5:]]
                problems.append(SpecProblem(("baseline", key), f"{value!r} is not a value of space.{key} {listed}; "
                                            "add it to the space (the baseline is measured as a trial of the study)"))
        if not unknown and not problems:  # the baseline is probed first: it must be a config the rules allow
            from .space import Space

            try:
                violations = Space(spec).resolve(dict(spec.baseline)).violations
            except (TypeError, ValueError) as exc:
                violations = [f"cannot be resolved ({exc})"]
            for reason in violations:
                problems.append(SpecProblem(("baseline",), f"the baseline breaks a rule: {reason}"))
    if spec.backend.kind == "mindspore" and spec.cluster.accelerator == "cuda":
        problems.append(SpecProblem(("backend", "kind"), "the mindspore backend runs on npu or cpu, not cuda"))
    seq_len, positions = getattr(spec.workload, "seq_len", None), spec.model.max_position_embeddings
    if kind == "train" and seq_len and seq_len > positions and spec.target_stack in ("megatron", "mindspeed"):
        problems.append(SpecProblem(("workload", "seq_len"), (
            f"{seq_len} is above the model's max_position_embeddings {positions}: Megatron's validate_args refuses "
            f"--seq-length {seq_len} with --max-position-embeddings {positions} (target {spec.target_stack}); train "
            f"at most {positions}, or give the model `max_position_embeddings: {seq_len}` (a model mapping, for a "
            "context extension)")))
    return problems


def parse_spec(data: Any, file: str = "<spec>", base_dir: Path | None = None,
               root: yaml.Node | None = None) -> Spec:
    """Validate an already-parsed mapping (``load_spec`` reads the file and keeps line numbers)."""
    if not isinstance(data, dict):
        raise SpecError(file, [SpecProblem((), f"expected a mapping of sections at the top level, got {type(data).__name__}")])
    problems = _oversized_ints(data)
    if problems:
        for p in problems:
            p.line = _line_of(root, p.loc)
        raise SpecError(file, problems)
    try:
        spec = Spec.model_validate(data, context={"base_dir": str(base_dir or Path("."))})
    except RecursionError:
        raise SpecError(file, [SpecProblem((), "nested too deeply to read (a spec nests a few levels)")]) from None
    except ValidationError as exc:
        problems = _format_pydantic(exc, data)
        for p in problems:
            p.line = _line_of(root, p.loc)
        raise SpecError(file, problems) from None
    problems = _semantic_problems(spec)
    if problems:
        for p in problems:
            p.line = _line_of(root, p.loc)
        raise SpecError(file, problems)
    return spec


MAX_YAML_VALUES = 100_000


class _TooManyValues(Exception):
    pass


class _RecursiveAlias(Exception):
    def __init__(self, line: int):
        self.line = line


_IN_PROGRESS = -1


def _expanded_size(node: yaml.Node | None, seen: dict[int, int] | None = None) -> int:
    """How many values the YAML holds once every alias is expanded (an "alias bomb" of nine
    nested lists of nine aliases is a few lines but 387 million values). Aliases share their
    node in the composed graph, so this counts each shared node once per reference, memoised:
    linear in the file, whatever the expansion. An alias inside its own anchor's node (``&a
    [*a]``, a list that contains itself) is :class:`_RecursiveAlias`."""
    if node is None:
        return 0
    seen = {} if seen is None else seen
    key = id(node)
    if key in seen:
        if seen[key] == _IN_PROGRESS:
            raise _RecursiveAlias(node.start_mark.line + 1)
        return seen[key]
    seen[key] = _IN_PROGRESS
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, seen) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.value)
    seen[key] = min(size, MAX_YAML_VALUES + 1)
    return seen[key]


def _oversized_ints(data: Any) -> list[SpecProblem]:
    """Integers no field can use (OverflowError deep in numpy otherwise), with their path."""
    problems = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((loc + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((loc + (i,), v) for i, v in enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SPEC_INT:
            problems.append(SpecProblem(loc, f"{value} is too large an integer (at most 2**53 - 1 = {MAX_SPEC_INT:,})"))
    return problems[::-1]


# ------------------------------------------------------------------------------------ the reader
MAX_SPEC_BYTES = 1 << 20  # 1 MiB: a spec is a few KiB; PyYAML reads about 1 MiB a second
_UTF32_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)  # before UTF-16's: FF FE 00 00 starts with FF FE
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _os_reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def read_spec_text(path: str | Path) -> str:
    """The text of the spec file at ``path``, or a :class:`SpecError` naming the file: it must be
    a regular file (a FIFO would block forever, ``/dev/zero`` never ends; both are refused before
    they are opened for reading), of at most :data:`MAX_SPEC_BYTES`, in UTF-8 (a UTF-8 byte-order
    mark is dropped; UTF-16/32 and other encodings are refused with the way to convert them)."""
    path = Path(path)
    file = str(path)

    def refuse(message: str, line: int | None = None) -> SpecError:
        return SpecError(file, [SpecProblem((), message, line)])

    try:
        info = os.stat(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise refuse(f"cannot read the spec: {_os_reason(exc)}") from None
    if not stat.S_ISREG(info.st_mode):
        raise refuse(f"cannot read the spec: it is {_file_kind(info.st_mode)}, not a regular file; give the path of "
                     "a YAML spec file")
    if info.st_size > MAX_SPEC_BYTES:
        raise refuse(f"cannot read the spec: it is {info.st_size:,} bytes, above the limit of {MAX_SPEC_BYTES:,} "
                     "bytes (1 MiB; a spec is a few KiB)")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise refuse(f"cannot read the spec: {_os_reason(exc)}") from None
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):  # replaced between the stat and the open
            raise refuse(f"cannot read the spec: it is {_file_kind(opened.st_mode)}, not a regular file")
        chunks, size = [], 0
        while size <= MAX_SPEC_BYTES:
            chunk = os.read(fd, MAX_SPEC_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise refuse(f"cannot read the spec: {_os_reason(exc)}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > MAX_SPEC_BYTES:  # grew since the stat
        raise refuse(f"cannot read the spec: it is larger than the limit of {MAX_SPEC_BYTES:,} bytes (1 MiB; a spec "
                     "is a few KiB)")
    return decode_spec_bytes(raw, file)


def decode_spec_bytes(raw: bytes, file: str = "<spec>") -> str:
    """UTF-8 text of a spec's bytes (see :func:`read_spec_text`), or a :class:`SpecError`."""
    convert = f"convert it, e.g. `iconv -f {{enc}} -t UTF-8 {file} > spec-utf8.yaml`"
    for boms, encoding in ((_UTF32_BOMS, "UTF-32"), (_UTF16_BOMS, "UTF-16")):
        if raw.startswith(boms):
            raise SpecError(file, [SpecProblem((), f"the spec is {encoding} text (it starts with a {encoding} "
                                               "byte-order mark); autotune reads specs in UTF-8: "
                                               + convert.format(enc=encoding))])
    raw = raw.removeprefix(codecs.BOM_UTF8)
    nul = raw.find(b"\0")
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise SpecError(file, [SpecProblem((), "the spec holds NUL bytes, so it is not UTF-8 text: a binary file, "
                                           "or UTF-16/UTF-32 without a byte-order mark; "
                                           + convert.format(enc="UTF-16"), line)])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(file, [SpecProblem((), f"the spec is not UTF-8 text: byte 0x{raw[exc.start]:02x} at column "
                                           f"{column} ({exc.reason}); Latin-1 or Windows-1252 perhaps: "
                                           + convert.format(enc="LATIN1"), line)]) from None


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python tags), whose every construction error is a located
    ``ConstructorError``: ``!!int 'abc'`` or a date such as ``2001-02-30`` raise a bare
    ValueError in PyYAML (an "internal error" in autotune until issue #31)."""

    composed = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """PyYAML's, stopping at the first node past MAX_YAML_VALUES: a 1 MiB flow list of 300,000
        values takes PyYAML seconds to compose, and is refused whole anyway."""
        self.composed += 1
        if self.composed > MAX_YAML_VALUES:
            raise _TooManyValues()
        return super().compose_node(parent, index)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 (ValueError, TypeError, OverflowError... of one value)
            self.recursive_objects.pop(node, None)
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read the {node.tag.rsplit(':', 1)[-1]} value {_short(getattr(node, 'value', ''))}: "
                f"{type(exc).__name__}: {exc}", node.start_mark) from None


    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """PyYAML's int (``0x1F``, ``0o17``/``017``, ``1:20``), refusing one of more characters
        than a spec's largest integer needs before building it: a sexagesimal ``1:1:1:...`` of a
        few hundred KiB takes PyYAML minutes (each ``:`` multiplies a growing number by 60)."""
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer written in {len(text):,} characters; a spec's integers are at most "
                f"2**53 - 1 ({MAX_SPEC_INT:,})", node.start_mark)
        return super().construct_yaml_int(node)


MAX_INT_CHARS = 100  # 2**53 - 1 has 16 digits; room for signs, underscores and base prefixes
_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_yaml_int)

_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"


def _duplicate_keys(root: yaml.Node | None, loader: yaml.SafeLoader) -> list[SpecProblem]:
    """Every key written a second time in one mapping, at any depth, with the line of the
    second one and the key's path. Keys are compared as the values YAML reads them as (``1``
    and ``0x1``, ``yes`` and ``true`` are one key). A merge (``<<``) is no duplicate of a key the
    mapping writes out: that is YAML's override. Aliased nodes are checked once, where their
    anchor is."""
    problems: list[SpecProblem] = []
    visited: set[int] = set()
    stack: list[tuple[tuple[Any, ...], yaml.Node | None]] = [((), root)]
    while stack:
        loc, node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((loc + (i,), child) for i, child in enumerate(node.value))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        first: dict[Any, yaml.Node] = {}
        first_merge: yaml.Node | None = None
        for key, value in node.value:
            if key.tag == _MERGE_TAG:
                if first_merge is not None:
                    problems.append(SpecProblem(loc + ("<<",), (
                        f"a second merge key '<<' in one mapping (the first is at line {first_merge.start_mark.line + 1}); "
                        "merge several mappings with one: `<<: [*first, *second]`"), key.start_mark.line + 1))
                first_merge = first_merge or key
                stack.append((loc, value))
                continue
            if not isinstance(key, yaml.ScalarNode):
                stack.append((loc + ("?",), value))  # a list or mapping as a key: the loader refuses it
                continue
            shown = key.value
            name = "=" if key.tag == _VALUE_TAG else loader.construct_object(key, deep=True)
            try:
                earlier = first.get(name)
            except TypeError:  # unhashable: the loader refuses it
                earlier = None
            if earlier is None:
                try:
                    first[name] = key
                except TypeError:
                    pass
            else:
                same = "" if earlier.value == shown else f" (read as the same key as {_short(earlier.value)})"
                problems.append(SpecProblem(loc + (shown,), (
                    f"duplicate key {_short(shown)}{same}: already at line {earlier.start_mark.line + 1}; YAML keeps "
                    "only the last one, silently: write the key once"), key.start_mark.line + 1))
            stack.append((loc + (shown,), value))
    return sorted(problems, key=lambda p: p.line or 0)


def parse_spec_text(text: str, file: str = "<spec>") -> tuple[Any, yaml.Node | None]:
    """The data of a spec's YAML text and its node tree (for lines), or a :class:`SpecError`:
    invalid YAML, an alias bomb, a duplicate key."""
    loader = None
    try:
        loader = _SpecLoader(text)  # the reader checks the characters here already
        root = loader.get_single_node()
        if _expanded_size(root) > MAX_YAML_VALUES:
            raise SpecError(file, [SpecProblem((), f"the YAML expands to more than {MAX_YAML_VALUES:,} values through its "
                                               "aliases (*name); a spec needs a few hundred: write the values out")])
        duplicates = _duplicate_keys(root, loader)
        if duplicates:
            raise SpecError(file, duplicates)
        data = loader.construct_document(root) if root is not None else None
    except _TooManyValues:
        raise SpecError(file, [SpecProblem((), (
            f"the YAML holds more than {MAX_YAML_VALUES:,} values (keys and values); a spec needs a few hundred "
            "(a long run of integers is a range: {low, high, step})"))]) from None
    except _RecursiveAlias as exc:
        raise SpecError(file, [SpecProblem((), "invalid YAML: an alias (*name) inside the node its anchor (&name) "
                                           "names, a structure that contains itself", exc.line)]) from None
    except RecursionError:
        raise SpecError(file, [SpecProblem((), "invalid YAML: nested too deeply to read (a spec nests a few levels)")]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise SpecError(file, [SpecProblem((), f"invalid YAML: {exc.problem} {exc.context or ''}".strip(), line)]) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1 if isinstance(exc.position, int) else None
        what = f"#x{exc.character:04x}" if isinstance(exc.character, int) else _short(exc.character)
        raise SpecError(file, [SpecProblem((), f"invalid YAML: unacceptable character {what}: {exc.reason} (control "
                                           "characters are written as escapes in a double-quoted string)", line)]) from None
    except yaml.YAMLError as exc:
        raise SpecError(file, [SpecProblem((), f"invalid YAML: {exc}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, root


def load_spec(path: str | Path) -> Spec:
    """Read (:func:`read_spec_text`), parse (PyYAML's safe loader, duplicate keys refused) and
    validate a spec file; every problem is a :class:`SpecError` naming the file."""
    path = Path(path)
    text = read_spec_text(path)
    data, root = parse_spec_text(text, str(path))
    spec = parse_spec(data, str(path), path.parent, root)
    spec.source_path = path.resolve()
    return spec
