"""Property-based fuzzing of specs and constraint expressions (issue #13): whatever a user writes,
autotune answers with a spec or with errors that each name the file and a field, never with a
traceback; a constraint either compiles and evaluates or is an ``ExpressionError``.

The spec fuzzer mutates a valid spec at random paths with values a hand-written or generated
YAML file can hold (huge and negative integers, floats, NaN, markup, nested containers, wrong
types, missing sections), writes it as YAML and loads it the way ``autotune validate`` does; a
sample of the mutants also goes through the CLI (exit 0 or 2, nothing else).

A second fuzzer (issue #31) mutates the file itself, as text and bytes: keys written twice at
any depth, merge keys and aliases (which must read as the spec they stand for), encodings and
byte-order marks, binary, YAML tags and YAML 1.1 scalars, huge strings and deep nesting, control
and bidi characters; and special spec paths (a directory, a FIFO, /dev/zero, a missing file, a
symlink loop). The default run is fast; the deep run sends thousands of these mutants through
``autotune validate`` and ``autotune plan`` and counts exit codes, tracebacks and exit 70s::

    python tests/test_fuzz_spec.py --mutants 3000 --seed 0      # prints the figures (JSON)
    pytest -m slow tests/test_fuzz_spec.py                      # the same, asserted

A third (issue #42) mutates serve specs (tests/fuzz_serving.py): traffic, SLO, lengths files with
their encodings, paths and values (Infinity, 1e300, true, duplicate CSV columns), user-written
length pairs, engine settings with control characters, flag-like and non-finite values. Each
mutant goes through ``autotune validate`` and ``autotune plan --json``: no traceback, no exit 70,
no hang, validate and plan agree, no control character printed, the plan strict JSON, and what
the mutation promises (refused, or accepted) kept. 200 seeded mutants by default::

    AUTOTUNE_FUZZ_N=10000 pytest tests/test_fuzz_spec.py -k serving          # the issue's run
    python tests/test_fuzz_spec.py --serving --mutants 10000 --seed 0         # the same, figures as JSON
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import string
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autotune.spec.safe_expr import ExpressionError, compile_expression  # noqa: E402
from autotune.spec.schema import Spec  # noqa: E402
from autotune.spec.errors import SpecError  # noqa: E402
from autotune.spec.load import load_spec  # noqa: E402
from support import TINY_TRAIN  # noqa: E402

BASE = yaml.safe_load(TINY_TRAIN)
BASE.update(
    {
        "constraints": ["tp * pp <= 2"],
        "baseline": {"tp": 1, "pp": 1, "micro_batch_size": 1, "zero_stage": 0, "recompute": "none"},
    }
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**53, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(
        [
            "[/bold]",
            "[red]x",
            "$(rm -rf /)",
            "a\nb",
            "\x00",
            "🙂",
            "1e30",
            "auto",
            "{trial_file}",
            "none",
            "tp",
            "env.X",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


EXAMPLES = int(os.environ.get("AUTOTUNE_FUZZ_EXAMPLES", "300"))  # more: AUTOTUNE_FUZZ_EXAMPLES=5000
PATHS = [p for p in _paths(BASE) if p]
KEYS = sorted(
    {p[-1] for p in PATHS if isinstance(p[-1], str)}
    | {"low", "high", "step", "log", "env", "argv", "metric_patterns", "target", "profile", "overrides"}
)


def like(original):
    """Values of the original's own type, extremes included: these pass the type checks and
    reach the code behind them (the ranking, the memory model)."""
    ints = st.one_of(
        st.sampled_from([1, 2, 4, 8, 3, 2**20, 2**53 - 1, 2**53, 2**63, 10**30, 0, -1]),
        st.integers(min_value=-(2**70), max_value=2**70),
    )
    if isinstance(original, bool):
        return st.booleans()
    if isinstance(original, int):
        return ints
    if isinstance(original, float):
        return st.floats(allow_nan=True, allow_infinity=True)
    if isinstance(original, str):
        return st.one_of(st.sampled_from([original.upper(), original + "x", "", " ", "[/bold]"]), st.text(max_size=20))
    if (
        isinstance(original, list)
        and original
        and all(isinstance(v, int) and not isinstance(v, bool) for v in original)
    ):
        return st.one_of(
            st.lists(ints, min_size=1, max_size=4, unique=True), st.fixed_dictionaries({"low": ints, "high": ints})
        )
    if isinstance(original, list):
        return st.lists(st.sampled_from(original + [None, "full", 7]), max_size=5)
    return values


@st.composite
def mutated_specs(draw):
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=2))):
        path = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for part in path[:-1]:
                parent = parent[part]
        except (KeyError, IndexError, TypeError):
            continue
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if not isinstance(parent, (dict, list)):
            continue
        if action == "delete" and isinstance(parent, dict):
            parent.pop(path[-1], None)
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS))] = draw(values)
        else:
            try:
                original = parent[path[-1]]
                parent[path[-1]] = draw(st.one_of(like(original), like(original), values))
            except (KeyError, IndexError, TypeError):  # deleted by an earlier mutation
                continue
    return data


def _check(path, spec_or_error):
    if isinstance(spec_or_error, SpecError):
        assert spec_or_error.problems
        for problem in spec_or_error.problems:
            line = problem.render(spec_or_error.file)
            assert line.startswith(str(path)) and problem.message, line
        return
    assert isinstance(spec_or_error, Spec)
    # a valid spec is one the model can rank, as `autotune plan` does (a space too large to
    # enumerate is the one error plan reports, as a ValueError naming the limit)
    from autotune.spec.resolve import objectives_of, probe_context
    from autotune.guide.ranking import rank_space
    from autotune.spec.space import Space

    spec = spec_or_error
    try:
        enumeration = Space(spec).enumerate(limit=spec.search.exhaustive_limit)
    except ValueError as exc:
        assert "limit" in str(exc) or "exhaustive" in str(exc), exc
        return
    ranking = rank_space(enumeration, probe_context(spec), objectives_of(spec))
    assert ranking.fit <= enumeration.valid <= enumeration.space_size


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=mutated_specs())
def test_fuzzed_specs_are_a_spec_or_located_errors(tmp_path, data):
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    try:
        outcome = load_spec(path)
    except SpecError as exc:
        outcome = exc
    _check(path, outcome)


@settings(
    max_examples=max(EXAMPLES // 8, 20),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=mutated_specs())
def test_fuzzed_specs_through_the_cli_exit_0_or_2(tmp_path, data):
    from typer.testing import CliRunner

    from autotune.cli.commands import app

    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    if result.exit_code == 0:  # a valid spec is also one the model can rank (exit 1: nothing fits)
        planned = CliRunner().invoke(app, ["plan", str(path), "--json"])
        assert planned.exit_code in (0, 1), planned.output


@settings(
    max_examples=max(EXAMPLES // 3, 20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=string.printable, max_size=200))
def test_arbitrary_yaml_text_is_a_spec_or_located_errors(tmp_path, text):
    path = tmp_path / "text.yaml"
    path.write_text(text)
    try:
        outcome = load_spec(path)
    except SpecError as exc:
        outcome = exc
    _check(path, outcome)


# -------------------------------------------------------------------------------- expressions
NAMES = ["tp", "pp", "mbs", "heads", "recompute", "sp"]
ENV = {"tp": 2, "pp": 4, "mbs": 1, "heads": 32, "recompute": "full", "sp": True}
tokens = st.sampled_from(
    NAMES
    + [
        "1",
        "0",
        "-1",
        "2.5",
        "10**9",
        "9**9",
        "'full'",
        "'a'",
        "True",
        "None",
        "+",
        "-",
        "*",
        "/",
        "//",
        "%",
        "**",
        "==",
        "!=",
        "<",
        ">=",
        "and",
        "or",
        "not",
        "in",
        "(",
        ")",
        ",",
        "[",
        "]",
        "if",
        "else",
        "min(",
        "max(",
        "abs(",
        "lambda",
        ".",
        "__class__",
        "env.X",
        "'x' * 10**10",
        "1e308",
    ]
)


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(parts=st.lists(tokens, min_size=1, max_size=25))
def test_fuzzed_constraints_compile_and_evaluate_or_say_why(parts):
    source = " ".join(parts)
    try:
        expression = compile_expression(source, set(NAMES) | {"env.X"})
    except ExpressionError as exc:
        assert str(exc)
        return
    env = {**ENV, "env.X": "200"}
    columns = {k: np.array([v, v], dtype=object if isinstance(v, str) else None) for k, v in env.items()}
    try:  # the scalar form (a baseline) and the column form (the whole space at once)
        expression.evaluate(env)
        expression.evaluate(columns)
    except ExpressionError as exc:
        assert source in str(exc) or repr(source) in str(exc)


# ===================================================================== the file itself (issue #31)
# A valid spec whose every section is a mapping somewhere: keys to write twice, mappings to merge.
FILE_BASE: dict = copy.deepcopy(BASE)
FILE_BASE["objectives"] = [{"metric": "tokens_per_s_per_device"}]
FILE_BASE["space"]["env"] = {"HCCL_BUFFSIZE": [120, 200]}
FILE_BASE["backend"] = {"kind": "simulate", "env": {"A_FLAG": "1"}}
FILE_BASE["description"] = "fuzz"
FILE_BASE["recommend"] = {"min_headroom_gib": 4.0}


class Raw(str):
    """YAML text written as it is (a tag, a YAML 1.1 word, an alias)."""


_RESOLVER = yaml.resolver.Resolver()


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar: every character YAML cannot hold as it is, escaped."""
    out = []
    for ch in json.dumps(text, ensure_ascii=False)[1:-1]:
        out.append(
            ch if ch.isprintable() or ch == " " else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}"
        )
    return '"' + "".join(out) + '"'


