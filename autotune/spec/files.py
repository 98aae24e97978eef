"""The files a spec names, read for the loader: a model's config.json, a serving lengths file, a
hardware profile file.

:func:`read_spec_files` runs before the schema validates a spec (:func:`autotune.spec.load.parse_spec`):
it reads each file the raw spec names, relative to the spec's directory, and returns what it read, or
the problem it met, keyed by the field and the name; the schema's validator of that field takes it
(:func:`autotune.spec.fields.read_by_the_loader`), so the error keeps the field's path and line and
is reported with the spec's other errors, as when the schema read the file itself. The schema
(:mod:`autotune.spec.schema`) reads no file.

A lengths file is read cell by cell (:func:`_read_lengths`): integers only, never a boolean, a
repeated column or a quoted line of the file; an error never quotes the file's lines (the path may
lead anywhere), only a short, escaped excerpt of the offending cell. A config.json is read with the
spec's own bounds (a regular file of at most ``MAX_SPEC_BYTES``, UTF-8).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from autotune.workers.hardware import is_profile_file

from .bounded_read import NotRegularFile, read_bounded
from .models import PRESETS, load_hf_config
from .fields import MAX_SPEC_BYTES, MAX_SPEC_INT, _json_word, path_problem

__all__ = ["MAX_LENGTH_PAIRS", "MAX_LENGTHS_FILE_BYTES", "read_spec_files"]

MAX_LENGTH_PAIRS = 100_000
MAX_LENGTHS_FILE_BYTES = 64 * MAX_SPEC_BYTES


def read_spec_files(data: Any, base_dir: Path) -> dict[tuple[str, str], Any]:
    """``{(field, name): what was read}`` for each file the raw spec ``data`` names (``model: a
    config.json``, a serve workload's ``traffic.lengths_file``, ``cluster.profile: a profile file``);
    what was read is the file's content (the resolved path of a profile file) or the ValueError the
    schema reports at the field. Names that are no file (a model preset, a bundled profile) are left
    out, and so is anything the schema refuses before it would read the file (a name that is not a
    string)."""
    files: dict[tuple[str, str], Any] = {}
    if not isinstance(data, dict):
        return files
    model = data.get("model")
    if isinstance(model, str) and model not in PRESETS and not path_problem(model):
        path = _beside(base_dir, model)
        if model.endswith(".json") or _is_file(path):
            files["model", model] = _model_file(path)
    workload = data.get("workload")
    traffic = workload.get("traffic") if isinstance(workload, dict) and workload.get("kind") == "serve" else None
    name = _text(traffic.get("lengths_file")) if isinstance(traffic, dict) else None
    if name is not None:
        files["lengths_file", name] = _attempt(_read_lengths, base_dir, name)
    cluster = data.get("cluster")
    profile = _text(cluster.get("profile")) if isinstance(cluster, dict) else None
    if profile is not None and is_profile_file(profile):
        files["profile", profile] = _attempt(_profile_file, base_dir, profile)
    return files


def _text(value: Any) -> str | None:
    """A name as the schema's ``str`` field reads it (bytes as UTF-8), or None."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def _attempt(read: Any, *args: Any) -> Any:
    try:
        return read(*args)
    except ValueError as exc:
        return exc


def _model_file(path: Path) -> Any:
    if not _is_file(path):
        return ValueError(f"config.json file {path} does not exist (or is not a regular file)")
    return _attempt(_read_hf_config, path)


def _profile_file(base: Path, name: str) -> str:
    """The resolved path of a hardware profile file named relative to the spec."""
    problem = path_problem(name)
    if problem:
        raise ValueError(f"the hardware profile file's path: {problem}")
    path = _beside(base, name)
    if not _is_file(path):
        raise ValueError(f"hardware profile file {path} does not exist (write one with `autotune calibrate`)")
    return str(path.resolve())


def _beside(base: Path, name: str) -> Path:
    """The file a spec names: an absolute path as it is, a relative one beside the spec."""
    return Path(name) if Path(name).is_absolute() else base / name


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


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


_LENGTH_COLUMNS = ("prompt_len", "output_len")
# a public trace's own names beside ours: Mooncake's trace format (kvcache-ai/Mooncake, FAST'25 traces,
# mooncake_trace.jsonl at d21da178: "timestamp" in milliseconds since the first request, "input_length",
# "output_length", "hash_ids" (its prompt's blocks: shared ids, a shared prefix; workers/trace_prefix.py));
# an arrival time in seconds is "arrival_s"
_ALIASES = {"prompt_len": "input_length", "output_len": "output_length"}
_TIME_COLUMNS = {"arrival_s": 1.0, "timestamp": 1e-3}  # the column and its unit in seconds
_BLOCKS_COLUMN = "hash_ids"
_READ_ONCE = (*_LENGTH_COLUMNS, *_ALIASES.values(), *_TIME_COLUMNS, _BLOCKS_COLUMN)
MAX_TRACE_BLOCKS = 2_000_000  # block ids in a whole trace (Mooncake's 23,608 requests hold about 300,000)
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
            if key in out and key in _READ_ONCE:
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
                missing = [name for name in _LENGTH_COLUMNS if name not in seen and _ALIASES[name] not in seen]
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


def _time_value(value: Any) -> tuple[float | None, str]:
    """A trace's arrival time cell as a number of its unit, or (None, why not)."""
    if isinstance(value, bool):
        return None, "a boolean, not a time"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None, "not a number"
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, "not a finite number"
    if value < 0:
        return None, "below 0"
    return float(value), ""


def _block_ids(value: Any) -> tuple[list[int] | None, str]:
    """A trace row's ``hash_ids`` as a list of block ids, or (None, why not): a JSON list of integers
    from 0 to 2**53 - 1 (never booleans)."""
    if not isinstance(value, list):
        return None, "not a list of block ids"
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            return None, f"holds {_excerpt(item)}, not an integer block id"
        if not 0 <= item <= MAX_SPEC_INT:
            return None, f"holds {item}, not a block id from 0 to 2**53 - 1"
        out.append(item)
    return out, ""


def _read_lengths(base: Path, name: str) -> dict[str, Any]:
    """``{"pairs": [(prompt_len, output_len), ...], "arrival_s": [seconds, ...] or None, "blocks":
    [[block id, ...], ...] or None}`` of a
    JSON-lines or CSV file (our column names or Mooncake's trace format: :data:`_ALIASES`,
    :data:`_TIME_COLUMNS`); a ValueError naming the file, the line and what was expected otherwise.
    An error never quotes the file's lines (the path may lead anywhere: a symlink to /etc/passwd):
    it names the line, the column and the kind of problem, with at most a short, escaped excerpt of
    the offending cell. Arrival times, where the rows have them, are in every row, in arrival order;
    so are the prompts' block ids (Mooncake's ``hash_ids``, JSON lines only), where the first row has
    them."""
    problem = path_problem(name)
    if problem:
        raise ValueError(f"lengths_file: {problem}")
    path = _beside(base, name)
    if not _is_file(path):
        raise ValueError(f"lengths_file {path} does not exist (or is not a regular file)")
    where = f"lengths_file {path}"
    text = _open_lengths_file(path, where)
    is_csv = path.suffix.lower() == ".csv"
    records = _csv_records(text, where) if is_csv else _json_records(text, where)
    pairs: list[tuple[int, int]] = []
    times: list[float] | None = None
    time_column: str | None = None
    blocks: list[list[int]] | None = None
    block_count = 0
    for record, (line, row) in enumerate(records, 1):
        at = f"{where} line {line}, record {record}"
        columns = [c if c in row else _ALIASES[c] for c in _LENGTH_COLUMNS]
        missing = [c for c, found in zip(_LENGTH_COLUMNS, columns) if found not in row]
        if missing:
            # named as the record names its lengths: a Mooncake trace's input_length without its
            # output_length is told about output_length, not output_len
            mooncake = any(_ALIASES[c] in row for c in _LENGTH_COLUMNS)
            named = [_ALIASES[c] if mooncake else c for c in missing]
            raise ValueError(
                f"{at}: expected prompt_len and output_len (or Mooncake's input_length and output_length), "
                f"positive integers; the {'row' if is_csv else 'object'} has no {' or '.join(named)}"
            )
        pair = []
        for column in columns:
            value, why = _length_value(row[column])
            if value is None:
                raise ValueError(f"{at}: {column} is {_excerpt(row[column])}, {why}; {_EXPECTED_LENGTHS}")
            pair.append(value)
        pairs.append((pair[0], pair[1]))
        named = [c for c in _TIME_COLUMNS if c in row]
        if record == 1 and named:
            time_column, times = named[0], []
        if time_column is not None and times is not None:
            if time_column not in row:
                raise ValueError(f"{at}: no {time_column}, which the first record gives; a trace times every request")
            when, why = _time_value(row[time_column])
            if when is None:
                raise ValueError(
                    f"{at}: {time_column} is {_excerpt(row[time_column])}, {why}; expected the arrival time"
                )
            when *= _TIME_COLUMNS[time_column]
            if times and when < times[-1]:
                raise ValueError(
                    f"{at}: {time_column} goes back in time ({when:g} s after {times[-1]:g} s); a trace lists its "
                    "requests in arrival order"
                )
            times.append(when)
        if record == 1 and _BLOCKS_COLUMN in row:
            if is_csv:
                raise ValueError(
                    f"{at}: hash_ids is a list, which a CSV cell cannot hold; give the trace as JSON lines"
                )
            blocks = []
        if blocks is not None:
            if _BLOCKS_COLUMN not in row:
                raise ValueError(
                    f"{at}: no hash_ids, which the first record gives; a trace names every prompt's blocks"
                )
            ids, why = _block_ids(row[_BLOCKS_COLUMN])
            if ids is None:
                raise ValueError(f"{at}: hash_ids {why}; expected the ids of the prompt's blocks (Mooncake's trace)")
            block_count += len(ids)
            if block_count > MAX_TRACE_BLOCKS:
                raise ValueError(f"{where} names more than {MAX_TRACE_BLOCKS:,} block ids in hash_ids; at most that")
            blocks.append(ids)
        if len(pairs) > MAX_LENGTH_PAIRS:
            raise ValueError(f"{where} holds more than {MAX_LENGTH_PAIRS:,} pairs; at most {MAX_LENGTH_PAIRS:,}")
    if not pairs:
        raise ValueError(f"{where} holds no length pairs")
    return {"pairs": pairs, "arrival_s": times, "blocks": blocks}
