"""From an Optuna proposal to a config worth probing: its canonical form, the rules, repeats, the cache.

A proposal is resolved to its canonical config (:mod:`autotune.spec.space`: equivalent proposals are
one config, derived values filled in). A config the rules reject, or one already measured in this
study, is answered here without a probe (told to Optuna: the rules' violations as an infeasible
mark, a repeat with the original's values); what is left is probed, with the model's prediction
(refitted on what was measured) kept beside it and the reason it was chosen.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.workers.protocol import ProbeResult

from ..spec.context import RequestSettings
from .interpret import penalty
from .records import frozen_trial
from ..settings import Objectives
from ..spec.space import Space, config_key
from .plan import predicted_of
from ..trial_attrs import A

__all__ = ["TrialResolver", "rule_rejection", "tell"]


def tell(study: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``, where a sampler's ``study.stop()`` is not an error. Optuna's GridSampler
    calls it in ``after_trial`` once every grid point was sampled, and ``Study.stop`` raises
    outside ``study.optimize``; Optuna has stored the trial by then (in a ``finally``), and the
    loop ends by itself when the space is exhausted."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def rule_rejection(violations: list[str]) -> dict[str, Any]:
    """The user attributes of a proposal the rules rejected, in the order they are written: before
    its config, so that a run killed between the writes never leaves a config without its verdict
    (resumed, such a config was queued again, skipped the rules and reached a worker, which answered
    it invalid as a probe of the budget: :func:`autotune.study.requeue.recover_interrupted`)."""
    return {A.STATUS: "invalid", A.REASON: f"rejected by rules: {'; '.join(violations)}", A.SOURCE: "rules"}


class TrialResolver:
    """Resolves the proposals of one study (``request``: the request builder's settings, the probe
    context and the masked backend among them; ``objectives``: the study's, resolved; ``refit``: a
    callable giving the model's current refit)."""

    def __init__(
        self,
        space: Space,
        request: RequestSettings,
        objectives: Objectives,
        simulated: bool,
        guided: Any,
        ranking: Any,
        refit: Any,
        cache: Any = None,
        reuse_cache: bool = False,
    ):
        self.space, self.request, self.context = space, request, request.context
        self.objectives = objectives
        self.simulated, self.guided, self.ranking, self.refit = simulated, guided, ranking, refit
        self.cache, self.reuse_cache = cache, reuse_cache

    def resolve(self, study: optuna.Study, trial: optuna.Trial, seen: dict[str, int]) -> tuple[dict, str] | None:
        """``(config, why chosen)`` to probe, or None when the proposal was answered without one."""
        ua = trial.user_attrs
        config = ua.get(A.CONFIG)
        if config is None:
            resolved = self.space.resolve(dict(trial.params))
            if not resolved.valid:
                for name, value in {**rule_rejection(resolved.violations), A.CONFIG: resolved.config}.items():
                    trial.set_user_attr(name, value)  # the verdict first: see rule_rejection
                trial.set_constraint("feasible", float(len(resolved.violations)))
                tell(study, trial, penalty(self.objectives))
                return None
            config = resolved.config
            trial.set_user_attr(A.CONFIG, config)
            trial.set_user_attr(A.KEY, resolved.key)
            guided = self.guided.proposal(trial.number) if self.guided is not None else {}
            if guided.get("predicted"):
                trial.set_user_attr(A.PREDICTED, {**self.prediction(config), **guided["predicted"]})
            if guided.get("remeasure") and resolved.key in seen:
                trial.set_user_attr(A.REMEASURE_OF, seen[resolved.key])
            if guided.get("gamble") and resolved.key in seen:
                trial.set_user_attr(A.GAMBLE_ON, seen[resolved.key])
            why = guided.get("reason") or ua.get(A.CHOSEN) or f"proposed by the {type(study.sampler).__name__}"
            ua = trial.user_attrs
        else:
            why = ua.get(A.CHOSEN, "queued")
        key = config_key(config)
        if key in seen and A.REMEASURE_OF not in ua and A.GAMBLE_ON not in ua:
            original = frozen_trial(study, seen[key])
            trial.set_user_attr(A.DUPLICATE_OF, seen[key])
            trial.set_user_attr(A.STATUS, "duplicate")
            trial.set_user_attr(A.REASON, f"same canonical config as trial {seen[key]}; not probed again")
            if original is not None and original.state == TrialState.COMPLETE and original.values:
                for name, value in original.constraints.items():
                    trial.set_constraint(name, value)
                tell(study, trial, list(original.values))
            else:
                tell(study, trial, state=TrialState.FAIL)
            return None
        if not ua.get(A.CHOSEN):
            trial.set_user_attr(A.CHOSEN, why)
        if not self.simulated:  # predicted next to measured, for every probe, with the latest refit
            predicted = dict(ua.get(A.PREDICTED) or self.prediction(config))
            predicted.update(self.refit().apply(predicted))  # beside the raw prediction, never instead
            trial.set_user_attr(A.PREDICTED, predicted)
        elif not ua.get(A.PREDICTED):  # a queued baseline: its memory breakdown, as every ranked trial has
            trial.set_user_attr(A.PREDICTED, self.prediction(config))
        return config, why

    def prediction(self, config: dict[str, Any]) -> dict[str, float]:
        """The simulator's raw prediction for one config (from the ranking when there is one)."""
        raw = None
        if self.ranking is not None:
            index = self.ranking.index_of(config_key(config))
            if index is not None:
                raw = self.ranking.metrics_of(index)
        if raw is None:
            from autotune.workers.simulate import columns_from_params, simulate_configs

            c = self.context
            predictions = simulate_configs(c.model, c.workload, c.hardware, c.cluster, columns_from_params([config]))
            raw = {k: v[0] for k, v in predictions.items()}
        return predicted_of(raw, self.objectives)

    # ---- the result cache (autotune.study.cache): configs measured by any study of the same setting ----
    def cache_key(self, config: dict[str, Any]) -> str:
        from .cache import cache_key

        c = self.context
        return cache_key(config_key(config), c.model, c.workload, c.cluster, self.request.backend)

    def from_cache(self, config: dict[str, Any]) -> tuple[ProbeResult, dict[str, Any]] | None:
        if self.cache is None or not self.reuse_cache:
            return None
        hit = self.cache.get(self.cache_key(config))
        if hit is None:
            return None
        result, origin = hit
        result.info = {**result.info, "cached_from": origin}
        return result, origin