def _scalar(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_ .-]*", value) and not value.endswith(" ")
        if plain and _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) == "tag:yaml.org,2002:str":
            return value
        return _quoted(value)
    return yaml.safe_dump(value).split("\n", 1)[0]


def _key(key) -> str:
    return key if isinstance(key, Raw) else _scalar(key)


def flow(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    return _scalar(value)


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate: bytes no UTF-8 reader accepts


class Doc:
    """YAML text of a spec, each mapping in block or flow style at random, with extra key/value
    pairs (a key written twice) put into the mapping at a path; ``lines`` keeps the line each
    extra pair is written on."""

    def __init__(self, rng: random.Random, flow_share: float = 0.3):
        self.rng, self.flow_share = rng, flow_share
        self.extra: dict[tuple, list[tuple[int, object, object, str]]] = {}
        self.lines: dict[str, int] = {}

    def render(self, data) -> str:
        out: list[str] = []
        self._block(data, 0, (), out)
        return "\n".join(out) + "\n"

    def _pairs(self, mapping: dict, path: tuple):
        items = [(k, v, None) for k, v in mapping.items()]
        for index, key, value, label in sorted(self.extra.get(path, []), key=lambda e: -e[0]):
            items.insert(index, (key, value, label))
        return items

    def _block(self, mapping: dict, indent: int, path: tuple, out: list[str]) -> None:
        for key, value, label in self._pairs(mapping, path):
            if label:
                self.lines[label] = len(out) + 1
            pad = " " * indent
            if isinstance(value, dict) and value and not isinstance(value, Raw) and self.rng.random() > self.flow_share:
                out.append(f"{pad}{_key(key)}:")
                self._block(value, indent + 2, path + (key,), out)
            elif isinstance(value, dict) and value:
                out.append(f"{pad}{_key(key)}: {self._flow_mapping(value, path + (key,), len(out) + 1)}")
            elif isinstance(value, list) and any(isinstance(x, dict) for x in value):
                out.append(f"{pad}{_key(key)}:")
                for i, item in enumerate(value):
                    if isinstance(item, dict) and item:
                        out.append(f"{pad}  - {self._flow_mapping(item, path + (key, i), len(out) + 1)}")
                    else:
                        out.append(f"{pad}  - {flow(item)}")
            else:
                out.append(f"{pad}{_key(key)}: {flow(value)}")

    def _flow_mapping(self, mapping: dict, path: tuple, line: int) -> str:
        parts = []
        for key, value, label in self._pairs(mapping, path):
            if label:
                self.lines[label] = line
            inner = self._flow_mapping(value, path + (key,), line) if isinstance(value, dict) and value else flow(value)
            parts.append(f"{_key(key)}: {inner}")
        return "{" + ", ".join(parts) + "}"


def _mapping_paths(data, prefix=()):
    if isinstance(data, dict):
        yield prefix, data
        for k, v in data.items():
            yield from _mapping_paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _mapping_paths(v, prefix + (i,))


def _scalar_paths(data, prefix=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _scalar_paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _scalar_paths(v, prefix + (i,))
    else:
        yield prefix


def _set(data, path, value):
    for part in path[:-1]:
        data = data[part]
    data[path[-1]] = value


def _get(data, path):
    for part in path:
        data = data[part]
    return data


TAGS = [
    "!!python/object:os.system",
    "!!python/object/apply:os.system",
    "!!python/name:os.system",
    "!custom",
    "!!str",
    "!!int",
    "!!float",
    "!!bool",
    "!!null",
    "!!binary",
    "!!timestamp",
    "!!set",
    "!!omap",
    "!!pairs",
    "!<tag:yaml.org,2002:int>",
    "!<tag:example.com,2000:x>",
    "!!map",
    "!!seq",
    "!",
]
YAML11 = [
    "yes",
    "no",
    "on",
    "off",
    "y",
    "n",
    "Yes",
    "NO",
    "On",
    "OFF",
    "~",
    "null",
    "0o17",
    "017",
    "0x1F",
    "0b101",
    "1:20",
    "1:20.5",
    "190:20:30",
    "-1:00",
    ".inf",
    "-.Inf",
    ".NaN",
    "1e3",
    "1.0e+3",
    "1_000",
    "+1",
    "0",
    "2001-12-14",
    "2001-02-30",
    "2001-13-01t10:00:00Z",
    "2001-12-14 21:59:43.10 -5",
    "=",
    "<<",
    "'<<'",
    "0.",
    ".5",
    "-0",
    "09",
    "0x_1",
    "1__0",
    "12:60",
    "!!int 0x",
    "!!float .",
    "!!bool maybe",
]
NASTY = [
    "\u202etp",
    "\x1b[31mred\x1b[0m",
    "a\u200bb",
    "\u2066x\u2069",
    "line\u2028sep",
    "nul\x00",
    "tab\tx",
    "\ufeff",
    "\ud800",
    "[/bold]",
    "$(touch PWNED)",
    "X=1;touch PWNED;#",
    "é",
    "🙂",
    "\x85",
    "\x7f",
]
SPECIAL_PATHS = [
    "directory",
    "fifo",
    "dev_zero",
    "dev_null",
    "missing",
    "symlink_loop",
    "dangling_symlink",
    "symlink_to_dev_zero",
    "symlink_to_fifo",
    "empty",
    "name_too_long",
    "nul_in_path",
    "not_a_directory",
]
KINDS = [
    "duplicate",
    "duplicate_spelling",
    "merge",
    "merge_override",
    "two_merges",
    "alias",
    "encoding",
    "binary",
    "tag",
    "yaml11",
    "huge",
    "deep",
    "nasty",
    "data",
]


def _random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth < 2 and pick < 0.15:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 2 and pick < 0.25:
        return {rng.choice(KEYS + ["x", "tp", "env"]): _random_value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            1,
            -1,
            2,
            8,
            2**31,
            2**53,
            2**63,
            10**30,
            1.5,
            -0.0,
            float("nan"),
            float("inf"),
            "",
            "x",
            "auto",
            "full",
            "none",
            "bf16",
            "tp",
            "env.X",
            "{trial_file}",
            "1e30",
            "[/bold]",
            "a b",
            "tiny-llama",
            *NASTY,
        ]
    )


def random_data_mutant(rng: random.Random) -> dict:
    """The data-level mutants of ``mutated_specs`` (above), drawn from ``rng`` for the deep run."""
    data = copy.deepcopy(BASE)
    for _ in range(rng.randint(1, 2)):
        path = rng.choice(PATHS)
        try:
            parent = _get(data, path[:-1])
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):
            continue
        action = rng.choice(["replace", "delete", "add"])
        if action == "delete" and isinstance(parent, dict):
            parent.pop(path[-1], None)
        elif action == "add" and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = _random_value(rng)
        else:
            try:
                parent[path[-1]] = _random_value(rng)
            except (IndexError, TypeError):
                continue
    return data


