"""Stopping running probes that cannot win, from the step events they stream.

Every trial of a study has the same global batch and world size, so its throughput is inversely
proportional to its step time: a probe whose median measured step time (at least
``search.prune_min_steps`` steps) exceeds the best trial's step time by more than
``search.prune_margin`` (50 % by default: above the +-30 % run-to-run noise measured on these
machines) cannot win, and is killed. It is recorded as ``pruned`` with the steps it made
(:func:`autotune.study.interpret.settle_pruned`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .interpret import measured_step_times
from .records import TrialRecord
from ..sanity import is_finite_number as _finite
from ..settings import Objectives

__all__ = ["LoserPruner", "PruneSettings"]

_STEP_OBJECTIVES = ("tokens_per_s_per_device", "tokens_per_s", "samples_per_s", "step_time_s")


@dataclass(frozen=True)
class PruneSettings:
    """The pruner's settings, made once from the spec's ``search:`` section by the assembly."""

    prune: bool  # search.prune: the user allows stopping a probe that cannot win
    prune_margin: float  # search.prune_margin: how much slower than the best a probe must be to be stopped
    prune_min_steps: int  # search.prune_min_steps: measured steps a probe makes before it is judged


class LoserPruner:
    """Keeps the running trials' streamed steps; cancels the confident losers (``objectives``:
    the study's, resolved; only a single step-time objective on real probes is pruned)."""

    def __init__(self, settings: PruneSettings, objectives: Objectives, simulated: bool):
        self.settings = settings
        self.active = (
            settings.prune and not simulated and len(objectives) == 1 and objectives[0].metric in _STEP_OBJECTIVES
        )
        self.live_steps: dict[int, list[dict[str, Any]]] = {}  # step events of running trials
        self.reasons: dict[int, str] = {}  # trials being stopped early, and why

    def settle(self, number: int) -> tuple[list[dict[str, Any]], str | None]:
        """What streamed from a finished trial, and why it was stopped (None: it was not)."""
        return self.live_steps.pop(number, []), self.reasons.pop(number, None)

    def prune(
        self,
        events: list[tuple[int, dict[str, Any]]],
        pending: dict[Any, tuple[Any, dict]],
        best: Callable[[], TrialRecord | None],
        cancel: Callable[[Any], None],
    ) -> None:
        """Take the new step ``events``; cancel each pending trial that cannot beat ``best()``."""
        for number, event in events:
            self.live_steps.setdefault(number, []).append(event)
        if not events or not self.active or not pending:
            return
        leader = best()
        best_step = leader.metrics.get("step_time_s") if leader else None
        if not _finite(best_step) or best_step <= 0:
            return
        margin = self.settings.prune_margin
        for handle, (trial, _) in pending.items():
            if trial.number in self.reasons:
                continue
            times = measured_step_times(self.live_steps.get(trial.number, []))
            if len(times) < self.settings.prune_min_steps:
                continue
            median = statistics.median(times)
            if median > best_step * (1 + margin):
                self.reasons[trial.number] = (
                    f"stopped early after {len(times)} measured steps: median step {median:.4g} s is "
                    f"{median / best_step:.2f}x the best's {best_step:.4g} s (trial {leader.number}); "
                    f"margin {margin:.0%}"
                )
                cancel(handle)
