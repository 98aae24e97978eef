"""A slice study's best configs measured again at the target's full size (issue 45, ``cluster.confirm_top``).

A study that probes on a slice of its cluster (``cluster.probe_nodes``) ranks every config by the
calibrated model's projection of its measurement. The projection cancels what the model gets
wrong at both sizes alike, not what appears only at the target: a shared link, an overlap that
breaks past some size (``benchmarks/scaling_unpriced_worlds.py``: in such worlds the config the
projection ranks first was 0.79-0.95 of the true best, median over worlds). Once the budget is
spent, the ``confirm_top`` best configs by their projection are queued again, each to run once at
full size (the trial attribute ``AT_TARGET``); the recommendation is then chosen among those
full-size measurements (:func:`autotune.study.records.measured_at_target_first`).
"""

from __future__ import annotations

import statistics
from typing import Any

import optuna

from ..settings import Objectives
from ..spec.space import Space, config_key
from ..trial_attrs import A
from .plan import params_for
from .records import TrialRecord, rankable, trial_records

__all__ = ["confirmed_before", "queue_confirmations", "projected_ranking"]


def confirmed_before(study: optuna.Study) -> bool:
    """Whether the study queued its confirmations already (a resumed study does not queue them twice)."""
    return any(t.user_attrs.get(A.AT_TARGET) for t in study.get_trials(deepcopy=False))


def projected_ranking(records: list[TrialRecord], objectives: Objectives) -> list[tuple[TrialRecord, float]]:
    """The configs measured on the slice, best first by the mean of their projected readings of the
    first objective; each with its latest record. Infeasible results (a constraint on metrics
    missed) and failed probes are left out."""
    metric, direction = objectives[0]
    groups: dict[str, list[TrialRecord]] = {}
    for r in rankable(records, objectives[:1]):
        groups.setdefault(config_key(r.config), []).append(r)
    ranked = [
        (max(rs, key=lambda r: r.number), statistics.fmean(float(r.metrics[metric]) for r in rs))
        for rs in groups.values()
    ]
    ranked.sort(key=lambda pair: pair[1], reverse=direction == "maximize")
    return ranked


def queue_confirmations(study: optuna.Study, space: Space, objectives: Objectives, top: int, nodes: int) -> int:
    """Queue the ``top`` best configs by their projection to run once more at full size; returns
    how many were queued (0 when done before, or nothing was measured)."""
    if top <= 0 or confirmed_before(study):
        return 0
    metric = objectives[0][0]
    ranked = projected_ranking(trial_records(study), objectives)[:top]
    for place, (record, value) in enumerate(ranked, start=1):
        attrs: dict[str, Any] = {
            A.CONFIG: record.config,
            A.KEY: config_key(record.config),
            A.AT_TARGET: True,
            A.REMEASURE_OF: record.number,
            A.CHOSEN: (
                f"confirmation at the target's full size ({nodes} nodes): #{place} of the projected ranking "
                f"(trial {record.number}, {metric} {value:,.4g} projected from the slice)"
            ),
        }
        study.enqueue_trial(params_for(space, record.config), user_attrs=attrs, skip_if_exists=False)
    return len(ranked)
