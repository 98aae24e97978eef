"""The enumerated space, held compactly: ``Enumeration`` and its ``ConfigRows``.

Split from :mod:`autotune.spec.space` (the distributions, the derivation, the rules and the canonical
form) because this is a data structure of its own: millions of valid canonical configs kept as
one small integer code per config and column (``_Codes``), dicts built only when asked for, a
config found by its values without a dict of them all. ``config_key`` (a config's identity) lives
here because the lookup by key needs it; :mod:`autotune.spec.space` re-exports it.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["ConfigRows", "Enumeration", "config_key"]


def config_key(config: dict[str, Any]) -> str:
    """Stable identity of a canonical config (JSON with sorted keys)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)


class ConfigRows(Sequence):
    """The valid canonical configs of an :class:`Enumeration` as dicts, built when asked for: a
    space of millions of configs holds their codes, not millions of dicts. Each access builds a
    new dict (a caller may change it); iterate or use :meth:`rows` for many."""

    def __init__(self, enumeration: Enumeration):
        self._e = enumeration

    def __len__(self) -> int:
        return self._e.valid

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.rows(np.arange(len(self))[i])
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("config index out of range")
        e = self._e
        row = e.codes[i]
        out = {name: e.vocab[j][row[j]] for j, name in enumerate(e.names)}
        return {k: v for k, v in out.items() if v is not None}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), 1 << 15):
            yield from self.rows(np.arange(start, min(start + (1 << 15), len(self))))

    def rows(self, index: Any) -> list[dict[str, Any]]:
        """The configs at ``index`` (an array of rows), as dicts."""
        e = self._e
        index = np.asarray(index, dtype=np.int64)
        if not e.names:
            return [{} for _ in range(len(index))]
        values = [e.vocab_objects[j][e.codes[index, j]].tolist() for j in range(len(e.names))]
        nullable = [name for j, name in enumerate(e.names) if e.has_none[j]]
        out = []
        for row in zip(*values):
            config = dict(zip(e.names, row))
            for name in nullable:
                if config[name] is None:
                    del config[name]
            out.append(config)
        return out


