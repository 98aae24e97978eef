"""Rank a whole space with the analytical model: the simulator pre-screen.

Simulation is cheap (tens of thousands of configs per second, vectorised); configs the simulator
cannot tell apart by its inputs (they differ only in knobs it does not read: a launcher's timeout,
say) are priced once, and the distinct ones in chunks, so a space of millions of configs is ranked
in bounded memory. ``plan`` prints the result, the simulate backend records its top configs as
trials, and real backends probe the predicted best first.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..spec.context import ProbeContext
from ..spec.space import Enumeration

__all__ = ["Ranking", "Layout", "Predictions", "rank_space", "pareto_order"]

SIM_CHUNK = 1 << 16  # configs priced at once (the simulator's working arrays scale with it)


@dataclass
class Layout:
    """Configs the model cannot tell apart: equal predictions of every objective. They differ
    only in knobs it does not price (an allocator setting, a communication buffer), which only
    a probe can choose between. ``index`` is the one with the most memory headroom."""

    index: int
    rank: int  # 1-based, among distinct layouts
    members: list[int]
    undistinguished: dict[str, list[Any]]  # parameter -> the values the members take (two or more)
    # parameter -> the values priced alike in speed but not in memory: the layout's config has the roomiest
    roomiest: dict[str, list[Any]] = field(default_factory=dict)

    def undistinguished_text(self) -> str:
        """``env.HCCL_BUFFSIZE 120|200|400, ...`` (empty when the layout is one config)."""
        return _values_text(self.undistinguished)

    def roomiest_text(self) -> str:
        """``env.HCCL_BUFFSIZE 120|200|400, ...``: knobs the model prices alike in speed, of which the
        layout's config takes the value it predicts roomiest (empty when none)."""
        return _values_text(self.roomiest)


def _values_text(values: dict[str, list[Any]]) -> str:
    return ", ".join(f"{k} {'|'.join(str(v) for v in vs)}" for k, vs in values.items())


