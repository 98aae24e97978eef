"""The model-guided search as an Optuna sampler: ``optuna.create_study(sampler=GuidedSampler(...))``.

:class:`~autotune.guide.guided.Guide` decides which config to probe next from the simulator's ranking of
the whole space and what the study has measured. This module makes it an ordinary
``optuna.samplers.BaseSampler`` so that it serves any Optuna code, not only autotune's runner:

- ``infer_relative_search_space`` is the spec's space (its Optuna distributions), known before
  the first trial; ``sample_relative`` returns the guide's next config as raw parameter values
  that :meth:`autotune.spec.space.Space.resolve` turns back into that config. Parameters outside the
  spec's space (a conditional parameter of the user's objective) go to an independent sampler
  (random, seeded), as do all parameters once the guide has nothing left worth probing.
- Parameters fixed for a trial (``study.enqueue_trial({"tp": 2})``) narrow the guide's choice to
  configs with those values.
- Everything the guide learns is read back from the study's trials each time (the storage is the
  record: a resumed study, or one shared by several workers, continues with the same fit).
  ``after_trial`` turns a failed trial's error text into evidence once, stored on the trial: an
  out-of-memory message becomes ``status: oom`` with the allocator's byte counts.
- The stopping rule ("no remaining config can win") is a study callback, :meth:`stop_callback`,
  for ``study.optimize(..., callbacks=[sampler.stop_callback])``; autotune's runner asks
  :meth:`stop_reason` before each trial.

What a plain objective tells the guide: its return value (the first objective), and optionally
``trial.set_user_attr("peak_memory_gib", ...)`` and ``"step_time_s"``; a failure through
:func:`report_failure` (or the ``autotune.reason`` user attribute) before raising.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from autotune.objectives.intervals import step_reading_noise

from .guided import Guide, GuideSettings, Observation, Proposal, readings_of
from .memory_profile import cost_of_trials
from .ranking import Ranking
from ..sanity import is_finite_number as _finite
from ..spec.space import Space, config_key
from ..trial_attrs import A, RAN
from ..workers.protocol import PEAK_COUNTS_KEY, USABLE_KEY

__all__ = ["GuidedSampler", "report_failure", "GUIDE_ATTR", "OUTCOME_ATTR"]

GUIDE_ATTR = "autotune.guide"  # system attribute: why the guide chose a trial's config, its prediction
OUTCOME_ATTR = "autotune.outcome"  # system attribute: a failed trial's status and OOM byte counts (after_trial)
_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_NOT_PROBES = ("duplicate", "interrupted", "running", "infra")  # infra: the machine failed, not the config


def report_failure(trial: optuna.Trial, error: BaseException | str, status: str | None = None) -> None:
    """Record why a trial failed, for the guide: call it in an objective before raising.

    The text is kept whole enough for the allocator's byte counts (torch's and torch_npu's
    out-of-memory messages carry them); ``after_trial`` classifies it, unless ``status``
    (``oom``, ``nan``, ``invalid``, ``crash``, ``timeout``) says what happened."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    trial.set_user_attr(A.REASON, text[-4000:])
    if status:
        trial.set_user_attr(A.STATUS, status)


