"""A spec's problems, rendered for a person: the file, the line (where the YAML parser knows it),
the dotted path of the field and what was expected, e.g.::

    spec.yaml:14: space.recompute[1]: Input should be 'none', 'selective' or 'full' (got 'ful')

An unknown key names the fields expected there, or the close one (``did you mean
'micro_batch_size'?``); a value that fits no branch of a union (``IntRange | list[int]``) is one
line saying what each branch takes (``expected a list of integers or a {low, high} range``).

A rendered error never carries a control, bidi or other invisible character as it is: they are
written as escapes (``\u202e``), so the text a terminal shows is the text the spec holds.
"""

from __future__ import annotations

import difflib
import re
import types
import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from .schema import Spec, short_value

__all__ = ["SpecProblem", "SpecError", "escape_text"]


# ----------------------------------------------------------------------------------------- errors
@dataclass
class SpecProblem:
    loc: tuple[Any, ...]
    message: str
    line: int | None = None
    key: bool = False  # the problem is the key itself (an unknown field): its line is the key's

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


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...], key: bool = False) -> int | None:
    """1-based line of the YAML node at ``loc``, or of its nearest existing parent; with ``key``,
    of the last key itself (a block mapping's value starts on the line below its key)."""
    best = node.start_mark.line + 1 if node is not None else None
    for i, part in enumerate(loc):
        if isinstance(node, yaml.MappingNode):
            # the last of the keys that match: a key written out after a merge (<<) brought the same one
            pair = next(((k, v) for k, v in reversed(node.value) if getattr(k, "value", None) == str(part)), None)
            if pair is None:
                return best
            if key and i == len(loc) - 1:
                return pair[0].start_mark.line + 1
            nxt = pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        else:
            continue  # pydantic adds union/tag names (e.g. 'train', 'list[int]') that YAML lacks
        node = nxt
        best = node.start_mark.line + 1
    return best


_LABELS = ("IntRange", "train", "infer", "serve", "function-after[_check_shapes(), ModelSpec]", "BackendSpec")


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


# ------------------------------------------------------------------ pydantic's locations, typed
@dataclass
class _UnionPoint:
    """Where a pydantic error's location passes a union: the path to it (without labels), the
    union's type, the branch label pydantic added, and whether the error is at the branch itself
    (the value was not that branch's kind of thing) rather than inside it."""

    at: tuple[Any, ...]
    union: Any
    label: str
    at_branch: bool


@dataclass
class _Walk:
    loc: tuple[Any, ...]  # the user's path: pydantic's union and key labels dropped
    unions: list[_UnionPoint]
    owner: type[BaseModel] | None  # the model whose field the last part is (or would be)


def _members(t: Any) -> list[Any]:
    return [a for a in get_args(t) if a is not type(None)]


def _unwrap(t: Any) -> Any:
    """``t`` without ``Annotated`` and an Optional's ``None``."""
    while True:
        origin = get_origin(t)
        if origin is Annotated:
            t = get_args(t)[0]
        elif origin in (Union, types.UnionType) and len(_members(t)) == 1:
            t = _members(t)[0]
        else:
            return t


def _is_union(t: Any) -> bool:
    return get_origin(t) in (Union, types.UnionType)


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _label_of(t: Any) -> str:
    """The label pydantic gives a union branch of type ``t`` (``list[int]``, ``str``, ``IntRange``)."""
    t = _unwrap(t)
    if get_origin(t) is Literal:
        return "literal[" + ",".join(repr(a) for a in get_args(t)) + "]"
    origin = get_origin(t)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{','.join(_label_of(a) for a in get_args(t))}]"
    return getattr(t, "__name__", str(t))


_VALIDATOR_LABEL = re.compile(r"^function-(after|before|wrap|plain)\[.*, (?P<name>\w+)\]$")


def _branch(union: Any, label: str) -> Any:
    """The member of ``union`` whose label is ``label``: a class name, possibly inside a
    validator's label (``function-after[_order(), IntRange]``), a type's label (``list[int]``),
    or a discriminated union's tag (``serve``); None if none is."""
    m = _VALIDATOR_LABEL.match(label)
    name = m.group("name") if m else label
    for member in _members(union):
        member = _unwrap(member)
        if _is_model(member) and member.__name__ == name:
            return member
        if _label_of(member).replace(" ", "") in (label.replace(" ", ""), name):
            return member
    tagged = []  # a discriminated union: the member whose Literal field holds the tag
    for member in _members(union):
        member = _unwrap(member)
        if _is_model(member) and any(
            get_origin(f.annotation) is Literal and label in get_args(f.annotation)
            for f in member.model_fields.values()
        ):
            tagged.append(member)
    return tagged[0] if len(tagged) == 1 else None


