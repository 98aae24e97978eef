"""A spec's problems, rendered for a person: the file, the line (where the YAML parser knows it),
the dotted path of the field and what was expected, e.g.::

    spec.yaml:14: space.recompute[1]: Input should be 'none', 'selective' or 'full' (got 'ful')

A rendered error never carries a control, bidi or other invisible character as it is: they are
written as escapes (``\u202e``), so the text a terminal shows is the text the spec holds.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from .spec import short_value

__all__ = ["SpecProblem", "SpecError", "escape_text"]


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
            message = f"{message[: MAX_MESSAGE_CHARS - 500]} ... {message[-400:]}"
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
            msg += f" (got {short_value(err['input'])})"
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
        specific = [
            p
            for p in ps
            if not p.message.startswith(("Input should be a valid list", "Input should be a valid dictionary"))
        ]
        out += specific or ps
    return out
