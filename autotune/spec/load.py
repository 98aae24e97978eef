"""Reading a spec file: a bounded, typed read, YAML with its locations, the files the spec names
(:mod:`autotune.spec.files`), then the schema and the checks.

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

:func:`load_spec` turns any problem into a :class:`~autotune.spec.errors.SpecError` whose lines
name the file, the line, the field and what was expected.
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .schema import MAX_SPEC_BYTES, MAX_SPEC_INT, Spec, short_value
from .checks import semantic_problems
from .bounded_read import NotRegularFile, read_bounded
from .errors import SpecError, SpecProblem, _format_pydantic, _line_of
from .files import read_spec_files

__all__ = ["MAX_SPEC_BYTES", "load_spec", "parse_spec", "parse_spec_text", "read_spec_text", "decode_spec_bytes"]


def parse_spec(data: Any, file: str = "<spec>", base_dir: Path | None = None, root: yaml.Node | None = None) -> Spec:
    """Validate an already-parsed mapping (``load_spec`` reads the file and keeps line numbers)."""
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"{type(data).__name__} {short_value(data)}"
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    f"expected a mapping of sections at the top level (name:, model:, workload:, cluster:, space:, "
                    f"...), got {got}",
                )
            ],
        )
    problems = _oversized_ints(data)
    if problems:
        for p in problems:
            p.line = _line_of(root, p.loc)
        raise SpecError(file, problems)
    try:
        files = read_spec_files(data, Path(base_dir or "."))  # what the spec names, read for the schema
        spec = Spec.model_validate(data, context={"files": files})
    except RecursionError:
        raise SpecError(file, [SpecProblem((), "nested too deeply to read (a spec nests a few levels)")]) from None
    except ValidationError as exc:
        problems = _format_pydantic(exc, data)
        for p in problems:
            p.line = _line_of(root, p.loc, key=p.key)
        raise SpecError(file, problems) from None
    problems = semantic_problems(spec)
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
        raise refuse(
            f"cannot read the spec: it is {_file_kind(info.st_mode)}, not a regular file; give the path of "
            "a YAML spec file"
        )
    if info.st_size > MAX_SPEC_BYTES:
        raise refuse(
            f"cannot read the spec: it is {info.st_size:,} bytes, above the limit of {MAX_SPEC_BYTES:,} "
            "bytes (1 MiB; a spec is a few KiB)"
        )
    try:
        raw = read_bounded(path, MAX_SPEC_BYTES)
    except NotRegularFile as exc:  # replaced between the stat and the open
        raise refuse(f"cannot read the spec: it is {_file_kind(exc.mode)}, not a regular file") from None
    except OSError as exc:
        raise refuse(f"cannot read the spec: {_os_reason(exc)}") from None
    if len(raw) > MAX_SPEC_BYTES:  # grew since the stat
        raise refuse(
            f"cannot read the spec: it is larger than the limit of {MAX_SPEC_BYTES:,} bytes (1 MiB; a spec "
            "is a few KiB)"
        )
    return decode_spec_bytes(raw, file)


def decode_spec_bytes(raw: bytes, file: str = "<spec>") -> str:
    """UTF-8 text of a spec's bytes (see :func:`read_spec_text`), or a :class:`SpecError`."""
    convert = f"convert it, e.g. `iconv -f {{enc}} -t UTF-8 {file} > spec-utf8.yaml`"
    for boms, encoding in ((_UTF32_BOMS, "UTF-32"), (_UTF16_BOMS, "UTF-16")):
        if raw.startswith(boms):
            raise SpecError(
                file,
                [
                    SpecProblem(
                        (),
                        f"the spec is {encoding} text (it starts with a {encoding} "
                        "byte-order mark); autotune reads specs in UTF-8: " + convert.format(enc=encoding),
                    )
                ],
            )
    raw = raw.removeprefix(codecs.BOM_UTF8)
    nul = raw.find(b"\0")
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    "the spec holds NUL bytes, so it is not UTF-8 text: a binary file, "
                    "or UTF-16/UTF-32 without a byte-order mark; " + convert.format(enc="UTF-16"),
                    line,
                )
            ],
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    f"the spec is not UTF-8 text: byte 0x{raw[exc.start]:02x} at column "
                    f"{column} ({exc.reason}); Latin-1 or Windows-1252 perhaps: " + convert.format(enc="LATIN1"),
                    line,
                )
            ],
        ) from None


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
                None,
                None,
                f"cannot read the {node.tag.rsplit(':', 1)[-1]} value {short_value(getattr(node, 'value', ''))}: "
                f"{type(exc).__name__}: {exc}",
                node.start_mark,
            ) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """PyYAML's int (``0x1F``, ``0o17``/``017``, ``1:20``), refusing one of more characters
        than a spec's largest integer needs before building it: a sexagesimal ``1:1:1:...`` of a
        few hundred KiB takes PyYAML minutes (each ``:`` multiplies a growing number by 60)."""
        text = self.construct_scalar(node)
        if len(text) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer written in {len(text):,} characters; a spec's integers are at most "
                f"2**53 - 1 ({MAX_SPEC_INT:,})",
                node.start_mark,
            )
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
                    problems.append(
                        SpecProblem(
                            loc + ("<<",),
                            (
                                "a second merge key '<<' in one mapping (the first is at line "
                                f"{first_merge.start_mark.line + 1}); "
                                "merge several mappings with one: `<<: [*first, *second]`"
                            ),
                            key.start_mark.line + 1,
                        )
                    )
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
                same = "" if earlier.value == shown else f" (read as the same key as {short_value(earlier.value)})"
                problems.append(
                    SpecProblem(
                        loc + (shown,),
                        (
                            f"duplicate key {short_value(shown)}{same}: already at line "
                            f"{earlier.start_mark.line + 1}; YAML keeps "
                            "only the last one, silently: write the key once"
                        ),
                        key.start_mark.line + 1,
                    )
                )
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
            raise SpecError(
                file,
                [
                    SpecProblem(
                        (),
                        f"the YAML expands to more than {MAX_YAML_VALUES:,} values through its "
                        "aliases (*name); a spec needs a few hundred: write the values out",
                    )
                ],
            )
        duplicates = _duplicate_keys(root, loader)
        if duplicates:
            raise SpecError(file, duplicates)
        data = loader.construct_document(root) if root is not None else None
    except _TooManyValues:
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    (
                        f"the YAML holds more than {MAX_YAML_VALUES:,} values (keys and values); a spec needs a few "
                        "hundred "
                        "(a long run of integers is a range: {low, high, step})"
                    ),
                )
            ],
        ) from None
    except _RecursiveAlias as exc:
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    "invalid YAML: an alias (*name) inside the node its anchor (&name) "
                    "names, a structure that contains itself",
                    exc.line,
                )
            ],
        ) from None
    except RecursionError:
        raise SpecError(
            file, [SpecProblem((), "invalid YAML: nested too deeply to read (a spec nests a few levels)")]
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise SpecError(
            file, [SpecProblem((), f"invalid YAML: {exc.problem} {exc.context or ''}".strip(), line)]
        ) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1 if isinstance(exc.position, int) else None
        what = f"#x{exc.character:04x}" if isinstance(exc.character, int) else short_value(exc.character)
        raise SpecError(
            file,
            [
                SpecProblem(
                    (),
                    f"invalid YAML: unacceptable character {what}: {exc.reason} (control "
                    "characters are written as escapes in a double-quoted string)",
                    line,
                )
            ],
        ) from None
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