def file_mutant(rng: random.Random, kind: str, base: dict | None = None) -> tuple[bytes, dict]:
    """(the bytes of a spec file, what must come of it): ``same`` (reads as ``base`` does,
    FILE_BASE by default), ``duplicate_line`` (refused, a duplicate key on that line), ``error``
    (refused), or nothing (a spec or located errors)."""
    base = FILE_BASE if base is None else base
    data = copy.deepcopy(base)
    doc = Doc(rng)
    expect: dict = {}
    if kind in ("duplicate", "duplicate_spelling"):
        path, mapping = rng.choice([(p, m) for p, m in _mapping_paths(data) if m])
        keys = list(mapping)
        key = rng.choice(keys)
        written = key
        if kind == "duplicate_spelling" and isinstance(key, str):
            written = Raw(rng.choice([f"'{key}'", json.dumps(key), f"!!str {key}"]))
        index = rng.randint(keys.index(key) + 1, len(keys))
        value = rng.choice([mapping[key], 1, "x", [1, 2], {"low": 1, "high": 2}, None, True])
        doc.extra[path] = [(index, written, value, "dup")]
        text = doc.render(data)
        expect = {"duplicate_line": doc.lines["dup"], "duplicate_path": path + (key,)}
        return _encode(text), expect
    if kind in ("merge", "merge_override", "two_merges"):
        path, mapping = rng.choice([(p, m) for p, m in _mapping_paths(data) if m and p])
        keys = list(mapping)
        moved = rng.sample(keys, rng.randint(1, len(keys)))
        merged = {k: mapping[k] for k in moved}
        kept = {k: v for k, v in mapping.items() if k not in moved}
        if kind == "merge_override":  # a merged key the mapping also writes: the written one is read
            key = rng.choice(keys)
            merged[key] = rng.choice(["overridden", 12345, [9], {"x": 1}])
            kept[key] = mapping[key]
        if kind == "two_merges" and len(merged) > 1:
            first = dict(list(merged.items())[: len(merged) // 2])
            second = dict(list(merged.items())[len(merged) // 2 :])
            new = {Raw("<<"): first, Raw("<< "): second, **kept}  # two keys spelt '<<'
            expect = {"error": "a second merge key"}
        else:
            style = rng.choice(["single", "list", "anchor"])
            value = {"single": merged, "list": [merged, {}], "anchor": Raw("&m " + flow(merged))}[style]
            new = {Raw("<<"): value, **kept}
            expect = {"same": base}
        rebuilt = _get(data, path[:-1]) if len(path) > 1 else data
        rebuilt[path[-1]] = new
        return _encode(doc.render(data)), expect
    if kind == "alias":
        values = [(p, _get(data, p)) for p in _scalar_paths(data)] + [
            (p, m) for p, m in _mapping_paths(data) if p and m and not isinstance(p[-1], int)
        ]
        pairs = [(a, b) for a, b in zip(values, values[1:]) if a[1] == b[1] and type(a[1]) is type(b[1])]
        lists = [(p, v) for p, v in ((p, _get(data, p)) for p in _paths(base) if p and isinstance(_get(data, p), list))]
        for p, v in lists:
            for q, w in lists:
                if p < q and v == w:
                    pairs.append(((p, v), (q, w)))
        if pairs:
            (first, value), (second, _) = rng.choice(pairs)
            for anchor, alias in ((first, second), (second, first)):  # the anchor is written first
                marked = copy.deepcopy(data)
                _set(marked, anchor, Raw("&shared " + flow(value)))
                _set(marked, alias, Raw("*shared"))
                text = Doc(random.Random(0), flow_share=0.0).render(marked)
                if text.index("&shared") < text.index("*shared"):
                    return _encode(text), {"same": base}
        return _encode(doc.render(data)), {"same": base}
    if kind == "encoding":
        data["description"] = rng.choice(["café", "naïve ünïcode", "日本語", "🙂", "plain"])
        text = doc.render(data)
        codec = rng.choice(
            [
                "utf-8",
                "utf-8-sig",
                "utf-16",
                "utf-16-le",
                "utf-16-be",
                "utf-32",
                "utf-32-le",
                "utf-32-be",
                "latin-1",
                "cp1252",
                "shift_jis",
                "utf-7",
                "truncated",
                "surrogate",
            ]
        )
        if codec == "truncated":
            raw = text.encode()
            cut = raw.find("é".encode()) if "é" in text else -1
            return (raw[: cut + 1] + raw[cut + 2 :] if cut >= 0 else raw[: len(raw) // 2] + b"\xc3"), {}
        if codec == "surrogate":
            return text.encode() + b"note: \xed\xa0\x80\n", {"error": "not UTF-8"}
        try:
            raw = text.encode(codec)
        except UnicodeEncodeError:
            raw = text.encode(codec, errors="replace")
        return raw, ({"same": data} if codec in ("utf-8", "utf-8-sig") else {})
    if kind == "binary":
        size = rng.choice([0, 1, 2, 3, 4, 16, 512, 4096])
        head = rng.choice(
            [
                b"",
                b"\x89PNG\r\n\x1a\n",
                b"\x7fELF",
                b"\x1f\x8b\x08",
                b"PK\x03\x04",
                b"\xff\xfe",
                b"\xfe\xff",
                b"\xef\xbb\xbf",
                b"\x00\x00\xfe\xff",
                b"name: x\n",
            ]
        )
        return head + rng.randbytes(size), {}
    if kind == "tag":
        path = rng.choice(list(_scalar_paths(data)))
        tag = rng.choice(TAGS)
        _set(data, path, Raw(f"{tag} {flow(_get(data, path))}"))
        return _encode(doc.render(data)), {}
    if kind == "yaml11":
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(list(_scalar_paths(data)))
            _set(data, path, Raw(rng.choice(YAML11)))
        return _encode(doc.render(data)), {}
    if kind == "huge":
        size = rng.choice([300, 5000, 100_000, 900_000, 1_100_000, 3_000_000])
        what = rng.choice(["model", "name", "description", "key", "profile", "env", "cwd", "list", "int"])
        blob = rng.choice(["a", "a/", "é", "\u202e", "9"]) * (size // 2 if what == "list" else size)
        if what == "key":
            data["space"][blob[:size]] = [1]
        elif what == "profile":
            data["cluster"]["profile"] = blob + ".yaml"
        elif what == "env":
            data["space"]["env"]["BIG"] = [blob]
        elif what == "cwd":
            data["backend"]["cwd"] = blob
        elif what == "int":  # digits, or a sexagesimal 1:1:1:... (PyYAML multiplies by 60 per ':')
            data["workload"]["seq_len"] = Raw(rng.choice(["9" * size, ":".join(["1"] * (size // 2))])[:1_040_000])
        elif what == "list":
            data["space"]["micro_batch_size"] = Raw("[" + ", ".join(["1"] * min(size // 3, 400_000)) + "]")
        else:
            data[what] = blob
        return _encode(doc.render(data)), {}
    if kind == "deep":
        depth = rng.choice([50, 500, 5_000, 100_000])
        opener, closer = rng.choice([("[", "]"), ("{a: ", "}"), ("- ", "")])
        if opener == "- ":
            nested = "".join(" " * i + "-\n" for i in range(min(depth, 3000))) + " " * min(depth, 3000) + "x"
            data.pop("description")
            return _encode(doc.render(data) + "description:\n" + nested + "\n"), {}
        _set(data, ("description",), Raw(opener * depth + "1" + closer * depth))
        return _encode(doc.render(data)), {}
    if kind == "nasty":
        for _ in range(rng.randint(1, 3)):
            where = rng.choice(["key", "value", "env_name", "baseline"])
            text = rng.choice(NASTY)
            if where == "key":
                mapping = rng.choice([m for _, m in _mapping_paths(data)])
                mapping[text] = 1
            elif where == "value":
                _set(data, rng.choice(list(_scalar_paths(data))), text)
            elif where == "env_name":
                data["space"]["env"][text] = ["1"]
            else:
                data["baseline"][f"env.{text}"] = "1"
        return _encode(doc.render(data)), {}
    # "data": the data-level mutants, written by this writer (block or flow at random)
    return _encode(doc.render(random_data_mutant(rng))), {}


def make_special_path(tmp: Path, which: str) -> str:
    """A spec path that is not a file of text: what each must give is exit 2 naming it."""
    path = tmp / f"special-{which}.yaml"
    if which == "directory":
        path.mkdir()
    elif which == "fifo":
        os.mkfifo(path)
    elif which == "dev_zero":
        return "/dev/zero"
    elif which == "dev_null":
        return "/dev/null"
    elif which == "symlink_loop":
        path.symlink_to(path)
    elif which == "dangling_symlink":
        path.symlink_to(tmp / "nowhere.yaml")
    elif which == "symlink_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif which == "symlink_to_fifo":
        os.mkfifo(tmp / "the-fifo")
        path.symlink_to(tmp / "the-fifo")
    elif which == "empty":
        path.write_bytes(b"")
    elif which == "name_too_long":
        return str(tmp / ("n" * 300 + ".yaml"))
    elif which == "nul_in_path":
        return str(tmp / "a\x00b.yaml")
    elif which == "not_a_directory":
        path.write_text("x")
        return str(path / "spec.yaml")
    return str(path)


def _rendered(error: SpecError) -> list[str]:
    return [problem.render(error.file) for problem in error.problems]


def check_file_outcome(file: str, outcome, expect: dict) -> None:
    """A Spec, or a SpecError whose every line names the file and shows no control or bidi
    character; and what the mutant's kind promises (``file_mutant``)."""
    if isinstance(outcome, SpecError):
        assert outcome.problems
        for line in _rendered(outcome):
            assert line.startswith(file.replace("\x00", "\\x00")) and "\n" not in line, line
            assert line.isprintable() or all(ch == " " or ch.isprintable() for ch in line), ascii(line)
        assert not expect.get("same"), _rendered(outcome)
        if "duplicate_line" in expect:
            lines = [p for p in outcome.problems if p.message.startswith("duplicate key")]
            assert any(p.line == expect["duplicate_line"] for p in lines), (expect, _rendered(outcome))
        if "error" in expect:
            assert any(expect["error"] in line for line in _rendered(outcome)), _rendered(outcome)
        return
    assert isinstance(outcome, Spec), outcome
    assert "duplicate_line" not in expect and "error" not in expect, expect
    if expect.get("same"):
        from autotune.spec.load import parse_spec

        wanted = parse_spec(copy.deepcopy(expect["same"])).model_dump(exclude={"source_path"})
        assert outcome.model_dump(exclude={"source_path"}) == wanted, "a merge, alias or encoding read differently"


def _load(path: str):
    try:
        return load_spec(path)
    except SpecError as exc:
        return exc


@settings(
    max_examples=max(EXAMPLES // 2, 30),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    kind=st.sampled_from([k for k in KINDS if k not in ("huge", "deep")]),
)
def test_fuzzed_files_are_a_spec_or_located_errors(tmp_path, seed, kind):
    raw, expect = file_mutant(random.Random(seed), kind)
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    check_file_outcome(str(path), _load(str(path)), expect)


@pytest.mark.parametrize("kind", ["huge", "deep"])
@pytest.mark.parametrize("seed", range(6))
def test_huge_and_deep_files_are_a_spec_or_located_errors(tmp_path, kind, seed):
    raw, expect = file_mutant(random.Random(seed * 7919 + len(kind)), kind)
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    check_file_outcome(str(path), _load(str(path)), expect)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", SPECIAL_PATHS)
def test_special_spec_paths_are_located_errors(tmp_path, which):
    if which in ("fifo", "symlink_to_fifo") and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path = make_special_path(tmp_path, which)
    outcome = _load(path)
    assert isinstance(outcome, SpecError), outcome
    check_file_outcome(path, outcome, {})


# the values of the environment variables the simulator reads: what the spec accepts, it parses
ENV_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "0",
            "1",
            "2",
            "3",
            "-1",
            "1.0",
            " 1 ",
            "+1",
            "1_0",
            "nan",
            "inf",
            "-inf",
            "1e309",
            "200",
            "0.5",
            "",
            "expandable_segments:True",
            "expandable_segments:yes",
            "expandable_segments:maybe",
            "max_split_size_mb:512",
            "max_split_size_mb:",
            "max_split_size_mb:nan",
            "garbage_collection_threshold:0.8,expandable_segments:False",
            "garbage_collection_threshold:-1",
            "unknown_option:1",
            "9" * 5000,
        ]
    ),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    name=st.sampled_from(
        ["PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "HCCL_BUFFSIZE", "MULTI_STREAM_MEMORY_REUSE", "OTHER"]
    ),
    value=ENV_TEXT,
)
def test_an_env_value_the_spec_accepts_is_one_the_simulator_reads(name, value):
    from autotune.spec.schema import env_value_problem
    from autotune.workers.simulate._columns import columns_from_params

    if env_value_problem(name, value) is not None:
        return
    columns = columns_from_params([{f"env.{name}": value}])
    for column in ("alloc_max_split_size_mb", "alloc_gc_threshold", "hccl_buffsize_mb", "multi_stream_memory_reuse"):
        assert np.isfinite(columns[column]).all(), (name, value, column)


# ------------------------------------------------------------------------------------ deep run
def _invoke(app, args: list[str], limit_s: int = 30):
    """``autotune ARGS`` in-process, as ``main()`` runs it: (exit code, output, traceback or None,
    stdout); an exception that escapes the command is exit 70, an alarm past ``limit_s`` a hang (-1)."""
    import signal
    import traceback

    from typer.testing import CliRunner

    def _alarm(signum, frame):
        raise TimeoutError(f"{' '.join(args)} ran past {limit_s} s")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        result = CliRunner().invoke(app, args)
    except TimeoutError:
        return -1, "", "hang", ""
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    exc = result.exception
    if isinstance(exc, TimeoutError):
        return -1, result.output, "hang", result.stdout
    if exc is not None and not isinstance(exc, SystemExit):
        return 70, result.output, "".join(traceback.format_exception(exc)), result.stdout
    return result.exit_code, result.output, ("Traceback" if "Traceback" in result.output else None), result.stdout


def _invoke_again_if_hung(app, args: list[str], figures: dict, limit_s: int = 30, again_s: int = 240):
    """``_invoke``; a command past ``limit_s`` runs once more with ``again_s``: one that then ends
    was a stall of a loaded machine (counted as ``stalls``, its second outcome kept), one that
    does not is a hang."""
    outcome = _invoke(app, args, limit_s)
    if outcome[2] != "hang":
        return outcome
    again = _invoke(app, args, again_s)
    if again[2] != "hang":
        figures["stalls"] += 1
    return again


# characters no line autotune prints may hold as they are: C0/C1 controls (a newline and a tab
# apart), DEL, bidi overrides and isolates, line and paragraph separators
_UNSHOWABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def _where(trace: str) -> str:
    """The innermost autotune frame of a traceback and the exception's type: a failure's identity."""
    frames = re.findall(r'File "([^"]*)", line \d+, in (\S+)', trace)
    inner = [f"{f[f.rfind('autotune/') :]}:{fn}" for f, fn in frames if "autotune/" in f and "/tests/" not in f]
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    return f"{last.split(':', 1)[0]} at {inner[-1] if inner else (frames[-1][1] if frames else '?')}"


def _new_figures(seed: int, family: str) -> dict:
    return {
        "family": family,
        "mutants": 0,
        "seed": seed,
        "by_kind": Counter(),
        "validate": Counter(),
        "plan": Counter(),
        "pairs": Counter(),
        "tracebacks": 0,
        "exit_70": 0,
        "exit_70_by_kind": Counter(),
        "hangs": 0,
        "stalls": 0,  # past 30 s once, then ended within 240 s: a loaded machine, not a hang
        "broken_promises": 0,
        "validate_ok_plan_refused": 0,
        "validate_refused_plan_ok": 0,
        "unshowable_output": 0,
        "plan_json_invalid": 0,
        "slowest_s": 0.0,
        "over_5_s": 0,
        "failures": {},  # one entry per distinct failure: its count and the first mutant that showed it
        "questions": {},  # label -> [accepted, refused]: inputs whose right answer is a matter of policy
        "examples": [],
    }


def _repro(path: str) -> dict:
    """The files of a failing mutant, shortened: what a person needs to reproduce it."""
    out = {}
    try:
        folder = Path(path).parent
        if not folder.is_dir() or "\x00" in path:
            return out
        for item in sorted(folder.iterdir()):
            if item.is_file() and not item.is_symlink():
                raw = item.read_bytes()
                out[item.name] = raw[:700].decode("utf-8", "backslashreplace") + (
                    f"... ({len(raw):,} bytes)" if len(raw) > 700 else ""
                )
            else:
                out[item.name] = "(not a regular file)"
    except OSError:
        pass
    return out


def _judge(figures: dict, n: int, kind: str, path: str, expect: dict, validate, plan, labels=()) -> None:
    """Count one mutant's ``autotune validate`` and ``autotune plan --json`` outcomes into ``figures``:
    exit codes, tracebacks, exit 70s, hangs, validate/plan disagreements, broken promises, output
    that shows a control character, a plan that is not strict JSON; each distinct failure once."""
    figures["mutants"] += 1
    figures["by_kind"][kind.split(":")[0]] += 1
    figures["validate"][validate[0]] += 1
    figures["plan"][plan[0]] += 1
    figures["pairs"][f"{validate[0]}/{plan[0]}"] += 1
    about = ", ".join(labels) or kind
    bad: list[tuple[str, str]] = []  # (signature, details)
    for name, (code, output, trace, _) in (("validate", validate), ("plan", plan)):
        if trace == "hang":
            figures["hangs"] += 1
            bad.append((f"{name} hung: {about}", ""))
        elif code == 70:
            figures["exit_70"] += 1
            figures["exit_70_by_kind"][kind.split(":")[0]] += 1
            bad.append((f"{name} exit 70: {_where(trace)}", trace[-600:]))
        elif trace:
            figures["tracebacks"] += 1
            bad.append((f"{name} printed a traceback: {about}", output[-600:]))
        elif _UNSHOWABLE.search(output):
            figures["unshowable_output"] += 1
            bad.append((f"{name} printed a control character: {about}", ascii(output[-300:])))
    if validate[0] not in (0, 2) or plan[0] not in (0, 1, 2):
        bad.append((f"exit codes {validate[0]}/{plan[0]}: {about}", ""))
    if validate[0] == 0 and plan[0] == 2:
        figures["validate_ok_plan_refused"] += 1
        bad.append((f"validate accepted what plan refused: {about}", plan[1][-300:]))
    if validate[0] == 2 and plan[0] in (0, 1):
        figures["validate_refused_plan_ok"] += 1
        bad.append((f"validate refused what plan accepted: {about}", validate[1][-300:]))
    if plan[0] in (0, 1):  # the plan a tool reads: strict JSON (no NaN, no Infinity)
        try:
            json.loads(plan[3], parse_constant=lambda word: (_ for _ in ()).throw(ValueError(word)))
        except ValueError as exc:
            figures["plan_json_invalid"] += 1
            bad.append((f"plan --json is not strict JSON ({str(exc)[:40]}): {about}", plan[3][-300:]))
    # (a NUL in a path cannot come from a command line: click refuses it, in its own words)
    if validate[0] == 2 and os.path.basename(path) not in validate[1] and "\x00" not in path:
        bad.append((f"an error that does not name the file: {about}", validate[1][-300:]))
    promised_error = "duplicate_line" in expect or "error" in expect
    if ("same" in expect or "ok" in expect) and validate[0] != 0 or promised_error and validate[0] != 2:
        figures["broken_promises"] += 1
        what = expect.get("labels") or [kind]
        wanted = "accepted" if ("same" in expect or "ok" in expect) else "refused"
        bad.append((f"promised {wanted}, validate exit {validate[0]}: {', '.join(what)}", validate[1][-300:]))
    for label in expect.get("questions", []):
        figures["questions"].setdefault(label, [0, 0])[0 if validate[0] == 0 else 1] += 1
    if bad:
        if len(figures["examples"]) < 20:
            figures["examples"].append({"n": n, "kind": kind, "path": path, "problems": [b[0] for b in bad]})
        for signature, details in bad:
            entry = figures["failures"].setdefault(
                signature, {"count": 0, "n": n, "labels": list(labels), "details": details, "files": _repro(path)}
            )
            entry["count"] += 1


def _finish(figures: dict, start: float) -> dict:
    figures["seconds"] = round(time.monotonic() - start, 1)
    figures["distinct_failures"] = len(figures["failures"])
    return {k: (dict(sorted(v.items(), key=str)) if isinstance(v, Counter) else v) for k, v in figures.items()}


def _progress(log, figures: dict, n: int, start: float) -> None:
    if log and (n + 1) % 500 == 0:
        log(
            f"{n + 1} mutants, {time.monotonic() - start:.0f} s, exit 70s {figures['exit_70']}, "
            f"tracebacks {figures['tracebacks']}, hangs {figures['hangs']}, "
            f"distinct failures {len(figures['failures'])}"
        )


def deep_fuzz(mutants: int, seed: int, tmp: Path, log=None) -> dict:
    """``mutants`` file mutants (every kind, special paths included) through ``autotune validate``
    and ``autotune plan --json``: the exit-code histogram, tracebacks, exit 70s, hangs, and the
    mutants whose promise (``file_mutant``) or whose validate/plan pair disagrees."""
    from autotune.cli.commands import app

    rng = random.Random(seed)
    kinds = KINDS + ["special"]
    weights = [3 if k in ("data", "duplicate", "nasty", "tag", "yaml11") else 2 for k in KINDS] + [1]
    figures = _new_figures(seed, "file")
    start = time.monotonic()
    specials = 0
    for n in range(mutants):
        kind = rng.choices(kinds, weights)[0]
        work = tmp / f"m{n}"
        work.mkdir()
        began = time.monotonic()
        if kind == "special":  # each special path in turn
            which = SPECIAL_PATHS[specials % len(SPECIAL_PATHS)]
            specials += 1
            path, expect = make_special_path(work, which), {"error": ""}
            kind = f"special:{which}"
        else:
            raw, expect = file_mutant(random.Random(rng.getrandbits(64)), kind)
            path = str(work / "spec.yaml")
            Path(path).write_bytes(raw)
        validate = _invoke_again_if_hung(app, ["validate", path], figures)
        plan = _invoke_again_if_hung(app, ["plan", path, "--json"], figures)
        took = time.monotonic() - began
        figures["slowest_s"] = round(max(figures["slowest_s"], took), 2)
        figures["over_5_s"] += took > 5
        _judge(figures, n, kind, path, expect, validate, plan, [kind])
        _progress(log, figures, n, start)
    return _finish(figures, start)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_deep_fuzz_through_validate_and_plan(tmp_path):
    mutants = int(os.environ.get("AUTOTUNE_DEEP_FUZZ_MUTANTS", "3000"))
    figures = deep_fuzz(mutants, int(os.environ.get("AUTOTUNE_DEEP_FUZZ_SEED", "0")), tmp_path)
    print(json.dumps(figures, indent=1, default=str))
    assert figures["mutants"] == mutants
    assert figures["exit_70"] == 0 and figures["tracebacks"] == 0 and figures["hangs"] == 0, figures["examples"]
    assert not figures["examples"], figures["examples"]


# ============================================================================= serving (issue #42)
# The serving fuzzer: mutants of a serve spec (tests/fuzz_serving.py: traffic, SLO, lengths files
# and their encodings and paths, user-written length pairs, engine settings with control
# characters, flag-like and non-finite values, env values, serving parameters, the stack), and
# the file-level kinds above written on a serve spec, through `autotune validate` and `plan`.
#
#     python tests/test_fuzz_spec.py --serving --mutants 10000 --seed 0    # the run
#     AUTOTUNE_FUZZ_N=10000 pytest tests/test_fuzz_spec.py -k serving       # the same, asserted
import fuzz_serving  # noqa: E402

SERVE_FILE_BASE: dict = copy.deepcopy(fuzz_serving.SERVE_BASE)
SERVE_FILE_BASE["description"] = "fuzz"
SERVE_FILE_BASE["baseline"] = {"tp": 1, "replicas": 1}
SERVE_FILE_BASE["recommend"] = {"min_headroom_gib": 4.0}
SERVE_FILE_KINDS = [k for k in KINDS if k not in ("huge", "deep", "data")]  # "data": fuzz_serving's own
SERVE_FILE_SHARE = 0.15  # of the serving mutants, file-level ones


def serving_fuzz(mutants: int, seed: int, tmp: Path, log=None) -> dict:
    """``mutants`` serving mutants through ``autotune validate`` and ``autotune plan --json``, judged
    as ``deep_fuzz`` judges its own, each mutant's promise (``fuzz_serving.Mutant.expect``) kept."""
    import shutil

    from autotune.cli.commands import app

    rng = random.Random(seed)
    figures = _new_figures(seed, "serving")
    start = time.monotonic()
    for n in range(mutants):
        work = tmp / f"s{n}"
        work.mkdir()
        began = time.monotonic()
        mutant_rng = random.Random(rng.getrandbits(64))
        if rng.random() < SERVE_FILE_SHARE:
            kind = rng.choice(SERVE_FILE_KINDS)
            raw, expect = file_mutant(mutant_rng, kind, SERVE_FILE_BASE)
            path = str(work / "spec.yaml")
            Path(path).write_bytes(raw)
            labels = [f"file:{kind}"]
            expect = {**expect, "labels": labels}
            kind = f"file:{kind}"
        else:
            mutant = fuzz_serving.serving_mutant(mutant_rng)
            path = fuzz_serving.write_mutant(mutant, work)
            labels = mutant.labels
            kind = labels[0].split(":", 1)[0]
            expect = {"questions": mutant.promised("question")}
            if mutant.expect == "error":
                expect.update({"error": "", "labels": mutant.promised("error")})
            elif mutant.expect == "ok":
                expect.update({"ok": True, "labels": labels})
        validate = _invoke_again_if_hung(app, ["validate", path], figures)
        plan = _invoke_again_if_hung(app, ["plan", path, "--json"], figures)
        took = time.monotonic() - began
        figures["slowest_s"] = round(max(figures["slowest_s"], took), 2)
        figures["over_5_s"] += took > 5
        _judge(figures, n, kind, path, expect, validate, plan, labels)
        shutil.rmtree(work, ignore_errors=True)
        _progress(log, figures, n, start)
    return _finish(figures, start)


SERVE_FUZZ_N = int(os.environ.get("AUTOTUNE_FUZZ_N", "200"))  # the run: AUTOTUNE_FUZZ_N=10000


@pytest.mark.timeout(max(600, SERVE_FUZZ_N))
def test_fuzzed_serving_specs_through_validate_and_plan(tmp_path):
    """Serving mutants (seeded; AUTOTUNE_FUZZ_N of them, AUTOTUNE_FUZZ_SEED): no traceback, no
    exit 70, no hang, validate and plan agree, and each mutant's promise is kept."""
    figures = serving_fuzz(SERVE_FUZZ_N, int(os.environ.get("AUTOTUNE_FUZZ_SEED", "0")), tmp_path)
    assert figures["mutants"] == SERVE_FUZZ_N
    assert figures["exit_70"] == 0 and figures["tracebacks"] == 0 and figures["hangs"] == 0, figures["failures"]
    assert not figures["failures"], json.dumps(figures["failures"], indent=1, default=str)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_deep_serving_fuzz_10000_mutants(tmp_path):
    figures = serving_fuzz(10_000, 0, tmp_path)
    print(json.dumps(figures, indent=1, default=str))
    assert figures["exit_70"] == 0 and figures["tracebacks"] == 0 and figures["hangs"] == 0, figures["failures"]
    assert not figures["failures"], json.dumps(figures["failures"], indent=1, default=str)


def test_the_serving_base_and_its_file_base_are_valid_and_plannable(tmp_path):
    """The mutants' starting points: a promise of ``ok`` means something only if these load."""
    from autotune.cli.commands import app

    for name, data in (("base", fuzz_serving.SERVE_BASE), ("file-base", SERVE_FILE_BASE)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        assert _invoke(app, ["validate", str(path)])[0] == 0
        assert _invoke(app, ["plan", str(path), "--json"])[0] == 0
    mutant = fuzz_serving.Mutant(copy.deepcopy(fuzz_serving.SERVE_BASE))
    fuzz_serving._lengths_file(mutant, "lengths.jsonl", fuzz_serving._jsonl(fuzz_serving.LENGTHS).encode())
    (tmp_path / "lengths").mkdir()
    spec = load_spec(fuzz_serving.write_mutant(mutant, tmp_path / "lengths"))
    assert spec.workload.traffic.length_pairs == fuzz_serving.LENGTHS


if __name__ == "__main__":  # python tests/test_fuzz_spec.py [--serving] --mutants 3000 --seed 0
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="deep spec fuzz through autotune validate and plan")
    parser.add_argument("--mutants", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serving", action="store_true", help="serving mutants (issue #42), not file ones")
    parser.add_argument("--json", help="also write the figures to this file")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="autotune-deep-fuzz-") as directory:
        run = serving_fuzz if options.serving else deep_fuzz
        result = run(
            options.mutants, options.seed, Path(directory), log=lambda line: print(line, file=sys.stderr, flush=True)
        )
    text = json.dumps(result, indent=1, default=str)
    if options.json:
        Path(options.json).write_text(text)
    print(text)
    sys.exit(0 if not result["examples"] else 1)