class Predictions(Mapping):
    """The simulator's columns for every ranked config, kept once per distinct simulator input
    (``unique[k][inverse[i]]`` is config ``i``'s value); a column is spread over all configs, and
    kept, only when it is asked for, so ranking a huge space holds the few columns it sorts by."""

    def __init__(self, unique: dict[str, np.ndarray], inverse: np.ndarray | None):
        self.unique = unique
        self.inverse = inverse  # None: one distinct input per config, in config order
        self._full: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        column = self._full.get(key)
        if column is None:
            column = self.unique[key] if self.inverse is None else self.unique[key][self.inverse]
            self._full[key] = column
        return column

    def __iter__(self) -> Iterator[str]:
        return iter(self.unique)

    def __len__(self) -> int:
        return len(self.unique)

    def __contains__(self, key: object) -> bool:
        return key in self.unique

    def at(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Every column at ``rows`` only (nothing spread over the whole ranking)."""
        where = rows if self.inverse is None else self.inverse[rows]
        return {k: v[where] for k, v in self.unique.items()}

    def row(self, index: int) -> dict[str, Any]:
        where = index if self.inverse is None else int(self.inverse[index])
        return {k: v[where] for k, v in self.unique.items()}


@dataclass
class Ranking:
    """Predictions for every valid config and their order: feasible by objective first, then
    the configs predicted not to fit (by headroom), so ``order[:k]`` is always the k best bets."""

    enumeration: Enumeration
    predictions: Mapping[str, np.ndarray]
    order: np.ndarray
    objectives: list[tuple[str, str]]
    _values: dict[str, dict[str, Any]] | None = field(default=None, repr=False)
    # what the predictions were made for (model, workload, cluster); None where they were given
    context: ProbeContext | None = field(default=None, repr=False)

    def time_components_at(self, index: int, num_layers: int) -> dict[str, float] | None:
        """The simulator's step-time components (``time_<part>``, seconds) of config ``index`` on
        the spec's model cut to ``num_layers`` layers: how a memory profile of that config is priced,
        so that the profile's measured step is a reading of the same layout's speed
        (:meth:`autotune.guide.guided.Guide._profile_rows`). None without a context or where the
        cut model is not a valid layout."""
        if self.context is None or num_layers < 1:
            return None
        from autotune.workers.simulate import columns_from_params, simulate_configs

        ctx = self.context
        model = {**ctx.model, "num_hidden_layers": int(num_layers)}
        config = self.enumeration.configs[index]
        p = simulate_configs(model, ctx.workload, ctx.hardware, ctx.cluster, columns_from_params([config]))
        if "valid" in p and not bool(np.asarray(p["valid"])[0]):
            return None
        return {k: float(np.nan_to_num(np.asarray(v, dtype=float)[0])) for k, v in p.items() if k.startswith("time_")}

    @property
    def fit(self) -> int:
        return int(np.asarray(self.predictions["fits"], dtype=bool).sum())

    def index_of(self, key: str) -> int | None:
        """Row of the config with this canonical key (``space.config_key``), if ranked."""
        return self.enumeration.index_of_key(key)

    def metrics_of(self, index: int) -> dict[str, Any]:
        p = self.predictions
        values = p.row(index) if isinstance(p, Predictions) else {k: v[index] for k, v in p.items()}
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in values.items()}

    def top(self, k: int, feasible_only: bool = True) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        fits = np.asarray(self.predictions["fits"], dtype=bool)
        out = []
        for i in self.order:
            if feasible_only and not fits[i]:
                continue
            out.append((self.enumeration.configs[i], self.metrics_of(int(i))))
            if len(out) >= k:
                break
        return out

    # ---- layouts ---------------------------------------------------------------------------------
    def _objective_keys(self) -> np.ndarray:
        """Each config's objectives as the layouts compare them (rows equal: the model cannot tell them apart)."""
        values = np.stack([np.asarray(self.predictions[m], dtype=float) for m, _ in self.objectives], axis=1)
        if TIEBREAK in self.predictions and len(values):
            # serving: predictions within 1 % of each other are one layout (the queueing model's
            # tails are not finer than that); the knobs that differ inside it are named
            values = np.round(np.log(np.clip(np.nan_to_num(values, nan=1e-12), 1e-12, None)) / np.log1p(SERVE_TIE))
        return np.round(np.nan_to_num(values, nan=-1.0), 9)

    def _peaks(self) -> np.ndarray:
        n = len(self.order)
        return np.round(np.nan_to_num(np.asarray(self.predictions.get("peak_memory_gib", np.zeros(n)))), 3)

    def distinct_layouts(self, k: int | None = None, feasible_only: bool = True) -> list[Layout]:
        """The ranking with the configs the model cannot tell apart collapsed into one layout each,
        in ranking order; the first ``k``.

        Configs with equal predictions of every objective are candidates; a knob on which they differ
        is called undistinguished only when the model prices its values alike: every config that
        differs from the layout's first (its roomiest) in that knob alone predicts the same objectives
        and the same peak memory. A knob priced alike in speed but not in memory is the model's choice
        by headroom (``roomiest``); members that differ in any other knob (equal predictions by
        coincidence, e.g. 1 x tp8 and 4 x tp2 of equal goodput) are layouts of their own."""
        return list(itertools.islice(self.layouts(feasible_only), k))

    def layouts(self, feasible_only: bool = True) -> Iterator[Layout]:
        """:meth:`distinct_layouts` one at a time: only the candidates of the layouts taken are read."""
        if not len(self.order):
            return
        fits = np.asarray(self.predictions["fits"], dtype=bool)
        rows = self.order[fits[self.order]] if feasible_only else self.order
        if not len(rows):
            return
        keys = self._objective_keys()
        peak = self._peaks()
        # candidates: equal objective rows, each group in ranking order, groups by their best member
        if keys.shape[1] == 1:
            _, group = np.unique(keys[rows, 0], return_inverse=True)
        else:
            _, group = np.unique(keys[rows], axis=0, return_inverse=True)
        group = group.reshape(-1)
        by_group = np.argsort(group, kind="stable")
        bounds = np.flatnonzero(np.diff(group[by_group])) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [len(rows)]])
        first_at = by_group[starts]  # each group's best position in the ranking
        e = self.enumeration
        unset = [np.asarray([v is None for v in vocab] or [False]) for vocab in e.vocab]
        rank = 0
        for g in np.argsort(first_at, kind="stable"):
            pending = rows[np.sort(by_group[starts[g] : ends[g]])]
            while len(pending):
                first = int(pending[0])
                codes = e.codes[pending]
                base = e.codes[first]
                alike, roomiest = self._priced_alike(first, keys, peak, codes, unset)
                free = alike | roomiest
                fixed = [j for j, name in enumerate(e.names) if name not in free]
                taken = np.all(codes[:, fixed] == base[fixed], axis=1)
                same = pending[taken]
                varying: dict[str, list[Any]] = {}
                by_memory: dict[str, list[Any]] = {}
                for name in sorted(free):
                    j = e.names.index(name)
                    seen = {str(e.vocab[j][c]): e.vocab[j][c] for c in np.unique(codes[taken, j]).tolist()}
                    if len(seen) > 1:
                        (varying if name in alike else by_memory)[name] = sorted(seen.values(), key=str)
                rank += 1
                yield Layout(first, rank, same.tolist(), varying, by_memory)
                pending = pending[~taken]

    def _priced_alike(
        self, first: int, keys: np.ndarray, peak: np.ndarray, codes: np.ndarray, unset: list[np.ndarray]
    ) -> tuple[set[str], set[str]]:
        """(knobs whose every other value, changed alone from config ``first``, the model prices
        alike in the objectives and the peak memory; knobs priced alike in the objectives only).
        Only knobs on which the candidates (their ``codes``) differ are tried; a knob no sibling
        exists for is neither."""
        e = self.enumeration
        base_codes = e.codes[first]
        # a knob differs where a candidate sets it to another value than the first's
        differing = [
            name
            for j, name in enumerate(e.names)
            if np.any((codes[:, j] != base_codes[j]) & ~unset[j][np.minimum(codes[:, j], len(unset[j]) - 1)])
        ]
        base = e.configs[first]
        alike: set[str] = set()
        roomiest: set[str] = set()
        for name in sorted(differing):
            siblings = [
                e.index_of_config({**base, name: v}) for v in self._values_of(name).values() if v != base.get(name)
            ]
            siblings = [i for i in siblings if i is not None]
            if not siblings or any(not np.array_equal(keys[i], keys[first]) for i in siblings):
                continue
            (alike if all(peak[i] == peak[first] for i in siblings) else roomiest).add(name)
        return alike, roomiest

    def knob_pricing(self, names: list[str], sample: int = 300) -> dict[str, str]:
        """For each searched knob in ``names``, whether the model prices it: ``speed`` (changing it
        alone changes a predicted objective somewhere), ``memory only`` (only the predicted peak), or
        ``not priced`` (a probe must choose). Read over the ``sample`` best-ranked configs."""
        enumeration = self.enumeration
        values = np.stack([np.asarray(self.predictions[m], dtype=float) for m, _ in self.objectives], axis=1)
        values = np.round(np.nan_to_num(values, nan=-1.0), 9)
        peak = np.round(
            np.nan_to_num(np.asarray(self.predictions.get("peak_memory_gib", np.zeros(enumeration.valid)))), 3
        )
        out = {name: "not priced" for name in names}
        alone: set[str] = set()  # knobs some config could change alone (others derive values from them)
        top = self.order[:sample]
        for i, config in zip(top.tolist(), enumeration.configs.rows(top)):
            for name in names:
                if out[name] == "speed" or name not in config:
                    continue
                for v in self._values_of(name).values():
                    j = None if v == config[name] else enumeration.index_of_config({**config, name: v})
                    if j is None:
                        continue
                    alone.add(name)
                    if not np.array_equal(values[i], values[j]):
                        out[name] = "speed"
                        break
                    if peak[i] != peak[j]:
                        out[name] = "memory only"
        first = values[:, 0]
        for name in set(names) - alone:  # tp, pp, micro-batch: dp and grad-accum follow; the means tell
            if name not in enumeration.names:
                continue
            j = enumeration.names.index(name)
            codes = enumeration.codes[:, j].astype(np.int64)
            unset = [c for c, v in enumerate(enumeration.vocab[j]) if v is None]
            present = ~np.isin(codes, unset) if unset else np.ones(len(codes), dtype=bool)
            # one mean per value, by its text (as the configs print it)
            texts = [str(v) for v in enumeration.vocab[j]]
            _, by_text = np.unique(np.asarray(texts, dtype=object).astype(str), return_inverse=True)
            group = by_text.reshape(-1)[codes[present]]
            counts = np.bincount(group)
            sums = np.bincount(group, weights=first[present])
            spread = (sums[counts > 0] / counts[counts > 0]).tolist()
            if len(spread) > 1 and max(spread) - min(spread) > 1e-9 * max(1.0, abs(max(spread))):
                out[name] = "speed"
        return out

    def _values_of(self, name: str) -> dict[str, Any]:
        """Every value the ranked configs give ``name`` (by its text), in the order they first appear."""
        if self._values is None:
            e = self.enumeration
            values: dict[str, dict[str, Any]] = {}
            for j, column in enumerate(e.names):
                codes, at = np.unique(e.codes[:, j], return_index=True)
                seen = values.setdefault(column, {})
                for code in codes[np.argsort(at, kind="stable")].tolist():
                    v = e.vocab[j][code]
                    if v is not None:
                        seen.setdefault(str(v), v)
            self._values = values
        return self._values.get(name, {})

    def write_csv(self, path: Path, metric_columns: list[str] | None = None) -> Path:
        """The full ranking as a CSV artifact: rank, params, predicted metrics."""
        e = self.enumeration
        param_names = sorted(
            name for j, name in enumerate(e.names) if any(e.vocab[j][c] is not None for c in np.unique(e.codes[:, j]))
        )
        metric_names = metric_columns or [k for k in self.predictions if not k.startswith(("mem_", "time_"))]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["rank", *param_names, *(f"predicted_{m}" for m in metric_names)])
            for start in range(0, len(self.order), SIM_CHUNK):
                rows = self.order[start : start + SIM_CHUNK]
                p = self.predictions
                metrics = (
                    p.at(rows) if isinstance(p, Predictions) else {m: np.asarray(p[m])[rows] for m in metric_names}
                )
                for rank, config, *values in zip(
                    range(start + 1, start + len(rows) + 1), e.configs.rows(rows), *(metrics[m] for m in metric_names)
                ):
                    writer.writerow(
                        [
                            rank,
                            *(config.get(name, "") for name in param_names),
                            *(f"{v:.6g}" if isinstance(v, (float, np.floating)) else v for v in values),
                        ]
                    )
        return path