def _field(model: type[BaseModel], part: Any) -> Any:
    if not isinstance(part, str):
        return None
    for name, info in model.model_fields.items():
        if part == name or part in (info.alias, info.validation_alias):
            return info
    return None


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> _Walk | None:
    """Follow pydantic's error location ``loc`` through ``model``'s fields, telling the user's
    keys from the labels pydantic adds (a union's branch, ``[key]``); None where a level cannot
    be told (the caller then keeps its data-driven guess and suggests nothing)."""
    t: Any = model
    out: list[Any] = []
    unions: list[_UnionPoint] = []
    owner: type[BaseModel] | None = None
    ended = False  # the last part was an unknown key: nothing can be below it
    i = 0
    while i < len(loc):
        part = loc[i]
        if ended:
            return None
        t = _unwrap(t)
        origin = get_origin(t)
        if _is_union(t):
            if not isinstance(part, str):
                return None
            member = _branch(t, part)
            if member is None:
                return None
            unions.append(_UnionPoint(tuple(out), t, part, i == len(loc) - 1))
            t = member
        elif _is_model(t):
            m = _VALIDATOR_LABEL.match(part) if isinstance(part, str) else None
            if m and m.group("name") == t.__name__:
                i += 1
                continue  # a model's own validator label
            info = _field(t, part)
            owner = t
            out.append(part)
            if info is None:
                ended = True
            else:
                t = info.annotation
        elif origin in (list, tuple, set, frozenset):
            if not isinstance(part, int) or isinstance(part, bool):
                return None
            args = [a for a in get_args(t) if a is not Ellipsis]
            if origin is tuple and len(args) > 1:
                t = args[part] if 0 <= part < len(args) else None
            else:
                t = args[0] if args else Any
            out.append(part)
            owner = None
        elif origin is dict:
            key_t, value_t = get_args(t) or (Any, Any)
            out.append(part)
            owner = None
            if i + 1 < len(loc) and loc[i + 1] == "[key]":
                t = key_t
                i += 1
            else:
                t = value_t
        else:
            return None  # a scalar, Any: pydantic puts nothing below these
        i += 1
    return _Walk(tuple(out), unions, owner)


# ------------------------------------------------------------------------------ plain words
_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}
_SINGULAR = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean (true or false)",
    type(None): "null",
}


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _describe(t: Any) -> str:
    """What a value of type ``t`` is, in plain words: "a list of integers", "a {low, high} range"."""
    t = _unwrap(t)
    origin = get_origin(t)
    if _is_union(t):  # null is the field left out, not a thing to write
        return _or([_describe(m) for m in _members(t)])
    if t in _SINGULAR:
        return _SINGULAR[t]
    if origin is Literal:
        values = [repr(a) for a in get_args(t)]
        return values[0] if len(values) == 1 else f"one of {', '.join(values)}"
    if origin in (list, tuple, set, frozenset):
        args = [_unwrap(a) for a in get_args(t) if a is not Ellipsis]
        if origin is tuple and len(args) > 1:
            return f"a list of {len(args)} {_PLURAL.get(args[0], 'values') if len(set(args)) == 1 else 'values'}"
        item = args[0] if args else Any
        if item in _PLURAL:
            return f"a list of {_PLURAL[item]}"
        if get_origin(item) is Literal:
            return f"a list of values among {', '.join(repr(a) for a in get_args(item))}"
        if _is_model(item):
            return f"a list of {_describe(item).removeprefix('a ')}s"
        return "a list"
    if origin is dict:
        return "a mapping"
    if _is_model(t):
        required = [n for n, f in t.model_fields.items() if f.is_required()] or list(t.model_fields)
        kind = "range" if t.__name__.endswith("Range") else "mapping"
        return f"a {{{', '.join(required)}}} {kind}"
    return f"a {getattr(t, '__name__', str(t))}"


