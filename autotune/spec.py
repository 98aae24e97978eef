"""The tuning spec's schema: one YAML file that says what to tune, where, for what, and with what budget.

Like torchtitan's ``config/job_config.py``, this module is the schema only: one pydantic section
per part of the spec, every field with its description, ``extra="forbid"`` so a misspelt key is an
error, never silently ignored, and the field-level rules (an environment variable's name, a path's
length, a value the simulator reads). Reading a file (encodings, YAML locations, duplicate keys)
is :mod:`autotune.spec_load`; rendering errors with the file, line and field is
:mod:`autotune.spec_errors`; the checks across sections (objectives against the workload, the
baseline against the space, the hardware profile) are :mod:`autotune.spec_checks`. This module
imports neither the space nor the simulator at import time, so the space (which reads the spec)
is above it and the dependency runs one way.

Every environment variable name, wherever it enters the spec (``space.env``, ``backend.env``,
``backend.secret_env``, the ``env.VAR`` keys of ``baseline``), follows one rule,
:data:`ENV_NAME_RULE`: a POSIX shell name. The values the simulator reads
(``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_CUDA_ALLOC_CONF``, ``HCCL_BUFFSIZE``,
``MULTI_STREAM_MEMORY_REUSE``) are checked here, with their field path, not first in ``plan``.
The values of ``space.env``, ``space.engine`` and a baseline's ``env.VAR`` reach launch scripts,
flags and JSON configs (:func:`setting_value_problem`): no NaN or Infinity, no control, line-separator
or bidi character, and no engine string starting with ``-`` (read as a flag of its own after
``--NAME``). A serving workload's durations, SLOs and burstiness are finite and bounded (a day;
a probe's timeout, a week), and its lengths file is read cell by cell (:func:`_read_length_pairs`):
integers only, never a boolean, a repeated column or a quoted line of the file.

``spec`` starts no cluster and logs nothing (docs/ARCHITECTURE.md, data flow).

Why one module of over 500 lines: it is the schema, every section and field with its description
and its field-level rule, as one reference a reader can scan; nothing else lives here.
"""

from __future__ import annotations


import json
import math
import re
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from autotune.workers.protocol import ENV_NAME

from .models import PRESETS, ModelSpec, load_hf_config
from .stacks import STACKS, default_target, names as stack_names, preset_names