# the simulator's continuous max rate meeting the SLO, per device (workers/simulate/_serve.py)
TIEBREAK = "max_rate_rps_model_per_device"
SERVE_TIE = 0.01  # serving predictions closer than this share are one layout


def pareto_order(values: np.ndarray) -> np.ndarray:
    """Non-dominated sorting rank per row of ``values`` (all objectives to be maximised);
    0 is the Pareto front. Quadratic in rows per front, fine for the few hundred rows it sees."""
    n = len(values)
    ranks = np.full(n, -1)
    remaining = np.arange(n)
    level = 0
    while remaining.size:
        sub = values[remaining]
        dominated = np.zeros(len(remaining), dtype=bool)
        for j in range(len(remaining)):
            better_eq = np.all(sub >= sub[j], axis=1)
            strictly = np.any(sub > sub[j], axis=1)
            dominated[j] = np.any(better_eq & strictly)
        front = remaining[~dominated]
        ranks[front] = level
        remaining = remaining[dominated]
        level += 1
    return ranks


class _Reads(dict):
    """A config that notes which of its keys the simulator's column builder reads."""

    def __init__(self, config: dict[str, Any], read: set[str], everything: list[bool]):
        super().__init__(config)
        self._read, self._everything = read, everything

    def get(self, key: Any, default: Any = None) -> Any:
        self._read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self._read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def _all(self) -> None:
        self._everything[0] = True

    def __iter__(self) -> Iterator[Any]:
        self._all()
        return super().__iter__()

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()