class GuidedSampler(BaseSampler):
    """Model-guided proposals over a ranked space (see the module docstring).

    ``ranking`` is the simulator's ranking of ``space`` (:func:`autotune.guide.ranking.rank_space`);
    ``objective`` the metric the study's first value is, and its direction; ``n_trials`` the
    study's budget, when known, so that the budget the race of the contenders may spend is held
    back for it at the end."""

    def __init__(
        self,
        ranking: Ranking,
        space: Space,
        objective: tuple[str, str] | None = None,
        *,
        settings: GuideSettings | None = None,
        seed: int | None = None,
        n_trials: int | None = None,
        independent_sampler: BaseSampler | None = None,
    ):
        if not ranking.enumeration.configs:
            raise ValueError("the space has no valid config: there is nothing for the guide to propose")
        self.ranking = ranking
        self.space = space
        self.objective = objective or ranking.objectives[0]
        self.guide = Guide(ranking, self.objective, settings)
        self.n_trials = n_trials
        self._independent = independent_sampler or RandomSampler(seed=seed)
        self._said: dict[int, dict[str, Any]] = {}  # trial number -> why the guide proposed its config
        self._distributions = space.distributions()
        self._params = ranking.enumeration.params
        self._by_params: dict[str, int] = {}
        # the last observations read, by the finished trials they were read from (a finished trial's
        # attributes never change: Optuna refuses to write them)
        self._observed: tuple[tuple[Any, ...], list[Observation]] | None = None
        self._cache: tuple[Any, tuple[Proposal | None, str]] | None = None

    @classmethod
    def from_spec(
        cls, spec: Any, *, space: Space | None = None, ranking: Ranking | None = None, **kwargs: Any
    ) -> "GuidedSampler":
        """The sampler for a spec (a :class:`~autotune.spec.schema.Spec` or the path of its YAML file),
        with the spec's ``search`` settings, seed and budget; the first objective guides. The
        space is enumerated and ranked with the simulator unless ``space``/``ranking`` are given
        (the study runner has them already)."""
        from .ranking import rank_space
        from ..spec.load import load_spec
        from ..spec.resolve import objectives_of, probe_context
        from .spec_settings import guide_settings

        if isinstance(spec, (str, Path)):
            spec = load_spec(Path(spec))
        space = space or Space(spec)
        objectives = objectives_of(spec)
        context = probe_context(spec)
        if ranking is None:
            ranking = rank_space(space.enumerate(), context, objectives)
        kwargs.setdefault("seed", spec.search.seed)
        kwargs.setdefault("n_trials", spec.search.n_trials)
        kwargs.setdefault("settings", guide_settings(spec, context))
        return cls(ranking, space, objectives[0], **kwargs)

    def proposal(self, number: int) -> dict[str, Any]:
        """Why the guide chose trial ``number``'s config, its prediction, and whether it is a
        deliberate re-measurement (empty for a trial the guide did not propose)."""
        return dict(self._said.get(number) or {})

    # ---- Optuna's sampler interface ------------------------------------------------------------
    def reseed_rng(self) -> None:
        self._independent.reseed_rng()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._distributions)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        self._check_single_objective(study)
        fixed = trial.system_attrs.get("fixed_params") or {}
        ours = [n for n in search_space if n in self._distributions and n not in fixed]
        params: dict[str, Any] = {}
        if ours:
            allowed = self._matching(fixed)
            proposal, _ = self._propose(study, current=trial.number, allowed=allowed)
            if proposal is not None:
                chosen = self.ranking.enumeration.params_of(proposal.index)
                params = {n: chosen[n] for n in ours if _contains(search_space[n], chosen[n])}
                said = {
                    "reason": proposal.reason,
                    "predicted": proposal.predicted,
                    "remeasure": proposal.remeasure,
                    "gamble": proposal.gamble,
                }
                self._said[trial.number] = said  # what autotune's loop reads (GuidedSampler.proposal)
                # for a plain Optuna objective, on the trial itself: a sampler hook gets a FrozenTrial,
                # and Optuna has no public setter for it
                study._storage.set_trial_system_attr(trial._trial_id, GUIDE_ATTR, said)
        for name, distribution in search_space.items():  # what the guide does not cover
            if name not in params and name not in fixed:
                params[name] = self._independent.sample_independent(study, trial, name, distribution)
        return params

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        self._check_single_objective(study)
        return self._independent.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._independent.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None) -> None:
        """A failed trial's error text becomes evidence (status, OOM byte counts), stored on it."""
        self._independent.after_trial(study, trial, state, values)
        if state != TrialState.FAIL or A.SOURCE in trial.user_attrs:
            return  # autotune's runner records its probes' failures and byte counts itself
        text = trial.user_attrs.get(A.REASON)
        if not isinstance(text, str) or not text:
            return
        from autotune.workers.protocol import classify_failure, oom_evidence

        status = trial.user_attrs.get(A.STATUS) or classify_failure(None, text)[0]
        outcome: dict[str, Any] = {"status": status}
        if status == "oom":
            evidence = oom_evidence(text)
            if evidence:
                outcome["oom"] = evidence
        # a sampler's after_trial gets a FrozenTrial: Optuna has no public setter for it
        study._storage.set_trial_system_attr(trial._trial_id, OUTCOME_ATTR, outcome)

    # ---- for objectives ---------------------------------------------------------------------------
    def suggest_config(self, trial: optuna.Trial) -> dict[str, Any]:
        """Suggest every parameter of the spec's space on ``trial`` and return the canonical config
        (derived values filled in) that a probe runs: the guide's choice, in an objective."""
        params = {}
        for name, distribution in self._distributions.items():
            if isinstance(distribution, optuna.distributions.IntDistribution):
                params[name] = trial.suggest_int(
                    name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
                )
            else:
                params[name] = trial.suggest_categorical(name, distribution.choices)
        resolved = self.space.resolve(params)
        if not resolved.valid:  # only when parameters were fixed to a combination the rules reject
            raise optuna.TrialPruned(f"rejected by the space's rules: {'; '.join(resolved.violations)}")
        return resolved.config

    # ---- stopping --------------------------------------------------------------------------------
    def stop_reason(self, study: Study) -> str | None:
        """Why no further trial is worth running (every config probed, none left that may fit,
        or none that can beat the best even optimistically); None while one is."""
        proposal, why = self._propose(study, current=None, allowed=None)
        return None if proposal is not None else why

    def stop_callback(self, study: Study, trial: FrozenTrial) -> None:
        """``study.optimize(..., callbacks=[sampler.stop_callback])``: stop when the guide would."""
        why = self.stop_reason(study)
        if why:
            optuna.logging.get_logger("autotune.guided_sampler").info("stopping the study: %s", why)
            study.stop()

    # ---- what the study says ---------------------------------------------------------------------
    def observations(self, trials: list[FrozenTrial]) -> list[Observation]:
        """Every finished probe of a config in the ranked space, as the guide sees it: autotune's
        own trial attributes where the runner wrote them, Optuna's state, values and the user
        attributes ``peak_memory_gib`` / ``step_time_s`` otherwise."""
        finished = [t for t in trials if t.state in _FINISHED]
        key = tuple((t._trial_id, t.number, t.datetime_complete) for t in finished)
        if self._observed is not None and self._observed[0] == key:
            return list(self._observed[1])
        out = self._read_observations(finished)
        self._observed = (key, out)
        return list(out)

    def _read_observations(self, trials: list[FrozenTrial]) -> list[Observation]:
        metric = self.objective[0]
        out = []
        for t in trials:
            status = _status(t)
            if status in _NOT_PROBES or t.user_attrs.get(A.SOURCE) == "rules":
                continue
            index = self._index_of(t)
            if index is None:
                continue
            ua = t.user_attrs
            # only a measurement that counts teaches times and peaks (a crash's metrics may be nonsense)
            metrics = (ua.get(A.METRICS) or {}) if status in RAN else {}
            objective = metrics.get(metric)
            if not _finite(objective) and status == "ok" and t.values:
                objective = t.values[0]
            measured = status in RAN
            step = metrics.get("step_time_s", ua.get("step_time_s")) if measured else None
            peak = metrics.get("peak_memory_gib", ua.get("peak_memory_gib")) if measured else None
            counts = str((ua.get(A.INFO) or {}).get(PEAK_COUNTS_KEY) or ua.get(PEAK_COUNTS_KEY) or "device")
            profile = ua.get(A.MEMORY_PROFILE) or {}
            profile_peak, profile_sd = profile.get("peak_gib"), profile.get("sd_gib")
            if not _finite(peak) and _finite(profile_peak):
                counts = str(profile.get("counts") or counts)
            reports_usable = _finite((ua.get(A.INFO) or {}).get(USABLE_KEY))
            if (counts == "allocated" or reports_usable) and _finite(metrics.get("peak_reserved_gib")):
                # the allocator's reserve counts its fragmentation too: the closer figure to the device's.
                # Where the probe reports what its allocator could use, its reserved peak is what that is
                # compared with, even beside a device peak: the usable memory on the device's scale adds
                # the model's guess of what the runtime and the communicators hold outside the allocator,
                # which cancels only against a peak counted the same way (a device peak put a runtime
                # that held 5.9 GiB at the model's 3: every config near the wall predicted over it, the
                # optimum of a 7B 8x32 world of benchmarks/search_efficiency.py --path lab included)
                peak, counts = metrics["peak_reserved_gib"], "reserved"
            evidence = (
                ((ua.get(A.INFO) or {}).get("oom") or (t.system_attrs.get(OUTCOME_ATTR) or {}).get("oom") or {})
                if status == "oom"
                else {}
            )
            needed, requested = evidence.get("needed_at_least"), evidence.get("requested")
            in_use = needed - requested if _finite(needed) and _finite(requested) else None
            # a pool the framework took at start (MindSpore's): what its allocator could use (a probe's
            # USABLE_KEY); the message's need counts within it (``Observation.oom_counts``)
            pool = evidence.get("allocator_usable")
            pool = float(pool) if _finite(pool) and float(pool) > 0 else None
            out.append(
                Observation(
                    index=index,
                    status=status,
                    number=t.number,
                    objective=float(objective) if _finite(objective) else None,
                    step_time_s=float(step) if _finite(step) else None,
                    peak_memory_gib=float(peak) if _finite(peak) else None,
                    oom_needed_gib=float(needed) if _finite(needed) else None,
                    oom_in_use_gib=in_use,
                    peak_counts=counts,
                    profile_peak_gib=float(profile_peak) if _finite(profile_peak) else None,
                    profile_sd_gib=float(profile_sd) if _finite(profile_sd) else None,
                    usable_gib=pool if status == "oom" else _usable(ua, profile) if status != "crash" else None,
                    profile_p_fit=float(profile["p_fit"]) if _finite(profile.get("p_fit")) else None,
                    stated_p_fit=_stated_p_fit(ua, profile, status),
                    reading_noise=step_reading_noise(metrics, metric) if status == "ok" else None,
                    profile_steps=_profile_steps(profile),
                )
            )
        return self.guide.with_interference(out)

    def estimates(self, trials: list[FrozenTrial]) -> dict[str, tuple[float, float, int]]:
        """The guide's estimate of the first objective of every measured config: ``{config key:
        (mean, sd, measurements)}``. It pools every measurement of the study (configs that share
        parameter values inform each other), so a config measured once and high by the noise
        does not outrank one the evidence as a whole says is faster: the best a study reports
        (``records.best_records``) is the measured config with the best estimate. Its sd is never
        below the standard error of the config's own readings at the study's noise: the model's band
        is about the mean it predicts, and a figure measured n times is not surer than n readings."""
        obs = self.observations(trials)
        values = readings_of(obs)
        if not values:
            return {}
        mean, sd = self.guide._objective_model(obs)
        # never narrower than the noise its readings carry (issue 44): the standard error of their mean
        noise = self.guide._noise(values, self.guide.noise_floor(obs))
        configs = self.ranking.enumeration.configs
        return {
            config_key(configs[i]): (
                float(mean[i]),
                max(float(sd[i]), noise * abs(float(mean[i])) / len(v) ** 0.5),
                len(v),
            )
            for i, v in values.items()
            if _finite(float(mean[i])) and _finite(float(sd[i]))
        }

    def claims(self, trials: list[FrozenTrial]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
        """The model's part of the certificate, by config key, once the search ends: P(no config not
        measured beats it by more than the tie tolerance) for every measured config
        (:meth:`Guide.unmeasured_claims`), and what the model predicts of each measured config from
        the others (:meth:`Guide.measured_priors`), both read through one check of the model
        against the study's readings (:meth:`Guide.leave_one_out`)."""
        configs = self.ranking.enumeration.configs
        obs = self.observations(trials)
        loo = self.guide.leave_one_out(obs)
        unmeasured = {config_key(configs[i]): p for i, p in self.guide.unmeasured_claims(obs, loo).items()}
        priors = {config_key(configs[i]): v for i, v in self.guide.measured_priors(obs, loo).items()}
        return unmeasured, priors

    def _propose(self, study: Study, current: int | None, allowed: np.ndarray | None) -> tuple[Proposal | None, str]:
        trials = study.get_trials(deepcopy=False)
        others = [t for t in trials if t.number != current]
        state = tuple((t.number, t.state) for t in others)
        if allowed is None and self._cache is not None and self._cache[0] == state:
            return self._cache[1]
        obs = self.observations(others)
        running = [i for t in others if t.state == TrialState.RUNNING and (i := self._index_of(t)) is not None]
        answer = self.guide.propose(
            obs, exclude=running, best=self._best(obs), budget_left=self._budget_left(others), allowed=allowed
        )
        if allowed is None:
            self._cache = (state, answer)
        return answer

    def _best(self, obs: list[Observation]) -> float | None:
        """The best measured value, a config measured twice judged on its mean (as the report does)."""
        values = readings_of(obs)
        if not values:
            return None
        means = [float(np.mean(v)) for v in values.values()]
        return max(means) if self.objective[1] == "maximize" else min(means)

    def _budget_left(self, trials: list[FrozenTrial]) -> int | None:
        """Full probes left: the budget less the full-probe equivalents spent (a memory profile
        costs its share of a full probe, :func:`autotune.guide.memory_profile.cost_of_trials`)."""
        if self.n_trials is None:
            return None
        spent = cost_of_trials(
            t.user_attrs
            for t in trials
            if t.state in (*_FINISHED, TrialState.RUNNING)
            and _status(t) not in ("duplicate", "interrupted", "infra")
            and t.user_attrs.get(A.SOURCE) != "rules"
        )
        return int(math.floor(self.n_trials - spent + 1e-9))

    def oom_allowance_spent(self, study: Study) -> bool:
        """Whether the study has had the OOM probes it may risk (:meth:`Guide.oom_allowance_spent`)."""
        trials = study.get_trials(deepcopy=False)
        obs = self.observations(trials)
        ooms = sum(1 for o in obs if o.status == "oom")
        return self.guide.oom_allowance_spent(ooms, len(obs), self._budget_left(trials))

    def fit_after_profile(
        self, study: Study, number: int, peak_gib: float, sd_gib: float, counts: str, usable_gib: float | None = None
    ) -> tuple[float, float, float]:
        """(P(fits), device peak, usable GiB) of trial ``number``'s config from its memory profile,
        given everything else the study measured (:meth:`Guide.fit_after_profile`)."""
        trials = study.get_trials(deepcopy=False)
        target = next(t for t in trials if t.number == number)
        index = self._index_of(target)
        if index is None:
            raise ValueError(f"trial {number}'s config is not in the ranked space")
        obs = self.observations([t for t in trials if t.number != number])
        return self.guide.fit_after_profile(obs, index, peak_gib, sd_gib, counts, usable_gib)

    def profile_cost_measured(self, cost: float) -> None:
        """A memory profile cost ``cost`` full-probe equivalents: the guide weighs the next one
        halfway between what it assumed and this (``GuideSettings.profile_cost``)."""
        settings = self.guide.settings
        self.guide.settings = replace(settings, profile_cost=0.5 * (settings.profile_cost + cost))

    def _index_of(self, trial: FrozenTrial) -> int | None:
        """The ranking row of a trial's config: from autotune's config attribute, else its params."""
        config = trial.user_attrs.get(A.CONFIG)
        if config:
            return self.ranking.index_of(config_key(config))
        params = {n: trial.params[n] for n in self._distributions if n in trial.params}
        if len(params) < len(self._distributions):
            return None  # not a config of this space (yet): nothing to learn from
        key = config_key(params)
        if key not in self._by_params:
            resolved = self.space.resolve(params)
            index = self.ranking.index_of(resolved.key) if resolved.valid else None
            self._by_params[key] = -1 if index is None else index
        index = self._by_params[key]
        return None if index < 0 else index

    def _matching(self, fixed: dict[str, Any]) -> np.ndarray | None:
        """Rows whose searched parameters equal the trial's fixed ones (None: no constraint)."""
        names = [n for n in fixed if n in self._params]
        if not names:
            return None
        mask = np.ones(len(self.ranking.enumeration.configs), dtype=bool)
        for name in names:
            column = self._params[name]
            mask &= np.array([v == fixed[name] for v in column.tolist()], dtype=bool)
        return mask

    def _check_single_objective(self, study: Study) -> None:
        if len(study.directions) != 1:
            raise ValueError(
                "GuidedSampler guides single-objective studies; with several objectives use "
                "optuna's NSGAIISampler or TPESampler"
            )
        direction = "maximize" if study.direction == StudyDirection.MAXIMIZE else "minimize"
        if direction != self.objective[1]:
            raise ValueError(
                f"the study is created to {direction} but the guide's objective "
                f"{self.objective[0]!r} is to {self.objective[1]}"
            )


def _usable(ua: dict[str, Any], profile: dict[str, Any]) -> float | None:
    """What the trial's probe (or its memory profile) reported its allocator could use."""
    for value in ((ua.get(A.INFO) or {}).get(USABLE_KEY), profile.get("usable_reported_gib")):
        if _finite(value) and float(value) > 0:
            return float(value)
    return None


def _status(trial: FrozenTrial) -> str:
    status = trial.user_attrs.get(A.STATUS)
    if isinstance(status, str):
        return status
    outcome = trial.system_attrs.get(OUTCOME_ATTR)
    if isinstance(outcome, dict) and outcome.get("status"):
        return str(outcome["status"])
    constraints = trial.system_attrs.get("constraints")
    if trial.state == TrialState.COMPLETE:
        return "infeasible" if constraints and any(c > 0 for c in constraints) else "ok"
    return {TrialState.PRUNED: "pruned", TrialState.RUNNING: "running"}.get(trial.state, "error")


def _contains(distribution: BaseDistribution, value: Any) -> bool:
    try:
        return bool(distribution._contains(distribution.to_internal_repr(value)))
    except (ValueError, TypeError):
        return False


def _stated_p_fit(ua: dict[str, Any], profile: dict[str, Any], status: str) -> float | None:
    """The P(fits) a full probe ran at: its memory profile's verdict where one sent it on, else the
    guide's when it chose the config; None for a probe that never ran in full (a profile that said
    no) or one the guide did not choose."""
    if status == "oom_predicted":
        return None
    if _finite(profile.get("p_fit")):
        return float(profile["p_fit"])
    stated = (ua.get(A.PREDICTED) or {}).get("guided_p_fit")
    return float(stated) if _finite(stated) else None


def _profile_steps(profile: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """The step times a trial's memory profiles measured, ((layers per stage, seconds), ...), from
    its ``memory_profile`` record; a malformed entry is left out, not guessed at."""
    out = []
    for layers, step in (profile.get("step_times_s") or {}).items():
        try:
            k = int(float(layers))
        except (TypeError, ValueError):
            continue
        if k >= 1 and _finite(step) and float(step) > 0:
            out.append((k, float(step)))
    return tuple(sorted(out))