__all__ = [
    "Spec",
    "TrainWorkload",
    "InferWorkload",
    "ServeWorkload",
    "TrafficSpec",
    "SLOSpec",
    "ClusterSpec",
    "BackendSpec",
    "SpaceSpec",
    "ObjectiveSpec",
    "SearchSpec",
    "TrackingSpec",
    "RaySpec",
    "CANONICAL_PARAMS",
    "SERVE_PARAMS",
    "DERIVED_PARAMS",
    "ENV_NAME_RULE",
    "MAX_SPEC_BYTES",
    "env_name_problem",
    "env_value_problem",
    "path_problem",
    "setting_value_problem",
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
        raise ValueError(
            f"config.json file {path} is {size:,} bytes; a model config is a few KiB "
            f"(at most {MAX_SPEC_BYTES:,} bytes read)"
        )
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
MAX_ENV_BYTES = 128 * 1024 - 1  # Linux MAX_ARG_STRLEN: one NAME=value string of a process environment
MAX_SPEC_BYTES = 1 << 20  # 1 MiB: a spec is a few KiB; PyYAML reads about 1 MiB a second
MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX: one component of a path
MAX_SPEC_INT = 2**53 - 1  # beyond this an integer cannot be a size, and JSON (Optuna storage) cannot keep it


def env_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be an environment variable's name, or None. The one rule for every
    name a spec gives (``space.env``, ``backend.env``, ``backend.secret_env``, ``baseline`` env.VAR):
    a name reaches ``export NAME=...`` lines and process environments, where ``X=1;touch y;#``
    or ``$(cmd)`` would be code, not a name."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        return f"not an environment variable name: {ENV_NAME_RULE}"
    return None


def _env_name(name: str) -> str:
    problem = env_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


EnvName = Annotated[str, AfterValidator(_env_name)]


def _engine_name(name: str) -> str:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        raise ValueError(
            f"not an engine setting's name: {ENV_NAME_RULE} (MindIE's maxIterTimes; a vLLM flag as async_scheduling)"
        )
    return name


EngineName = Annotated[str, AfterValidator(_engine_name)]

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
            return (
                f"{exc} (options: expandable_segments:True|False, max_split_size_mb:N, garbage_collection_threshold:F)"
            )
        for part in value.split(","):
            key, _, option = part.partition(":")
            key, option = key.strip().lower(), option.strip()
            if key == "expandable_segments" and option.lower() not in _BOOL_WORDS:
                return (
                    f"allocator config {short_value(value)}: expandable_segments expects True or False, "
                    f"got {short_value(option)}"
                )
            if key in ("max_split_size_mb", "garbage_collection_threshold") and not (
                math.isfinite(float(option)) and float(option) >= 0
            ):
                return (
                    f"allocator config {short_value(value)}: {key} expects a finite number >= 0, "
                    f"got {short_value(option)}"
                )
    if name == "HCCL_BUFFSIZE" and value != "":
        try:
            size_mb = float(value)
        except ValueError:
            size_mb = math.nan
        if not (math.isfinite(size_mb) and size_mb > 0):
            return f"HCCL_BUFFSIZE is a buffer size in MB, a number > 0 (got {short_value(value)})"
    if name == "MULTI_STREAM_MEMORY_REUSE" and value != "":
        try:
            reuse = int(value)
        except ValueError:
            reuse = None
        if reuse not in MULTI_STREAM_MEMORY_REUSE_VALUES:
            return (
                f"MULTI_STREAM_MEMORY_REUSE is one of {', '.join(map(str, MULTI_STREAM_MEMORY_REUSE_VALUES))} "
                f"(got {short_value(value)})"
            )
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


def short_value(value: Any, limit: int = 120) -> str:
    """``repr(value)``, shortened: an error quotes what the spec says, not megabytes of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, (str, bytes)) else f"{len(text):,} characters shown"
    return f"{text[: limit - 40]}...{text[-20:]} ({size})"


def _excerpt(value: Any, limit: int = 40) -> str:
    """A short, escaped excerpt of one value read from a file (at most ``limit`` characters of a
    string, control and invisible characters as escapes; a number as JSON writes it): an error
    names the offending cell, never quotes the lines around it (the file may be anything a path
    leads to)."""
    if isinstance(value, str):
        return repr(value[:limit]) + (f"... ({len(value):,} characters)" if len(value) > limit else "")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SPEC_INT:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return _json_word(value)


def _json_word(value: Any) -> str:
    """How JSON writes a scalar (``true``, ``null``, ``Infinity``): the words of a JSON-lines file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "a string"
    return f"a JSON {'array' if isinstance(value, list) else 'object' if isinstance(value, dict) else 'value'}"


# ------------------------------------------------------------------- engine and env setting values
# control characters, C0 (NUL, tab, newline, ESC...), DEL and C1, and the characters that change how
# a line reads without being seen: line and paragraph separators, bidi embeddings, overrides,
# isolates and marks ("Trojan source"). A value exported into a shell script, a flag or a config
# file holds none: bash drops a NUL silently, a newline or an escape changes what runs or what a
# terminal shows, and U+202E shows a script's line other than as it runs.
_UNSEEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")

_CONTROL_NAMES = {"\t": "TAB", "\n": "NEWLINE", "\r": "CARRIAGE RETURN", "\x1b": "ESC", "\x7f": "DEL"}


def _control_problem(value: str) -> str | None:
    if "\x00" in value:
        return (
            "contains a NUL character, a control character no environment variable, command line or config "
            "file can hold (bash drops it silently)"
        )
    bad = _UNSEEN.search(value)
    if bad is not None:
        ch = bad.group()
        kind = "control character" if unicodedata.category(ch) == "Cc" else "invisible character"
        name = unicodedata.name(ch, "") or _CONTROL_NAMES.get(ch)
        return (
            f"contains the {kind} U+{ord(ch):04X}{f' ({name})' if name else ''} at character {bad.start() + 1}; "
            "a setting exported into a shell script, a flag or a config file holds no control, line-separator "
            "or bidi character"
        )
    return None


def setting_value_problem(value: Any, *, engine: bool = False) -> str | None:
    """Why ``value`` cannot be a value of ``space.env.VAR`` / a baseline ``env.VAR`` (or, with
    ``engine``, of ``space.engine.NAME``), or None: a non-finite number (``.nan``, ``.inf``: no
    JSON config or flag parser reads one, and a strict JSON parser refuses the file), a control
    character, and for an engine value a string that starts with ``-`` (vLLM's argument parser reads
    it as a flag: ``--weird --model=/etc/passwd`` sets ``--model``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return (
            f"{_json_word(value)} is not a finite number; settings are finite numbers, strings or booleans "
            "(MindIE's config.json is strict JSON, which has no NaN or Infinity)"
        )
    if isinstance(value, str):
        problem = _control_problem(value)
        if problem:
            return problem
        if engine and value.startswith("-"):
            return (
                f"{short_value(value, 60)} starts with '-': an engine value is written after its flag "
                "(--NAME VALUE), where vLLM's parser would read it as a flag of its own (--model, --host); "
                "a negative number is written as a number (-5), not a string"
            )
    return None


def _env_setting(value: Any) -> Any:
    problem = setting_value_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _engine_setting(value: Any) -> Any:
    problem = setting_value_problem(value, engine=True)
    if problem:
        raise ValueError(problem)
    return value


Scalar = Union[str, int, float, bool]
EnvSetting = Annotated[Scalar, AfterValidator(_env_setting)]
EngineSetting = Annotated[Scalar, AfterValidator(_engine_setting)]


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
    """Offline inference: one prefill of ``prompt_len`` tokens then ``gen_len`` decode steps per batch,
    measured at each of ``batch_sizes`` for every config (the points Ascend teams quote: TTFT, time for
    100 tokens, tokens/s at batch 1/4/16). A config is the deployment: tp-wide instances filling the
    cluster (``replicas``), precision, KV-cache dtype, quantization, graph mode."""

    kind: Literal["infer"] = "infer"
    prompt_len: int = Field(gt=0)
    gen_len: int = Field(gt=0)
    batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 4, 16],
        min_length=1,
        description="measurement points, not a knob: every config is measured at each batch size",
    )
    ttft_bound_ms: float | None = Field(
        None, gt=0, description="latency bound: time to first token a batch point must meet (ms)"
    )
    tpot_bound_ms: float | None = Field(
        None, gt=0, description="latency bound: time per output token a batch point must meet (ms)"
    )
    warmup_steps: int = Field(1, ge=0)
    measured_steps: int = Field(3, gt=0)
    timeout_s: float = Field(600.0, gt=0)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v):
            raise ValueError("batch sizes must be positive")
        if len(set(v)) != len(v):
            raise ValueError(f"batch sizes repeat: {v}")
        return sorted(v)


class LengthRange(_Strict):
    """Token lengths drawn uniformly from ``low..high`` (inclusive)."""

    low: int = Field(gt=0)
    high: int = Field(gt=0)

    @model_validator(mode="after")
    def _order(self) -> "LengthRange":
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) is below low ({self.low})")
        return self


Length = Union[int, LengthRange]


class TrafficSpec(_Strict):
    """The request load a serving probe offers: open loop (arrivals never wait for completions).

    ``rates`` is the ladder the probe bisects for the largest rate that meets the SLO (one rate:
    goodput at that rate only)."""

    rates: list[float] = Field(min_length=1, description="requests/s offered to the whole deployment, ascending")
    arrival: Literal["poisson", "gamma"] = Field("poisson", description="inter-arrival distribution")
    burstiness: float = Field(1.0, gt=0, description="gamma shape: 1 is Poisson, below 1 burstier")
    prompt_len: Length | None = Field(None, description="prompt tokens: a number or {low, high}")
    output_len: Length | None = Field(None, description="output tokens: a number or {low, high}")
    lengths_file: str | None = Field(
        None, description="JSON lines of {prompt_len, output_len} (or a CSV with those columns), relative to the spec"
    )
    length_pairs: list[tuple[int, int]] | None = Field(
        None, description="set from lengths_file when the spec loads (never written in a spec)"
    )
    shared_prefix: float = Field(0.0, ge=0, lt=1, description="share of each prompt that all requests share")
    duration_s: float = Field(30.0, gt=0, description="load per rate tried, seconds (at most a day)")
    warmup_requests: int = Field(4, ge=0, description="requests sent before any measurement, not recorded as load")
    seed: int = Field(0, ge=0)

    @field_validator("length_pairs", mode="before")
    @classmethod
    def _filled_by_the_loader(cls, v: Any) -> Any:
        if v is not None:  # the loader sets it after validation; written here it would skip the file's checks
            raise ValueError(
                "length_pairs is not a spec field: autotune fills it from lengths_file when the spec loads; "
                "write the pairs into a lengths file (JSON lines of {prompt_len, output_len}, or a CSV with "
                "those columns) and name it in lengths_file"
            )
        return v

    @field_validator("prompt_len", "output_len", mode="before")
    @classmethod
    def _fixed_length_positive(cls, v: Any) -> Any:
        """A length given as one number is a positive integer: a YAML ``true``/``off`` or 0 is none."""
        if isinstance(v, bool) or (isinstance(v, (int, float)) and v <= 0):
            raise ValueError("a length is a positive integer or {low, high}")
        return v

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_DURATION_S, "1 day")

    @field_validator("burstiness")
    @classmethod
    def _burstiness(cls, v: float) -> float:
        low, high = BURSTINESS_RANGE
        if not (math.isfinite(v) and low <= v <= high):
            raise ValueError(
                f"burstiness is the gamma shape of the gaps between arrivals: a finite number from {low:g} to "
                f"{high:g} (1 is Poisson, below 1 burstier)"
            )
        return v

    @field_validator("rates", mode="before")
    @classmethod
    def _one_rate(cls, v: Any) -> Any:
        return [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    @field_validator("rates")
    @classmethod
    def _ascending(cls, v: list[float]) -> list[float]:
        if any(not math.isfinite(r) or r <= 0 for r in v):
            raise ValueError(f"rates are requests per second, finite and > 0; got {v}")
        if sorted(set(v)) != v:
            raise ValueError(f"rates must ascend without repeats (the probe bisects them); got {v}")
        return v

    @model_validator(mode="after")
    def _lengths(self, info: Any) -> "TrafficSpec":
        requests = max(self.rates) * self.duration_s
        if requests > MAX_REQUESTS_PER_RATE:
            raise ValueError(
                f"the highest rate ({max(self.rates):.6g} requests/s) for duration_s ({self.duration_s:g} s) plans "
                f"{requests:.3g} requests per rate; a probe plans at most {MAX_REQUESTS_PER_RATE:,}: lower the "
                "rate or the duration"
            )
        if self.lengths_file is not None:
            if self.prompt_len is not None or self.output_len is not None:
                raise ValueError("give either lengths_file or prompt_len and output_len, not both")
            if self.length_pairs is None:
                base = Path((info.context or {}).get("base_dir", "."))
                self.length_pairs = _read_length_pairs(base, self.lengths_file)
        elif self.length_pairs is None and (self.prompt_len is None or self.output_len is None):
            raise ValueError("the traffic needs prompt_len and output_len (a number or {low, high}), or lengths_file")
        return self

    def longest(self) -> tuple[int, int]:
        """The longest prompt and output this traffic sends (what the engine's context must hold)."""
        if self.length_pairs:
            return max(p for p, _ in self.length_pairs), max(o for _, o in self.length_pairs)
        return _high(self.prompt_len), _high(self.output_len)

    def mean(self) -> tuple[float, float]:
        """The mean prompt and output lengths."""
        if self.length_pairs:
            n = len(self.length_pairs)
            return sum(p for p, _ in self.length_pairs) / n, sum(o for _, o in self.length_pairs) / n
        return _mean(self.prompt_len), _mean(self.output_len)


def _high(length: Length | None) -> int:
    return int(length.high if isinstance(length, LengthRange) else length or 0)


def _mean(length: Length | None) -> float:
    return (length.low + length.high) / 2.0 if isinstance(length, LengthRange) else float(length or 0)


MAX_LENGTH_PAIRS = 100_000
MAX_LENGTHS_FILE_BYTES = 64 * MAX_SPEC_BYTES
MAX_DURATION_S = 86_400  # a day: traffic.duration_s, workload.startup_timeout_s
MAX_PROBE_TIMEOUT_S = 7 * 86_400  # a week: workload.timeout_s of a serving probe (every rate and the batch sweep)
MAX_SLO_MS = 86_400_000  # a day, in ms: an SLO's latency bound
MAX_REQUESTS_PER_RATE = 10_000_000  # rate x duration_s: the requests a probe plans (and holds) for one rate
BURSTINESS_RANGE = (1e-3, 1e3)  # below, a rate's request count explodes (~1/(2 shape)); above, gaps underflow


def _bounded(value: float, unit: str, cap: float, cap_words: str) -> float:
    """``value`` if finite and at most ``cap``; a ValueError saying so otherwise (a probe computes
    request counts, deadlines and timeouts from these: ``.inf`` made every trial crash)."""
    if not math.isfinite(value) or value > cap:
        raise ValueError(f"expected a finite number of {unit}, at most {cap:,} ({cap_words})")
    return value


_LENGTH_COLUMNS = ("prompt_len", "output_len")
_EXPECTED_LENGTHS = (
    f"expected prompt_len and output_len, positive integers (token counts) of at most 2**53 - 1 ({MAX_SPEC_INT:,})"
)
_FILE_BOOL_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
_DIGITS = re.compile(r"[0-9]{1,30}")


def _length_value(value: Any) -> tuple[int | None, str]:
    """A lengths file's cell as a token count, or (None, why not): never a boolean (JSON ``true``
    was read as 1), a non-finite or fractional number, or one above 2**53 - 1 (Infinity and 1e300
    were an OverflowError)."""
    if isinstance(value, bool):
        return None, "a boolean, not a token count"
    if isinstance(value, str):
        word = value.strip()
        if word.lower() in _FILE_BOOL_WORDS:
            return None, "a boolean word, not a token count"
        if not _DIGITS.fullmatch(word):  # int() would also read "+12", "1_000", "١٢"
            return None, "not an integer (ASCII digits)"
        value = int(word)
    elif isinstance(value, float):
        if not math.isfinite(value):
            return None, "not a finite number"
        if not value.is_integer():
            return None, "not a whole number"
        value = int(value)
    elif not isinstance(value, int):
        return None, "not an integer"
    if value <= 0:
        return None, "not above 0"
    if value > MAX_SPEC_INT:
        return None, "above 2**53 - 1"
    return value, ""


def _open_lengths_file(path: Path, where: str) -> str:
    """The UTF-8 text of a lengths file (a byte-order mark dropped), read with a bound; a
    ValueError naming the file otherwise (never its contents)."""
    from .bounded_read import NotRegularFile, read_bounded

    try:
        raw = read_bounded(path, MAX_LENGTHS_FILE_BYTES)
    except NotRegularFile:
        raise ValueError(f"{where} is not a regular file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ValueError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
    if len(raw) > MAX_LENGTHS_FILE_BYTES:
        raise ValueError(f"{where} is larger than {MAX_LENGTHS_FILE_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{where} line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); a lengths file is UTF-8 JSON "
            "lines or CSV"
        ) from None
    return text.removeprefix("\ufeff")


class _Repeated(Exception):
    """A JSON object that names a length column twice."""


def _json_records(text: str, where: str) -> Any:
    """``(line, object)`` for each non-blank line of a JSON-lines lengths file."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out and key in _LENGTH_COLUMNS:
                raise _Repeated(key)
            out[key] = value
        return out

    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=unique)
        except _Repeated as exc:
            raise ValueError(
                f"{where} line {number}: the object names {exc.args[0]} twice (JSON keeps the last one, "
                "silently); name it once"
            ) from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else "a number JSON cannot hold"
            raise ValueError(f"{where} line {number}: not JSON ({reason})") from None
        if not isinstance(row, dict):
            raise ValueError(
                f'{where} line {number}: expected a JSON object {{"prompt_len": N, "output_len": N}}, '
                f"got {_json_word(row)}"
            )
        yield number, row


def _csv_records(text: str, where: str) -> Any:
    """``(line, {column: cell})`` for each non-blank row of a CSV lengths file: its header names
    prompt_len and output_len, each column once, and every row has the header's fields."""
    import csv
    import io

    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    record = 0
    try:
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            if header is None:
                header = [cell.strip() for cell in row]
                seen: dict[str, int] = {}
                for column, name in enumerate(header, 1):
                    if name and name in seen:
                        raise ValueError(
                            f"{where} line {reader.line_num}: the header names the column {_excerpt(name)} twice "
                            f"(columns {seen[name]} and {column}); name each column once"
                        )
                    seen.setdefault(name, column)
                missing = [name for name in _LENGTH_COLUMNS if name not in seen]
                if missing:
                    raise ValueError(
                        f"{where} line {reader.line_num}: the header has no {' or '.join(missing)} column; a CSV of "
                        "lengths starts with a header line naming the columns prompt_len and output_len"
                    )
                continue
            record += 1
            if len(row) != len(header):
                raise ValueError(
                    f"{where} line {reader.line_num}, record {record}: {len(row)} field{'s' * (len(row) != 1)}, "
                    f"and the header names {len(header)} columns"
                )
            yield reader.line_num, dict(zip(header, row))
    except csv.Error as exc:
        raise ValueError(f"{where} line {reader.line_num}: not CSV ({exc})") from None


def _read_length_pairs(base: Path, name: str) -> list[tuple[int, int]]:
    """``[(prompt_len, output_len), ...]`` of a JSON-lines or CSV file; a ValueError naming the
    file, the line and what was expected otherwise. An error never quotes the file's lines (the
    path may lead anywhere: a symlink to /etc/passwd): it names the line, the column and the kind
    of problem, with at most a short, escaped excerpt of the offending cell."""
    problem = path_problem(name)
    if problem:
        raise ValueError(f"lengths_file: {problem}")
    path = Path(name) if Path(name).is_absolute() else base / name
    if not _is_file(path):
        raise ValueError(f"lengths_file {path} does not exist (or is not a regular file)")
    where = f"lengths_file {path}"
    text = _open_lengths_file(path, where)
    is_csv = path.suffix.lower() == ".csv"
    records = _csv_records(text, where) if is_csv else _json_records(text, where)
    pairs = []
    for record, (line, row) in enumerate(records, 1):
        at = f"{where} line {line}, record {record}"
        missing = [column for column in _LENGTH_COLUMNS if column not in row]
        if missing:
            raise ValueError(
                f"{at}: expected prompt_len and output_len, positive integers; the "
                f"{'row' if is_csv else 'object'} has no {' or '.join(missing)}"
            )
        pair = []
        for column in _LENGTH_COLUMNS:
            value, why = _length_value(row[column])
            if value is None:
                raise ValueError(f"{at}: {column} is {_excerpt(row[column])}, {why}; {_EXPECTED_LENGTHS}")
            pair.append(value)
        pairs.append((pair[0], pair[1]))
        if len(pairs) > MAX_LENGTH_PAIRS:
            raise ValueError(f"{where} holds more than {MAX_LENGTH_PAIRS:,} pairs; at most {MAX_LENGTH_PAIRS:,}")
    if not pairs:
        raise ValueError(f"{where} holds no length pairs")
    return pairs


class SLOSpec(_Strict):
    """The latency targets a served request must meet (p99 over the requests of one rate)."""

    ttft_p99_ms: float = Field(gt=0, description="time to first token, p99, ms")
    tpot_p99_ms: float | None = Field(None, gt=0, description="time per output token after the first, p99, ms")
    itl_p99_ms: float | None = Field(None, gt=0, description="inter-token latency, p99, ms")
    e2e_p99_ms: float | None = Field(None, gt=0, description="end-to-end latency, p99, ms")

    @field_validator("ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms")
    @classmethod
    def _bounded_ms(cls, v: float | None) -> float | None:
        return None if v is None else _bounded(v, "milliseconds", MAX_SLO_MS, "1 day")


class ServeWorkload(_Strict):
    """Serving: an engine (vLLM / vLLM-Ascend, MindIE) under open-loop traffic, judged at an SLO."""

    kind: Literal["serve"] = "serve"
    traffic: TrafficSpec
    slo: SLOSpec
    batch_sweep: list[int] = Field(
        default_factory=lambda: [1, 4, 16],
        description="closed-loop concurrencies measured too (TTFT, time for 100 tokens, tokens/s); [] skips",
    )
    max_model_len: int | None = Field(None, gt=0, description="the engine's context; default: longest prompt + output")
    startup_timeout_s: float = Field(600.0, gt=0, description="an engine not healthy by then is recorded as timeout")
    timeout_s: float = Field(3600.0, gt=0, description="a probe running longer is killed and recorded as timeout")

    @field_validator("batch_sweep")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b <= 0 for b in v):
            raise ValueError("batch sizes must be positive")
        return v

    @field_validator("startup_timeout_s")
    @classmethod
    def _startup(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_DURATION_S, "1 day")

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, v: float) -> float:
        return _bounded(v, "seconds", MAX_PROBE_TIMEOUT_S, "a week")

    @model_validator(mode="after")
    def _context(self) -> "ServeWorkload":
        prompt, output = self.traffic.longest()
        if self.max_model_len is None:
            self.max_model_len = prompt + output
        elif self.max_model_len < prompt + output:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is below the longest prompt + output the traffic sends "
                f"({prompt} + {output}); raise it or shorten the traffic"
            )
        return self