def _priced_columns(enumeration: Enumeration) -> list[int]:
    """The config columns the simulator's inputs are built from (``columns_from_params`` reads
    them): noted over configs that take every value of every column and every pattern of unset
    values. Configs equal in these columns get equal predictions."""
    from autotune.workers.simulate import columns_from_params

    e = enumeration
    if not e.names:
        return []
    rows: set[int] = set()
    for j in range(len(e.names)):
        rows.update(np.unique(e.codes[:, j], return_index=True)[1].tolist())
    unset = np.stack(
        [np.isin(e.codes[:, j], [c for c, v in enumerate(e.vocab[j]) if v is None]) for j in range(len(e.names))],
        axis=1,
    )
    rows.update(np.unique(np.packbits(unset, axis=1), axis=0, return_index=True)[1].tolist())
    read: set[str] = set()
    everything = [False]
    columns_from_params([_Reads(c, read, everything) for c in e.configs.rows(np.asarray(sorted(rows)))])
    if everything[0]:
        return list(range(len(e.names)))
    return [j for j, name in enumerate(e.names) if name in read]


def _distinct_inputs(enumeration: Enumeration) -> tuple[np.ndarray, np.ndarray | None]:
    """(one config of each distinct simulator input, each config's input among them; None where
    every config is its own)."""
    e = enumeration
    priced = _priced_columns(e)
    if len(priced) == len(e.names):
        return np.arange(e.valid), None
    codes = e.codes[:, priced].astype(np.int64)
    radix = [max(len(e.vocab[j]), 1) for j in priced]
    if np.prod(np.asarray(radix, dtype=float)) < 2.0**62:
        weights = np.cumprod([1, *radix[::-1]])[:-1][::-1].astype(np.int64)
        keys = codes @ weights if priced else np.zeros(e.valid, dtype=np.int64)
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    else:
        rows = np.ascontiguousarray(codes).view(np.dtype((np.void, 8 * len(priced)))).ravel()
        _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def rank_space(enumeration: Enumeration, context: ProbeContext, objectives: list[tuple[str, str]]) -> Ranking:
    from autotune.workers.simulate import columns_from_params, simulate_configs

    if not enumeration.configs:
        return Ranking(enumeration, {"fits": np.zeros(0, dtype=bool)}, np.zeros(0, dtype=int), objectives)
    # each distinct simulator input priced once, in chunks
    first, inverse = _distinct_inputs(enumeration)
    parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(first), SIM_CHUNK):
        columns = columns_from_params(enumeration.configs.rows(first[start : start + SIM_CHUNK]))
        chunk = simulate_configs(context.model, context.workload, context.hardware, context.cluster, columns)
        for k, v in chunk.items():
            parts.setdefault(k, []).append(np.asarray(v))
    unique = {k: np.concatenate(v) for k, v in parts.items()}
    del parts
    unique["fits"] = np.asarray(unique["fits"], dtype=bool)
    if "valid" in unique:
        unique["fits"] &= np.asarray(unique["valid"], dtype=bool)
    meets = enumeration.outcome(unique) if enumeration.outcome is not None else None
    if meets is not None:  # the spec's constraints on metrics (scaling_efficiency >= 0.8): predicted to miss is out
        unique["meets_constraints"] = meets
        unique["fits_memory"] = unique["fits"].copy()
        unique["fits"] &= meets
    predictions = Predictions(unique, inverse)
    fits = predictions["fits"]
    signed = np.stack(
        [np.asarray(predictions[m], dtype=float) * (1.0 if d == "maximize" else -1.0) for m, d in objectives], axis=1
    )
    signed = np.nan_to_num(signed, nan=-np.inf)
    feasible = np.flatnonzero(fits)
    infeasible = np.flatnonzero(~fits)
    headroom = np.asarray(predictions.get("memory_headroom_gib", np.zeros(len(fits))), dtype=float)
    # by the first objective; equal predictions (settings the model prices the same): the safer
    # config, with more memory headroom, first
    # a serving prediction at the rate ladder ties many configs: the model's continuous sustainable
    # rate per device orders them before the headroom does
    tiebreak = np.nan_to_num(np.asarray(predictions.get(TIEBREAK, np.zeros(len(fits))), dtype=float), nan=-np.inf)
    by_first = feasible[np.lexsort((-headroom[feasible], -tiebreak[feasible], -signed[feasible, 0]))]
    if len(objectives) == 1:
        feas_order = by_first
    else:
        # Pareto fronts, then the order above within a front; cap the quadratic sort
        cand = by_first
        head, tail = cand[:2000], cand[2000:]
        fronts = pareto_order(signed[head])
        feas_order = np.concatenate([head[np.lexsort((np.arange(len(head)), fronts))], tail])
    infeas_order = infeasible[np.argsort(-headroom[infeasible], kind="stable")]
    order = np.concatenate([feas_order, infeas_order]).astype(int)
    return Ranking(enumeration, predictions, order, objectives, context=context)