class Enumeration:
    """The whole space at once: ``space_size`` raw combinations, ``configs`` the valid unique
    canonical ones (dicts built on access, in a stable order: that of each one's first
    combination) and ``columns`` the same as numpy arrays.

    Held compactly: ``codes`` (one small integer per config and column, an index into that
    column's ``vocab``) and ``first`` (the index of each config's first combination, in
    ``np.indices`` order of the searched parameters), so that millions of configs fit in tens of
    MB; :meth:`index_of_config` finds a config by its values without a dict of them all."""

    def __init__(
        self,
        space_size: int,
        names: list[str],
        codes: np.ndarray,
        vocab: list[list[Any]],
        dtypes: list[np.dtype],
        first: np.ndarray,
        searched: dict[str, np.ndarray],
        invalid_reasons: dict[str, int],
        sole_reasons: dict[str, int] | None = None,
    ):
        self.space_size = space_size
        self.names = names
        self.codes = codes
        self.vocab = vocab
        self.dtypes = dtypes
        self.first = first
        self.invalid_reasons = invalid_reasons
        # combinations each rule rejects that no other rule does: the rule that empties a space
        self.sole_reasons = sole_reasons or {}
        self._searched = searched  # searched name -> its values (np.indices order)
        self.vocab_objects = [_object_array(v) for v in vocab]
        self.has_none = [any(x is None for x in v) for v in vocab]
        self.configs = ConfigRows(self)
        self._params: dict[str, np.ndarray] | None = None
        self._lookup: tuple[Any, ...] | None = None
        self._fast: dict[str, dict[tuple[type, Any], int]] | None = None
        # which predicted rows meet the spec's outcome constraints (Space.outcome_mask); the ranking applies it
        self.outcome: Callable[[Any], np.ndarray | None] | None = None

    @classmethod
    def empty(cls, space_size: int, invalid_reasons: dict[str, int], sole_reasons: dict[str, int]) -> Enumeration:
        return cls(
            space_size, [], np.zeros((0, 0), np.uint8), [], [], np.zeros(0, np.int64), {}, invalid_reasons, sole_reasons
        )

    @property
    def valid(self) -> int:
        return int(len(self.first))

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """Each config column as a numpy array (the dtype the rules gave it), one entry per config."""
        return {name: self.column(name) for name in self.names}

    def column(self, name: str, rows: Any = None) -> np.ndarray:
        j = self.names.index(name)
        values = _typed_array(self.vocab[j], self.dtypes[j])
        return values[self.codes[:, j] if rows is None else self.codes[rows, j]]

    @property
    def params(self) -> dict[str, np.ndarray]:
        """The searched parameters' raw values of the first combination that resolves to each
        config: what a sampler proposes so that ``Space.resolve`` gives that config back."""
        if self._params is None:
            names = list(self._searched)
            lens = [len(v) for v in self._searched.values()]
            digits = np.unravel_index(self.first, lens) if names and self.valid else [self.first] * len(names)
            self._params = {n: self._searched[n][digits[i]] for i, n in enumerate(names)}
        return self._params

    def why_empty(self) -> str | None:
        """Why no combination is a valid config (None when some is): each rule with the
        combinations it rejects, the user's constraints first, and the fix."""
        if self.valid:
            return None
        if not self.invalid_reasons:
            return "the space has no combination to try"
        order = sorted(self.invalid_reasons, key=lambda r: (not r.startswith("constraint "), -self.invalid_reasons[r]))
        parts = []
        for reason in order:
            alone = self.sole_reasons.get(reason, 0)
            parts.append(
                f"{reason} rejects {self.invalid_reasons[reason]:,}"
                + (f" ({alone:,} that no other rule rejects)" if alone else "")
            )
        culprits = [r for r in order if r.startswith("constraint ") and self.sole_reasons.get(r)]
        fix = (
            f"loosen {', '.join(culprits)} or widen the space"
            if culprits
            else "widen the space (more values of the rejected parameters) or loosen the constraints"
        )
        return f"no valid config in the space's {self.space_size:,} combinations: " + "; ".join(parts) + f". Fix: {fix}"

    def params_of(self, index: int) -> dict[str, Any]:
        """The searched parameters (plain Python values) that resolve to config ``index``."""
        return {name: _scalar(values[index]) for name, values in self.params.items()}

    # ---- finding a config by its values ------------------------------------------------------------
    def index_of_config(self, config: dict[str, Any]) -> int | None:
        """Row of the canonical config equal to ``config`` (by :func:`config_key`), if enumerated."""
        if not self.valid or any(k not in self._code_of for k in config):
            return None
        codes = []
        fast = self._fast_codes
        for name, table in self._code_of.items():
            value = config.get(name)
            if value is None and name in config:
                return None  # a canonical config leaves unset values out
            try:
                code = fast[name].get((type(value), value))
            except TypeError:  # unhashable
                code = None
            if code is None:
                code = table.get(_value_key(value))
            if code is None:
                return None
            codes.append(code)
        weights, (packed, rows), by_bytes = self._row_lookup()
        row = np.asarray(codes, dtype=self.codes.dtype)
        if by_bytes is not None:
            return by_bytes.get(row.tobytes())
        key = int(row.astype(np.int64) @ weights)
        at = int(np.searchsorted(packed, key))
        if at < len(packed) and packed[at] == key:
            return int(rows[at])
        return None

    def index_of_key(self, key: str) -> int | None:
        """Row of the config with this canonical key (``config_key``), if enumerated."""
        try:
            config = json.loads(key)
        except ValueError:
            return None
        return self.index_of_config(config) if isinstance(config, dict) else None

    @property
    def _fast_codes(self) -> dict[str, dict[tuple[type, Any], int]]:
        """Each column's codes by (type, value): the common case of :meth:`index_of_config`, without JSON."""
        if self._fast is None:
            fast: dict[str, dict[tuple[type, Any], int]] = {}
            for j, name in enumerate(self.names):
                table = fast[name] = {}
                for code, value in enumerate(self.vocab[j]):
                    try:
                        table.setdefault((type(value), value), code)
                    except TypeError:
                        pass
            self._fast = fast
        return self._fast

    @property
    def _code_of(self) -> dict[str, dict[str, int]]:
        if self._lookup is None:
            self._row_lookup()
        return self._lookup[0]

    def _row_lookup(self) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], dict[bytes, int] | None]:
        """(each column's weight in a row's packed key, (the packed keys sorted, their rows), or the
        rows by their bytes where the packed key would not fit in 62 bits)."""
        if self._lookup is None:
            code_of = {
                name: {_value_key(v): c for c, v in enumerate(self.vocab[j])} for j, name in enumerate(self.names)
            }
            radix = [max(len(v), 1) for v in self.vocab]
            if math.prod(radix) < 2**62:
                mult = np.cumprod([1, *radix[::-1]])[:-1][::-1].astype(np.int64)
                packed = self.codes.astype(np.int64) @ mult if self.names else np.zeros(self.valid, np.int64)
                sort = np.argsort(packed, kind="stable")
                self._lookup = (code_of, mult, (packed[sort], sort), None)
            else:
                rows = np.ascontiguousarray(self.codes)
                by_bytes = {rows[i].tobytes(): i for i in range(len(rows) - 1, -1, -1)}
                self._lookup = (code_of, np.zeros(0, np.int64), (np.zeros(0), np.zeros(0)), by_bytes)
        return self._lookup[1], self._lookup[2], self._lookup[3]