Workload = Union[TrainWorkload, InferWorkload, ServeWorkload]


# ---------------------------------------------------------------------------------------- cluster
class ClusterSpec(_Strict):
    """Where trials run. ``profile`` names a hardware profile (workers/hardware/*.yaml);
    ``overrides`` replaces fields of it, e.g. ``device_memory_gib: 32`` for 32 GB 910B parts."""

    accelerator: Literal["npu", "cuda", "cpu"] = "npu"
    profile: str | None = Field(
        None,
        description="hardware profile: a bundled name, or the path of a profile file "
        "(relative to the spec), e.g. from `autotune calibrate`; "
        "default per accelerator",
    )
    nodes: int = Field(1, gt=0)
    devices_per_node: int = Field(8, gt=0)
    overrides: dict[str, Any] = Field(default_factory=dict)
    threads_per_rank: int | None = Field(
        None, gt=0, description="CPU threads per probe process (default: cores / ranks)"
    )
    calibrate: Literal["auto", "never"] | None = Field(
        None,
        description="auto: a study with a real backend on a data-sheet profile first measures this host "
        "(`autotune calibrate --quick`, cached per host and software) and ranks with that; never: "
        "use the profile as it is. Default: the AUTOTUNE_CALIBRATE environment variable, else auto",
    )

    cost_per_device_hour: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="what one device costs an hour (any currency): serving reports cost per million tokens",
    )

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
    trial file path, ``{num_layers}`` by the layers of the model the trial runs: fewer than the
    model's in a memory profile, see autotune.memory_profile) and reads the probe protocol's JSON
    lines, or ``metric_patterns`` regexes."""

    kind: BackendKind = "auto"
    argv: list[str] | None = None
    timeout_s: float | None = Field(None, gt=0, description="overrides workload.timeout_s")
    env: Annotated[dict[EnvName, str], AfterValidator(_env_values_of_backend)] = Field(
        default_factory=dict,
        description="extra environment for every probe; values of "
        "keys that look secret (TOKEN, PASSWORD, SECRET, KEY, CREDENTIAL, AUTH) or named in "
        "secret_env reach the probe only, and are masked in every copy autotune keeps",
    )
    secret_env: list[EnvName] = Field(default_factory=list, description="more env keys whose values are secret")
    resources: dict[str, Any] | None = Field(
        None, description="Ray resources per trial, replacing the default derived from the cluster"
    )
    metric_patterns: dict[str, str] = Field(default_factory=dict, description="metric -> regex with one group")
    python: str | None = Field(None, description="interpreter for the mindspore/torch probe")
    launcher: Literal["auto", "warm", "spawn", "torchrun"] = Field(
        "auto",
        description="how the torch probe's ranks start: 'warm' forks them from a server that has imported "
        "torch already (single node), 'spawn' starts fresh processes (single node), 'torchrun' "
        "(any); 'auto' = warm on a single cpu node, spawn on a single accelerator node, torchrun "
        "across nodes",
    )
    cwd: str | None = Field(
        None,
        description="working directory of the probe; a relative path is relative to the "
        "spec file (default: where autotune runs)",
    )
    entry: str | None = Field(
        None,
        description="stack presets (megatron, mindspeed, torchtitan, deepspeed): the "
        "training entry point, a script path (pretrain_gpt.py, train.py) or '-m package.module' "
        "(torchtitan's default: -m torchtitan.train); run under torchrun --standalone",
    )
    args: list[str] = Field(
        default_factory=list,
        description="stack presets: the job's own arguments (data, "
        "tokenizer, --module/--config), after autotune's (Megatron keeps the last of a repeated flag); "
        "'{iterations}' is replaced by the iterations to run (also $AUTOTUNE_ITERATIONS)",
    )
    iterations: int | None = Field(
        None,
        gt=0,
        description="stack presets: training iterations per probe (default: "
        "workload.warmup_steps + measured_steps; the warm-up ones are not measured)",
    )

    @field_validator("argv", "args")
    @classmethod
    def _command_line(cls, v: list[str] | None) -> list[str] | None:
        for i, word in enumerate(v or []):
            if "\x00" in word:
                raise ValueError(
                    f"word {i + 1} ({short_value(word, 60)}) contains a NUL character, which no command line can hold"
                )
        return v

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
                raise ValueError(
                    f"the pattern for {metric!r} needs a group around the number, e.g. '{metric}[=:] *([0-9.eE+-]+)'"
                )
        return v

    @model_validator(mode="after")
    def _argv_for_command(self) -> "BackendSpec":
        if self.kind == "command" and not self.argv:
            raise ValueError(
                "backend kind 'command' needs argv, a list such as [python, train.py, --trial, '{trial_file}']"
            )
        if self.kind != "command" and self.argv:
            raise ValueError(f"argv is only used by backend kind 'command', not {self.kind!r}")
        if self.kind in STACK_PRESETS and not STACKS[self.kind].default_entry and not self.entry:
            raise ValueError(
                f"backend kind {self.kind!r} needs entry, the training script ({STACKS[self.kind].entry_example})"
            )
        if self.kind not in STACK_PRESETS and (self.entry or self.args or self.iterations):
            raise ValueError(
                f"entry, args and iterations are for the stack presets (kind {', '.join(STACK_PRESETS)}), "
                f"not {self.kind!r}"
            )
        return self


# ------------------------------------------------------------------------------------------ space
MAX_RANGE_VALUES = 100_000  # every value is enumerated (ranking, grid search): a range must stay listable


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
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "memory_utilization",
    "graph_mode",
)


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
    kv_cache_dtype: list[Literal["auto", "bf16", "fp16", "fp8", "int8"]] | None = None
    quantization: list[Literal["none", "int8", "w8a8", "int4"]] | None = None
    replicas: IntChoice | None = Field(None, description="serving: engine instances on the node, one load balancer")
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
    exhaustive_limit: int = Field(
        2_000_000,
        gt=0,
        description="largest space ranked exhaustively by the simulator (larger ones are sampled); a space "
        "under it whose ranking could not fit in this machine's memory is refused (validate/plan/run: exit 2, "
        "with the estimate: autotune.space.memory_problem)",
    )
    prune: bool = Field(
        True,
        description="stop a real probe early once its measured steps are confidently slower "
        "than the best trial's (throughput and step-time objectives)",
    )
    prune_margin: float = Field(
        0.5,
        gt=0,
        description="stop when the median measured step time exceeds the best's "
        "by more than this fraction (0.5: 50 %, above run-to-run noise)",
    )
    prune_min_steps: int = Field(2, ge=1, description="measured steps a probe shows before it may be stopped")
    stop_early: bool = Field(
        True,
        description="sampler auto: stop before the budget when the model's optimistic "
        "bound of every remaining config is below the best measured",
    )
    explore_kappa: float = Field(
        1.0,
        ge=0,
        description="sampler auto: optimism of the next pick, in standard deviations of the model's uncertainty",
    )
    fit_confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="sampler auto: probability of fitting in memory the first probe needs (nothing measured yet)",
    )
    min_fit_probability: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="sampler auto: the least probability of fitting "
        "in memory a config needs to be probed while likelier ones remain; higher: "
        "fewer OOM probes, a near-limit optimum found later (benchmarks/README.md)",
    )
    max_oom_share: float | None = Field(
        0.05,
        gt=0,
        lt=1,
        description="sampler auto: cap on OOM probes, as a share "
        "of n_trials (at least one); past it only configs fit_confidence likely to fit "
        "are probed; null: no cap (benchmarks/README.md shows the trade-off)",
    )
    max_doubt_probes: int = Field(
        2,
        ge=0,
        description="sampler auto: probes the guide may spend on families (tp/pp/cp/zero/recompute) not yet "
        "measured once a measured family has run consistently off its predictions (the model in doubt); 0: never",
    )
    memory_profiles: bool = Field(
        True,
        description="sampler auto: before a full probe of a config not sure to fit, run its layout with 1 and "
        "a few layers per pipeline stage (a memory profile, one or two steps) and probe it in full only if the "
        "fitted peak says it fits; skipped where the backend cannot shrink the model (a command backend "
        "without {num_layers}); the budget counts full-probe equivalents (docs/GUIDE.md)",
    )
    profile_go_probability: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="sampler auto: the probability of fitting, after its memory profile, that a config needs "
        "for its full probe; below it the trial ends as oom_predicted (no full probe)",
    )


class RecommendSpec(_Strict):
    """Which config the study recommends and exports (autotune/recommend.py states the rule)."""

    min_headroom_gib: float | None = Field(
        4.0,
        ge=0,
        description="when the best leaves less device memory free, "
        "recommend the best config within `tolerance` of it that leaves this much; "
        "null: always the best",
    )
    tolerance: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="how close to the best counts as as good (a share); "
        "default: the simulator's error on published runs (5.3 %) for predictions, the "
        "measurement noise (3 %) for measured trials",
    )


class TrackingSpec(_Strict):
    mlflow_uri: str | None = Field(None, description="default: SQLite file in the run directory")
    experiment: str | None = Field(None, description="default: the spec name")
    storage: str | None = Field(None, description="Optuna storage URL; default: a journal file in the run directory")


class RaySpec(_Strict):
    address: str | None = Field(None, description="None starts a local Ray; 'auto' or ray://host:port connects")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray (default: the machine's)")
    enabled: bool = Field(True, description="false runs real probes as local subprocesses without Ray")
    placement_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a trial spanning several nodes waits for "
        "its placement group (one bundle per node) before it is an infrastructure "
        "failure",
    )


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
        None,
        description="the stack that will run the chosen config in production; the space keeps only configs it can "
        "launch and the exports launch exactly the measured config (default: mindformers for the "
        "mindspore backend, mindspeed on npu, megatron elsewhere); 'none': no stack in mind, the "
        "space is not restricted and each export format refuses what it cannot launch",
    )
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
                raise ValueError(
                    f"unknown model preset {short_value(v)}; presets: {', '.join(PRESETS)}; or a path to "
                    f"a config.json, and as a path: {problem}"
                )
            path = Path(v) if Path(v).is_absolute() else base / v
            if v.endswith(".json") or _is_file(path):
                if not _is_file(path):
                    raise ValueError(f"config.json file {path} does not exist (or is not a regular file)")
                return _read_hf_config(path)
            raise ValueError(
                f"unknown model preset {short_value(v)}; presets: {', '.join(PRESETS)}; or a path to a config.json"
            )
        if isinstance(v, dict) and "preset" in v:
            preset = v["preset"]
            if not isinstance(preset, str) or preset not in PRESETS:
                raise ValueError(f"unknown model preset {short_value(preset)}; presets: {', '.join(PRESETS)}")
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
        return self.target or default_target(
            self.backend.kind, self.cluster.accelerator, tuple(self.space.choices()), workload_kind=self.workload.kind
        )

    def objective_list(self) -> list[tuple[str, str]]:
        """(metric, direction) pairs with defaults applied."""
        from autotune.objectives import get_metric

        default = {
            "train": "tokens_per_s_per_device",
            "infer": "decode_tokens_per_s_per_device",
            "serve": "goodput_rps_per_device",
        }
        objectives = self.objectives or [ObjectiveSpec(metric=default[self.workload.kind])]
        return [(o.metric, o.direction or get_metric(o.metric).direction) for o in objectives]

    def summary(self) -> str:
        w = self.workload
        if isinstance(w, TrainWorkload):
            work = f"train seq {w.seq_len} gbs {w.global_batch_size}"
        elif isinstance(w, ServeWorkload):
            prompt, output = w.traffic.mean()
            rates = "/".join(f"{r:g}" for r in w.traffic.rates)
            work = f"serve prompt ~{prompt:.0f} output ~{output:.0f} at {rates} req/s"
            work += f", SLO ttft p99 {w.slo.ttft_p99_ms:g} ms"
            if w.slo.tpot_p99_ms:
                work += f" tpot p99 {w.slo.tpot_p99_ms:g} ms"
        else:
            work = f"infer prompt {w.prompt_len} gen {w.gen_len}"
        objs = ", ".join(f"{m} ({d[:3]})" for m, d in self.objective_list())
        n = self.model.num_parameters()
        size = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
        return (
            f"{self.name}: {self.model.name} ({size} params), {work}, "
            f"{self.cluster.nodes}x{self.cluster.devices_per_node} {self.cluster.accelerator} "
            f"({self.cluster.profile_name}), {len(self.space.choices())} searched params, "
            f"backend {self.backend.kind}, target {self.target_stack}, objectives {objs}, "
            f"budget {self.search.n_trials} trials"
        )