# --------------------------------------------------------------------------------- unknown keys
# keys a field's own "before" validator takes besides the model's fields (Spec._resolve_model)
_ALSO_ACCEPTED: dict[tuple[Any, ...], tuple[str, ...]] = {("model",): ("preset",)}


def _unknown_field(loc: tuple[Any, ...], walk: _Walk | None) -> str:
    """``unknown field 'x'``, with the close known name at that level (``did you mean 'y'?``) or
    the names expected there; the bare message where the level is not known."""
    if not loc:
        return "unknown field"
    msg = f"unknown field {loc[-1]!r}"
    if walk is None or walk.owner is None:
        return msg
    names = []
    for name, info in walk.owner.model_fields.items():
        if info.exclude:
            continue  # set by autotune, not written in a spec
        names += [name] + [a for a in (info.alias, info.validation_alias) if isinstance(a, str) and a != name]
    names += _ALSO_ACCEPTED.get(loc[:-1], ())
    key = loc[-1]
    if isinstance(key, str):
        lowered = {n.lower(): n for n in names}
        close = difflib.get_close_matches(key.lower(), list(lowered), n=1)
        if close:
            return f"{msg}; did you mean {lowered[close[0]]!r}?"
    return f"{msg}; expected one of: {', '.join(names)}"


# ------------------------------------------------------------------------------------ problems
# error types that say "the value is not this kind of thing" (a list, a mapping, an integer)
_WRONG_KIND = re.compile(r"_type$|_parsing$|^int_from_float$|^literal_error$|^is_instance_of$|^none_required$")


def _reduce_unions(entries: list[tuple[dict, _Walk | None]], depth: int = 0) -> list[tuple[dict, _Walk | None, str]]:
    """Errors of union branches, one union at a time from the outermost: where some branch took
    the value's kind (a mapping for a range), only that branch's errors; where none did, one
    error at the union saying what each branch takes. Order as pydantic gave them."""
    groups: dict[Any, list[tuple[dict, _Walk | None]]] = {}
    order: list[Any] = []
    for i, (err, walk) in enumerate(entries):
        if walk is None or len(walk.unions) <= depth:
            key: Any = ("alone", i)
        else:
            point = walk.unions[depth]
            key = ("union", point.at, id(point.union))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((err, walk))
    out: list[tuple[dict, _Walk | None, str]] = []
    for key in order:
        group = groups[key]
        if key[0] == "alone":
            out += [(err, walk, "") for err, walk in group]
            continue
        branches: dict[str, list[tuple[dict, _Walk | None]]] = {}
        for err, walk in group:
            branches.setdefault(walk.unions[depth].label, []).append((err, walk))
        took = [
            label
            for label, errs in branches.items()
            if not all(w.unions[depth].at_branch and _WRONG_KIND.search(e["type"]) for e, w in errs)
        ]
        if took or len(branches) < 2:
            kept = [(e, w) for e, w in group if w.unions[depth].label in took] if took else group
            out += _reduce_unions(kept, depth + 1)
        else:
            err, walk = group[0]
            point = walk.unions[depth]
            got = f" (got {short_value(err['input'])})" if "input" in err else ""
            out.append((err, _Walk(point.at, [], None), f"expected {_describe(point.union)}{got}"))
    return out


def _format_pydantic(exc: ValidationError, data: Any = None, model: type[BaseModel] | None = None) -> list[SpecProblem]:
    model = model or Spec
    problems: list[SpecProblem] = []
    seen: set[tuple] = set()
    entries = []
    for err in exc.errors(include_url=False):
        try:
            walk = _walk(model, tuple(err["loc"]))
        except Exception:  # noqa: BLE001 (a type this walk does not know: the data-driven guess below)
            walk = None
        entries.append((err, walk))
    for err, walk, collapsed in _reduce_unions(entries):
        loc = walk.loc if walk is not None else _clean_loc(tuple(err["loc"]), data)
        msg = err["msg"].removeprefix("Value error, ")
        if collapsed:
            msg = collapsed
        elif err["type"] == "extra_forbidden":
            msg = _unknown_field(loc, walk)
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg += f" (got {short_value(err['input'])})"
        key = (loc, msg)
        if key in seen:
            continue
        seen.add(key)
        problems.append(SpecProblem(loc, msg, key=err["type"] == "extra_forbidden"))
    # Where the walk could not tell the union branches apart (a loc it does not know), the
    # branches' errors are still one per branch: keep the most specific.
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