def _value_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values if values else []
    return out


def _typed_array(values: list[Any], dtype: np.dtype) -> np.ndarray:
    if np.dtype(dtype).kind == "O":
        return _object_array(values)
    return np.asarray(values, dtype=dtype)


class _Codes:
    """Integer codes of one config column's values, the same across chunks (by ``str`` of the value,
    as the de-duplication has always compared them)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.values: list[Any] = []
        self.dtype: np.dtype | None = None

    def encode(self, column: np.ndarray) -> np.ndarray:
        column = np.asarray(column)
        if self.dtype is None:
            self.dtype = column.dtype
        elif self.dtype != column.dtype:
            self.dtype = np.dtype(object)
        if column.dtype == object:
            unique, at, inverse = np.unique(column.astype(str), return_index=True, return_inverse=True)
            texts, samples = unique.tolist(), column[at].tolist()
        else:
            unique, inverse = np.unique(column, return_inverse=True)
            samples = unique.tolist()
            texts = [str(v) for v in unique]
        lut = np.empty(len(texts), dtype=np.int32)
        for i, (text, sample) in enumerate(zip(texts, samples)):
            code = self.index.get(text)
            if code is None:
                code = self.index[text] = len(self.values)
                self.values.append(sample)
            lut[i] = code
        return lut[inverse.reshape(-1)]


def _unique_rows(codes: np.ndarray) -> np.ndarray:
    """Index of the first occurrence of each distinct row of ``codes`` (int32), ascending."""
    if len(codes) == 0:
        return np.zeros(0, dtype=np.int64)
    if codes.shape[1] == 0:
        return np.zeros(1, dtype=np.int64)
    rows = np.ascontiguousarray(codes).view(np.dtype((np.void, codes.dtype.itemsize * codes.shape[1]))).ravel()
    _, first = np.unique(rows, return_index=True)
    first.sort()
    return first


def _scalar(v: Any) -> Any:
    """numpy scalar -> plain Python value (JSON, Optuna and MLflow want plain values)."""
    if isinstance(v, np.generic):
        return v.item()
    return v
