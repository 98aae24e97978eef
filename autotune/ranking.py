"""Rank a whole space with the analytical model: the simulator pre-screen.

Simulation is cheap (tens of thousands of configs per second, vectorised), so the whole valid
space is predicted at once; ``plan`` prints the result, the simulate backend records its top
configs as trials, and real backends probe the predicted best first.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .context import ProbeContext
from .space import Enumeration

__all__ = ["Ranking", "Layout", "rank_space", "pareto_order"]


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


@dataclass
class Ranking:
    """Predictions for every valid config and their order: feasible by objective first, then
    the configs predicted not to fit (by headroom), so ``order[:k]`` is always the k best bets."""

    enumeration: Enumeration
    predictions: dict[str, np.ndarray]
    order: np.ndarray
    objectives: list[tuple[str, str]]
    _by_key: dict[str, int] | None = field(default=None, repr=False)
    _values: dict[str, dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def fit(self) -> int:
        return int(np.asarray(self.predictions["fits"], dtype=bool).sum())

    def index_of(self, key: str) -> int | None:
        """Row of the config with this canonical key (``space.config_key``), if ranked."""
        if self._by_key is None:
            from .space import config_key

            self._by_key = {config_key(c): i for i, c in enumerate(self.enumeration.configs)}
        return self._by_key.get(key)

    def metrics_of(self, index: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self.predictions.items():
            value = v[index]
            out[k] = value.item() if isinstance(value, np.generic) else value
        return out

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

    def distinct_layouts(self, k: int | None = None, feasible_only: bool = True) -> list[Layout]:
        """The ranking with the configs the model cannot tell apart collapsed into one layout each,
        in ranking order; the first ``k``.

        Configs with equal predictions of every objective are candidates; a knob on which they differ
        is called undistinguished only when the model prices its values alike: every config that
        differs from the layout's first (its roomiest) in that knob alone predicts the same objectives
        and the same peak memory. A knob priced alike in speed but not in memory is the model's choice
        by headroom (``roomiest``); members that differ in any other knob (equal predictions by
        coincidence, e.g. 1 x tp8 and 4 x tp2 of equal goodput) are layouts of their own."""
        fits = np.asarray(self.predictions["fits"], dtype=bool)
        values = (
            np.stack([np.asarray(self.predictions[m], dtype=float) for m, _ in self.objectives], axis=1)
            if len(self.order)
            else np.zeros((0, len(self.objectives)))
        )
        if TIEBREAK in self.predictions and len(self.order):
            # serving: predictions within 1 % of each other are one layout (the queueing model's
            # tails are not finer than that); the knobs that differ inside it are named
            values = np.round(np.log(np.clip(np.nan_to_num(values, nan=1e-12), 1e-12, None)) / np.log1p(SERVE_TIE))
        keys = [tuple(row) for row in np.round(np.nan_to_num(values, nan=-1.0), 9).tolist()]
        peak = np.round(np.nan_to_num(np.asarray(self.predictions.get("peak_memory_gib", np.zeros(len(keys))))), 3)
        groups: dict[tuple, list[int]] = {}
        for i in self.order.tolist():
            if feasible_only and not fits[i]:
                continue
            groups.setdefault(keys[i], []).append(i)
        configs = self.enumeration.configs
        out: list[Layout] = []
        for members in groups.values():
            pending = members
            while pending:
                first = pending[0]
                alike, roomiest = self._priced_alike(first, keys, peak, pending)
                free = alike | roomiest
                same = [j for j in pending if _differs_only_in(configs[j], configs[first], free)]
                varying: dict[str, list[Any]] = {}
                by_memory: dict[str, list[Any]] = {}
                for name in sorted(free):
                    seen = sorted({str(configs[j].get(name)): configs[j].get(name) for j in same}.values(), key=str)
                    if len(seen) > 1:
                        (varying if name in alike else by_memory)[name] = seen
                out.append(Layout(first, len(out) + 1, same, varying, by_memory))
                if k is not None and len(out) >= k:
                    return out
                taken = set(same)
                pending = [j for j in pending if j not in taken]
        return out

    def _priced_alike(
        self, first: int, keys: list[tuple], peak: np.ndarray, members: list[int]
    ) -> tuple[set[str], set[str]]:
        """(knobs whose every other value, changed alone from config ``first``, the model prices
        alike in the objectives and the peak memory; knobs priced alike in the objectives only).
        Only knobs on which ``members`` differ are tried; a knob no sibling exists for is neither."""
        from .space import config_key

        configs = self.enumeration.configs
        base = configs[first]
        differing = {n for j in members for n, v in configs[j].items() if base.get(n) != v}
        alike: set[str] = set()
        roomiest: set[str] = set()
        for name in sorted(differing):
            siblings = [
                self.index_of(config_key({**base, name: v}))
                for v in self._values_of(name).values()
                if v != base.get(name)
            ]
            siblings = [i for i in siblings if i is not None]
            if not siblings or any(keys[i] != keys[first] for i in siblings):
                continue
            (alike if all(peak[i] == peak[first] for i in siblings) else roomiest).add(name)
        return alike, roomiest

    def knob_pricing(self, names: list[str], sample: int = 300) -> dict[str, str]:
        """For each searched knob in ``names``, whether the model prices it: ``speed`` (changing it
        alone changes a predicted objective somewhere), ``memory only`` (only the predicted peak), or
        ``not priced`` (a probe must choose). Read over the ``sample`` best-ranked configs."""
        from .space import config_key

        configs = self.enumeration.configs
        values = np.stack([np.asarray(self.predictions[m], dtype=float) for m, _ in self.objectives], axis=1)
        values = np.round(np.nan_to_num(values, nan=-1.0), 9)
        peak = np.round(np.nan_to_num(np.asarray(self.predictions.get("peak_memory_gib", np.zeros(len(configs))))), 3)
        out = {name: "not priced" for name in names}
        alone: set[str] = set()  # knobs some config could change alone (others derive values from them)
        for i in self.order[:sample].tolist():
            for name in names:
                if out[name] == "speed" or name not in configs[i]:
                    continue
                for v in self._values_of(name).values():
                    j = None if v == configs[i][name] else self.index_of(config_key({**configs[i], name: v}))
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
            means = {}
            for i, config in enumerate(configs):
                if name in config:
                    means.setdefault(str(config[name]), []).append(first[i])
            spread = [float(np.mean(v)) for v in means.values()]
            if len(spread) > 1 and max(spread) - min(spread) > 1e-9 * max(1.0, abs(max(spread))):
                out[name] = "speed"
        return out

    def _values_of(self, name: str) -> dict[str, Any]:
        """Every value the ranked configs give ``name`` (by its text)."""
        if self._values is None:
            values: dict[str, dict[str, Any]] = {}
            for config in self.enumeration.configs:
                for n, v in config.items():
                    values.setdefault(n, {})[str(v)] = v
            self._values = values
        return self._values.get(name, {})

    def write_csv(self, path: Path, metric_columns: list[str] | None = None) -> Path:
        """The full ranking as a CSV artifact: rank, params, predicted metrics."""
        configs = self.enumeration.configs
        param_names = sorted({k for c in configs for k in c})
        metric_names = metric_columns or [k for k in self.predictions if not k.startswith(("mem_", "time_"))]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["rank", *param_names, *(f"predicted_{m}" for m in metric_names)])
            for rank, i in enumerate(self.order, start=1):
                row = [configs[i].get(p, "") for p in param_names]
                values = [self.predictions[m][i] for m in metric_names]
                writer.writerow(
                    [rank, *row, *(f"{v:.6g}" if isinstance(v, (float, np.floating)) else v for v in values)]
                )
        return path


def _differs_only_in(config: dict[str, Any], other: dict[str, Any], names: set[str]) -> bool:
    return all(config.get(n) == other.get(n) for n in set(config) | set(other) if n not in names)


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


def rank_space(enumeration: Enumeration, context: ProbeContext, objectives: list[tuple[str, str]]) -> Ranking:
    from autotune.workers.simulate import columns_from_params, simulate_configs

    if not enumeration.configs:
        return Ranking(enumeration, {"fits": np.zeros(0, dtype=bool)}, np.zeros(0, dtype=int), objectives)
    columns = columns_from_params(enumeration.configs)
    predictions = simulate_configs(context.model, context.workload, context.hardware, context.cluster, columns)
    fits = np.asarray(predictions["fits"], dtype=bool)
    if "valid" in predictions:
        fits &= np.asarray(predictions["valid"], dtype=bool)
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
    return Ranking(enumeration, predictions, order, objectives)
