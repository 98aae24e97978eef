"""The field-level rules every section of the spec's schema uses, and the base of its sections.

:class:`Strict` is every section's base (``extra="forbid"``: a misspelt key is an error, never
silently ignored). Every environment variable name, wherever it enters the spec (``space.env``,
``backend.env``, ``backend.secret_env``, the ``env.VAR`` keys of ``baseline``), follows one rule,
:data:`ENV_NAME_RULE`: a POSIX shell name. The values the simulator reads
(``PYTORCH_NPU_ALLOC_CONF``, ``PYTORCH_CUDA_ALLOC_CONF``, ``HCCL_BUFFSIZE``,
``MULTI_STREAM_MEMORY_REUSE``) are checked here (:func:`env_value_problem`, parsing allocator
configs as the simulator does: :mod:`autotune.workers.alloc_conf`), with their field path, not
first in ``plan``. The values of ``space.env``, ``space.engine`` and a baseline's ``env.VAR`` reach
launch scripts, flags and JSON configs (:func:`setting_value_problem`): no NaN or Infinity, no
control, line-separator or bidi character, and no engine string starting with ``-`` (read as a
flag of its own after ``--NAME``).

The files a spec names (a model's config.json, a serving lengths file, a hardware profile file)
are read by the loader (:mod:`autotune.spec.files`), which hands what it read, or the problem it
met, to the validation through its context; :func:`read_by_the_loader` is how a section's
validator takes it, so a problem keeps its field's path. Why a module of its own: these rules are
shared by every section module (:mod:`autotune.spec.schema`, :mod:`autotune.spec.workload_section`,
:mod:`autotune.spec.space_section`) and by the checks across sections (:mod:`autotune.spec.checks`).
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, ConfigDict

from autotune.workers.alloc_conf import parse_alloc_conf
from autotune.workers.protocol import ENV_NAME

__all__ = [
    "ENV_NAME_RULE",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_INT",
    "EngineName",
    "EngineSetting",
    "EnvName",
    "EnvSetting",
    "Strict",
    "env_name_problem",
    "env_value_problem",
    "path_problem",
    "read_by_the_loader",
    "setting_value_problem",
    "short_value",
]


class Strict(BaseModel):
    """The base of every section: an unknown key is an error, and defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


def read_by_the_loader(info: Any, field: str, name: str) -> Any:
    """What the loader (:func:`autotune.spec.files.read_spec_files`) read of the file ``name`` that
    ``field`` names: its content (or resolved path), None when it read nothing for it (not a file,
    or a spec validated without the loader); the problem it met is raised here, as the ValueError
    of the field that names the file."""
    found = ((info.context or {}).get("files") or {}).get((field, name))
    if isinstance(found, ValueError):
        raise ValueError(str(found))
    return found


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


def short_value(value: Any, limit: int = 120) -> str:
    """``repr(value)``, shortened: an error quotes what the spec says, not megabytes of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, (str, bytes)) else f"{len(text):,} characters shown"
    return f"{text[: limit - 40]}...{text[-20:]} ({size})"


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
