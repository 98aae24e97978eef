"""The search loop: an Optuna study driven by ask/tell, feeding trials to a dispatcher.

Why ask/tell rather than ``study.optimize``: trials run as separate processes on remote devices,
several at once, and a failure (OOM, timeout) is information for the sampler, not an exception.

Guarantees, all backed by Optuna storage (a journal file in the run directory by default):

- **Resumable.** ``load_if_exists``; trials a killed run left RUNNING are marked FAIL
  (``autotune.status = interrupted``) and their configs re-queued, so the budget completes with no
  trial lost.
- **No config probed twice.** Every proposal is resolved to its canonical form
  (:mod:`autotune.space`); a repeat is answered from the earlier result without a probe.
- **Infeasibility reaches the sampler.** Configs rejected by the rules, and OOM / invalid / NaN
  results, complete with ``trial.set_constraint("feasible", > 0)`` (Optuna 5), so constraint-aware
  samplers learn the infeasible region instead of seeing silent FAIL trials.
- **Simulated is never measured.** Each trial carries ``autotune.source``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from autotune.workers.protocol import ProbeResult, TrialRequest

from .backends import BackendChoice, launch_for, least_trial_devices, trial_devices, trial_placement
from .context import ProbeContext, probe_context
from .guided_sampler import GUIDE_ATTR, GuidedSampler
from .trial_attrs import A
from .ranking import Ranking, rank_space
from .records import (TrialRecord, best_records, frozen_trial, guide_estimates, is_tracked, trial_record,
                      trial_records)
from .sanity import is_finite_number as _finite
from .interpret import interpret, measured_step_times, penalty, settle_pruned
from .listeners import GuideEstimatesListener, RefitListener, ResultCacheListener, TrialListener
from .refit import Refit
from .study_result import StudyResult
from .study_tracking import StudyTracking
from .secret_env import masked_backend, scrub, secret_values
from .space import Space, config_key
from .spec import Spec
from .importance import record_importances
from .ranking import UNDISTINGUISHED
from .storage import open_study, study_storage
from .study_definition import record_definition

__all__ = ["StudyRunner", "SearchObserver", "StudyOutcome", "Unplaceable", "open_study", "study_storage", "make_sampler",
           "A"]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ sampler
def make_sampler(spec: Spec, space: Space, n_objectives: int, parallel: int,
                 resumed_at: int = 0) -> optuna.samplers.BaseSampler:
    """The spec's sampler. A resumed study (``resumed_at`` trials already in it) gets a seed
    derived from the spec's and that count: with the spec's own seed a seeded sampler would
    replay its earlier proposals, all measured already, and probe nothing new."""
    name = spec.search.sampler
    seed = spec.search.seed
    if seed is not None and resumed_at:
        seed = (seed * 1_000_003 + resumed_at) % 2**32
    if name in ("auto", "tpe"):
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=parallel > 1,
                                          n_startup_trials=min(10, max(3, spec.search.n_trials // 4)))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "gp":
        try:
            return optuna.samplers.GPSampler(seed=seed)
        except ImportError as exc:  # GPSampler needs torch
            raise ValueError(f"sampler 'gp' needs torch installed ({exc})") from None
    if name == "grid":
        return optuna.samplers.GridSampler(space.choices, seed=seed)
    if name == "exhaustive":
        return optuna.samplers.BruteForceSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}")


# ------------------------------------------------------------------------------------ observer
class SearchObserver(Protocol):
    """What the loop tells the user interface (a rich progress bar in the CLI, nothing in tests)."""

    def on_start(self, budget: int, done: int) -> None: ...
    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None: ...
    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None: ...
    def on_message(self, text: str) -> None: ...


class _Quiet:
    def on_start(self, budget: int, done: int) -> None: ...
    def on_trial_started(self, number: int, config: dict[str, Any], why: str) -> None: ...
    def on_trial_finished(self, record: TrialRecord, best: TrialRecord | None, running: int) -> None: ...
    def on_message(self, text: str) -> None:
        log.info(text)


@dataclass
class StudyOutcome:
    study: optuna.Study
    result: StudyResult
    ranking: Ranking | None
    probes_run: int
    stopped_because: str
    parent_run_id: str | None = None
    infra_failure: str | None = None  # the study stopped because the infrastructure failed (exit 3)

    @property
    def records(self) -> list[TrialRecord]:
        return self.result.records

    @property
    def best(self) -> list[TrialRecord]:
        return self.result.best

    @property
    def baseline(self) -> TrialRecord | None:
        return self.result.baseline


class Unplaceable(RuntimeError):
    """No trial of the study can ever be placed on the cluster: refused before the first trial."""


# ---------------------------------------------------------------------------------------- runner
class StudyRunner:
    """Runs one study to its budget. ``tracker`` may be None (tests, ``--no-tracking``)."""

    def __init__(self, spec: Spec, run_dir: Path, backend: BackendChoice, *, tracker: Any = None,
                 observer: SearchObserver | None = None, dispatcher: Any = None, cache: Any = None,
                 reuse_cache: bool = False, stop_requested: Any = None, definition: dict[str, Any] | None = None):
        self.spec = spec
        self.definition = definition  # what defines the study (study_definition), kept on it when created
        # a signal whose handler's exception Python swallowed (raised inside a garbage-collection
        # callback, "Exception ignored in ...") still stops the loop: the CLI's flag, checked here
        self.stop_requested = stop_requested or (lambda: False)
        self.run_dir = run_dir
        self.backend = backend
        self.tracker = tracker
        self.observer = observer or _Quiet()
        self.space = Space(spec)
        self.context: ProbeContext = probe_context(spec)
        self.objectives = spec.objective_list()
        self.parallel = 1 if backend.simulated else spec.search.parallel_trials
        self._dispatcher = dispatcher
        # real probes' results kept across studies (autotune.cache); read only with reuse_cache
        self.cache = None if backend.simulated else cache
        self.reuse_cache = reuse_cache
        self.ranking: Ranking | None = None
        # what observes each finished trial, in this order: MLflow, the model's refit, the guide
        self.tracking = (StudyTracking(tracker, spec, backend, run_dir, parallel=self.parallel, space_size=self.space.size)
                         if tracker else None)
        self.refits = RefitListener(bool(self.context.hardware.get("calibrated_at")), on_moved=self._say_refit,
                                    on_refit=self.tracking.log_refit if self.tracking else None)
        self.listeners: list[TrialListener] = [x for x in (self.tracking, self.refits) if x is not None]
        self.cache_writer = ResultCacheListener(self.cache, self._cache_key, spec.name) if self.cache is not None else None
        self._live_steps: dict[int, list[dict[str, Any]]] = {}  # step events of running trials
        self._prune_reasons: dict[int, str] = {}  # trials being stopped early, and why
        self.guided: GuidedSampler | None = None  # sampler auto on real probes: model-guided proposals
        self.infra_failure: str | None = None  # set when the cluster lost capacity (or failed trials in a row)
        self._secrets = secret_values(spec.model_dump(mode="json"))  # scrubbed from what a probe printed

    # ---- set-up ------------------------------------------------------------------------------
    def _dispatcher_for(self) -> Any:
        if self._dispatcher is not None:
            return self._dispatcher
        from . import dispatch

        if self.backend.simulated:
            from autotune.workers.simulate import simulate_trial

            self._dispatcher = dispatch.InProcessDispatcher(simulate_trial)
        elif not self.spec.ray.enabled:
            self._dispatcher = dispatch.LocalProcessDispatcher(max_parallel=self.parallel)
        else:
            self._dispatcher = dispatch.RayDispatcher(address=self.spec.ray.address, num_cpus=self.spec.ray.num_cpus,
                                                      resources=None, run_dir=self.run_dir)
        return self._dispatcher

    def _rank(self) -> Ranking | None:
        """Whole-space simulator ranking when the space is small enough to enumerate."""
        if self.space.size > self.spec.search.exhaustive_limit:
            self.observer.on_message(f"space of {self.space.size:,} combinations is above the exhaustive limit "
                                     f"({self.spec.search.exhaustive_limit:,}): sampling instead of ranking")
            return None
        started = time.perf_counter()
        self.observer.on_message(f"ranking the space with the simulator ({self.space.size:,} combinations)")
        enumeration = self.space.enumerate()
        ranking = rank_space(enumeration, self.context, self.objectives)
        ranking.write_csv(self.run_dir / "ranking.csv")
        self.observer.on_message(f"ranked {enumeration.valid:,} valid configs, {ranking.fit:,} predicted to fit "
                                 f"({time.perf_counter() - started:.1f} s)")
        self.ranking = ranking
        return ranking

    def _recover(self, study: optuna.Study) -> int:
        """Mark trials left RUNNING by a killed run as failed and re-queue their configs.

        A trial is re-queued when its whole config is known (it was resolved, or queued from the
        plan); one killed while Optuna was still writing its proposal, param by param, has only
        some params and no probe behind it: it is closed and the sampler proposes afresh."""
        requeued = 0
        storage = study._storage
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            config = t.user_attrs.get(A.CONFIG)
            storage.set_trial_user_attr(t._trial_id, A.STATUS, "interrupted")
            storage.set_trial_user_attr(t._trial_id, A.REASON, "the run was killed while this trial was running"
                                        + ("; re-queued" if config else " (before its probe started)"))
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            if not config:
                continue
            attrs = {k: v for k, v in t.user_attrs.items() if k in (A.CONFIG, A.KEY, A.CHOSEN, A.BASELINE, A.PREDICTED)}
            attrs[A.REQUEUED_FROM] = t.number
            study.enqueue_trial(self._params_for(config), user_attrs=attrs, skip_if_exists=False)
            requeued += 1
        if requeued:
            self.observer.on_message(f"resuming: {requeued} trial(s) interrupted by the previous run re-queued")
        return requeued

    def _enqueue_plan(self, study: optuna.Study, ranking: Ranking | None, budget_left: int) -> None:
        """Queue the baseline and, for ``sampler: auto``, the simulator's best bets.

        A resumed study already holds its plan (waiting trials) and gets no second one."""
        trials = study.get_trials(deepcopy=False)
        if any(t.state == TrialState.WAITING for t in trials):
            return
        already = {t.user_attrs.get(A.KEY) for t in trials}
        if self.spec.baseline and not any(t.user_attrs.get(A.BASELINE) for t in trials):
            params = self._params_for(self.spec.baseline)
            resolved = self.space.resolve({**params, **self.spec.baseline})
            study.enqueue_trial(params, user_attrs={A.BASELINE: True, A.CONFIG: resolved.config, A.KEY: resolved.key,
                                                     A.CHOSEN: "baseline from the spec"})
            already.add(resolved.key)
            budget_left -= 1
        if self.spec.search.sampler != "auto" or ranking is None or budget_left <= 0 or self.guided is not None:
            return  # the guide proposes one config at a time, from what was measured
        # simulate: the top n configs are the study; real probes without a guide (several
        # objectives): the top half, then the sampler
        # one config per layout the model can tell apart: 20 trials are 20 layouts, not one
        # layout with 20 allocator settings the model prices the same
        k = budget_left if self.backend.simulated else max(1, math.ceil(budget_left / 2))
        queued = 0
        for layout in ranking.distinct_layouts():
            config, metrics = ranking.enumeration.configs[layout.index], ranking.metrics_of(layout.index)
            key = config_key(config)
            if key in already or any(config_key(ranking.enumeration.configs[j]) in already for j in layout.members):
                continue
            why = f"rank {layout.rank} by model"
            if layout.undistinguished:
                why += f"; {UNDISTINGUISHED}{layout.undistinguished_text()}"
            study.enqueue_trial(self._params_for(config), user_attrs={
                A.CONFIG: config, A.KEY: key, A.PREDICTED: _predicted(metrics, self.objectives), A.CHOSEN: why,
            })
            already.add(key)
            queued += 1
            if queued >= k:
                break

    def _params_for(self, config: dict[str, Any]) -> dict[str, Any]:
        """The Optuna params (searched names only) of a config; unsearched names stay in the config."""
        params = {}
        for name, values in self.space.choices.items():
            if name in config and config[name] in values:
                params[name] = config[name]
            else:
                params[name] = values[0]
        return params

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> StudyOutcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ranking = self._rank() if (self.spec.search.sampler == "auto") else None
        if ranking is not None and not self.backend.simulated and len(self.objectives) == 1 and ranking.order.size:
            self.guided = GuidedSampler.from_spec(self.spec, space=self.space, ranking=ranking)
        sampler = self.guided or make_sampler(self.spec, self.space, len(self.objectives), self.parallel)
        study = open_study(self.spec, self.run_dir, sampler)
        if self.definition is not None:
            record_definition(study, self.definition)
        existing = len(study.get_trials(deepcopy=False))
        if existing and self.guided is None:  # resumed: continue the sampler's sequence, not replay it
            study.sampler = make_sampler(self.spec, self.space, len(self.objectives), self.parallel, resumed_at=existing)
        self._recover(study)
        records = trial_records(study)
        probes_done = sum(1 for r in records if is_tracked(r) and r.status != "infra")
        budget = self.spec.search.n_trials
        self._enqueue_plan(study, ranking, budget - probes_done)
        if self.guided is not None:
            self.listeners.append(GuideEstimatesListener(self.guided))
        if self.tracking:
            self.tracking.start(study, ranking)
            self.tracking.reconcile(study)
        for listener in self.listeners:
            listener.study_started(study)
        self.observer.on_start(budget, probes_done)

        seen: dict[str, int] = {}
        for t in study.get_trials(deepcopy=False):
            key = t.user_attrs.get(A.KEY)
            # a config whose probe was interrupted or failed under it on the infrastructure is not
            # measured: its re-queued trial must run, not be called a duplicate
            if key and t.user_attrs.get(A.PROBED) and t.user_attrs.get(A.STATUS) not in ("interrupted", "infra"):
                seen.setdefault(key, t.number)
        distributions = self.space.distributions()
        total_valid = self._valid_count(ranking)
        dispatcher = self._dispatcher_for()
        if not self.backend.simulated:
            self._check_placeable(dispatcher)
        pending: dict[Any, tuple[optuna.Trial, dict[str, Any]]] = {}
        started = probes_done
        misses = 0
        deadline = time.monotonic() + self.spec.search.timeout_s if self.spec.search.timeout_s else None
        stopped = "budget reached"
        infra_in_a_row = 0
        try:
            while True:
                if self.stop_requested():
                    raise KeyboardInterrupt
                if self.infra_failure and not pending:
                    stopped = self.infra_failure
                    break
                if infra_in_a_row >= MAX_INFRA_IN_A_ROW and not pending:
                    stopped = self.infra_failure = (
                        f"the infrastructure failed {infra_in_a_row} trials in a row (see their reasons): fix the "
                        "cluster and run the same command to resume")
                    break
                while len(pending) < self.parallel and started < budget and infra_in_a_row < MAX_INFRA_IN_A_ROW \
                        and not self.infra_failure:
                    if deadline and time.monotonic() > deadline:
                        stopped = "search timeout reached"
                        break
                    if total_valid is not None and len(seen) >= total_valid:
                        stopped = f"every valid config of the space ({total_valid}) has been probed"
                        break
                    if misses >= 200:
                        stopped = "the sampler proposed only rejected or already measured configs 200 times in a row"
                        break
                    if self.guided is not None and not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                        why_stop = self.guided.stop_reason(study)
                        if why_stop:
                            stopped = f"stopped early: {why_stop}"
                            break
                    trial = study.ask(distributions)
                    handled = self._pre_dispatch(study, trial, seen)
                    if handled is None:
                        misses += 1
                        continue
                    misses = 0
                    config, why = handled
                    cached = None if A.REMEASURE_OF in trial.user_attrs else self._from_cache(config)
                    if cached is not None:  # measured before, in this or another study: no probe
                        result, origin = cached
                        trial.set_user_attr(A.PROBED, True)
                        trial.set_user_attr(A.CHOSEN, f"{why}; answered from the result cache (study "
                                                      f"{origin['study']}, trial {origin['trial']})")
                        seen[config_key(config)] = trial.number
                        started += 1
                        record = self._finish(study, trial, config, result)
                        self.observer.on_trial_finished(record, self._best_single(study), len(pending))
                        continue
                    request = TrialRequest(params=config, model=self.context.model, workload=self.context.workload,
                                           cluster=self.context.cluster, study=self.spec.name, number=trial.number,
                                           backend=masked_backend(self.spec.backend.model_dump()))
                    launch = None if self.backend.simulated else launch_for(self.spec, self.backend, request)
                    trial.set_user_attr(A.PROBED, True)
                    seen[config_key(config)] = trial.number
                    self.observer.on_trial_started(trial.number, config, why)
                    handle = dispatcher.submit(request, launch)
                    pending[handle] = (trial, config)
                    started += 1
                if not pending:
                    if started >= budget:
                        stopped = "budget reached"
                    break
                for handle, result in dispatcher.wait_any(timeout=0.25):
                    trial, config = pending.pop(handle)
                    record = self._finish(study, trial, config, result)
                    if record.status == "infra":  # the machine failed, not the config: no budget spent,
                        started -= 1              # and its retry (queued by _finish) is no repeat
                        infra_in_a_row += 1
                        if seen.get(config_key(config)) == trial.number:
                            del seen[config_key(config)]
                    else:
                        infra_in_a_row = 0
                    self.observer.on_trial_finished(record, self._best_single(study), len(pending))
                    if self.stop_requested():
                        raise KeyboardInterrupt
                self._prune_losers(study, dispatcher, pending)
        except KeyboardInterrupt:
            stopped = "interrupted by the user"
            for handle in list(pending):
                dispatcher.cancel(handle)
            raise
        # once, for every output (report, MLflow, plots): the model's over the whole feasible space
        # when the trials are its predictions, fANOVA over the measured trials otherwise
        record_importances(study, self.objectives, ranking if self.backend.simulated else None)
        return StudyOutcome(study, StudyResult.load(self.spec, study), ranking, started, stopped,
                            parent_run_id=self.tracking.parent_run_id if self.tracking else None,
                            infra_failure=self.infra_failure)

    def _check_placeable(self, dispatcher: Any) -> None:
        """Refuse a study no trial of which the cluster can ever place, before its first trial
        (every one would be ``invalid`` and the budget spent on nothing)."""
        devices = least_trial_devices(self.spec)
        placement = trial_placement(self.spec, devices)
        problem = dispatcher.placement_problem(**placement)
        if problem is not None:
            spread = f" over {placement['nodes']} nodes" if placement["nodes"] > 1 else ""
            raise Unplaceable(f"no trial of this study can be placed on the Ray cluster: {problem[1]}. Each trial needs "
                              f"{devices} {self.spec.cluster.accelerator} device(s){spread} (the spec's cluster "
                              "section): start the nodes it needs, or change the spec's cluster")

    def _valid_count(self, ranking: Ranking | None) -> int | None:
        """Number of valid canonical configs, when the space is small enough to count."""
        if ranking is not None:
            return ranking.enumeration.valid
        if self.space.size <= min(self.spec.search.exhaustive_limit, 200_000):
            return self.space.enumerate().valid
        return None

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.shutdown()

    def _pre_dispatch(self, study: optuna.Study, trial: optuna.Trial, seen: dict[str, int]) -> tuple[dict, str] | None:
        """Resolve a proposal; answer rule violations and repeats without a probe."""
        ua = trial.user_attrs
        config = ua.get(A.CONFIG)
        if config is None:
            resolved = self.space.resolve(dict(trial.params))
            if not resolved.valid:
                trial.set_user_attr(A.CONFIG, resolved.config)
                trial.set_user_attr(A.STATUS, "invalid")
                reason = "; ".join(resolved.violations)
                trial.set_user_attr(A.REASON, f"rejected by rules: {reason}")
                trial.set_user_attr(A.SOURCE, "rules")
                trial.set_constraint("feasible", float(len(resolved.violations)))
                _tell(study, trial, penalty(self.objectives))
                return None
            config = resolved.config
            trial.set_user_attr(A.CONFIG, config)
            trial.set_user_attr(A.KEY, resolved.key)
            guided = study._storage.get_trial(trial._trial_id).system_attrs.get(GUIDE_ATTR) or {}
            if guided.get("predicted"):
                trial.set_user_attr(A.PREDICTED, {**self._prediction(config), **guided["predicted"]})
            if guided.get("remeasure") and resolved.key in seen:
                trial.set_user_attr(A.REMEASURE_OF, seen[resolved.key])
            why = guided.get("reason") or ua.get(A.CHOSEN) or f"proposed by the {type(study.sampler).__name__}"
            ua = trial.user_attrs
        else:
            why = ua.get(A.CHOSEN, "queued")
        key = config_key(config)
        if key in seen and A.REMEASURE_OF not in ua:
            original = frozen_trial(study, seen[key])
            trial.set_user_attr(A.DUPLICATE_OF, seen[key])
            trial.set_user_attr(A.STATUS, "duplicate")
            trial.set_user_attr(A.REASON, f"same canonical config as trial {seen[key]}; not probed again")
            if original is not None and original.state == TrialState.COMPLETE and original.values:
                for name, value in original.constraints.items():
                    trial.set_constraint(name, value)
                _tell(study, trial, list(original.values))
            else:
                _tell(study, trial, state=TrialState.FAIL)
            return None
        if not ua.get(A.CHOSEN):
            trial.set_user_attr(A.CHOSEN, why)
        if not self.backend.simulated:  # predicted next to measured, for every probe, with the latest refit
            predicted = dict(ua.get(A.PREDICTED) or self._prediction(config))
            predicted.update(self.refits.refit.apply(predicted))  # beside the raw prediction, never instead
            trial.set_user_attr(A.PREDICTED, predicted)
        return config, why

    # ---- early stopping ---------------------------------------------------------------------------
    _STEP_OBJECTIVES = ("tokens_per_s_per_device", "tokens_per_s", "samples_per_s", "step_time_s")

    def _prune_losers(self, study: optuna.Study, dispatcher: Any, pending: dict[Any, tuple[Any, dict]]) -> None:
        """Stop running probes that are confidently slower than the best measured trial.

        Every trial of a study has the same global batch and world size, so its throughput is
        inversely proportional to its step time: a probe whose median measured step time (at
        least ``prune_min_steps`` steps) exceeds the best trial's step time by more than
        ``prune_margin`` (50 % by default: above the +-30 % run-to-run noise measured on these
        machines) cannot win, and is killed. It is recorded as ``pruned`` with the steps it made."""
        events = dispatcher.step_events()
        for number, event in events:
            self._live_steps.setdefault(number, []).append(event)
        spec = self.spec.search
        if (not events or not spec.prune or self.backend.simulated or len(self.objectives) != 1
                or self.objectives[0][0] not in self._STEP_OBJECTIVES or not pending):
            return
        best = self._best_single(study)
        best_step = best.metrics.get("step_time_s") if best else None
        if not _finite(best_step) or best_step <= 0:
            return
        for handle, (trial, _) in pending.items():
            if trial.number in self._prune_reasons:
                continue
            times = measured_step_times(self._live_steps.get(trial.number, []))
            if len(times) < spec.prune_min_steps:
                continue
            median = statistics.median(times)
            if median > best_step * (1 + spec.prune_margin):
                self._prune_reasons[trial.number] = (
                    f"stopped early after {len(times)} measured steps: median step {median:.4g} s is "
                    f"{median / best_step:.2f}x the best's {best_step:.4g} s (trial {best.number}); "
                    f"margin {spec.prune_margin:.0%}")
                dispatcher.cancel(handle)

    # ---- result cache ------------------------------------------------------------------------------
    def _cache_key(self, config: dict[str, Any]) -> str:
        from .cache import cache_key

        c = self.context
        return cache_key(config_key(config), c.model, c.workload, c.cluster, masked_backend(self.spec.backend.model_dump()))

    def _from_cache(self, config: dict[str, Any]) -> tuple[ProbeResult, dict[str, Any]] | None:
        if self.cache is None or not self.reuse_cache:
            return None
        hit = self.cache.get(self._cache_key(config))
        if hit is None:
            return None
        result, origin = hit
        result.info = {**result.info, "cached_from": origin}
        return result, origin

    @property
    def refit(self) -> Refit:
        """The model's current refit (what later predictions carry as ``refit_*``)."""
        return self.refits.refit

    def _say_refit(self, refit: Refit, after: int) -> None:
        self.observer.on_message(f"refit after trial {after} ({refit.n} measured): {refit.describe()}; "
                                 f"model error {refit.mape_before:.0f} % -> {refit.mape_after:.0f} %")

    def _prediction(self, config: dict[str, Any]) -> dict[str, float]:
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
        return _predicted(raw, self.objectives)

    def _finish(self, study: optuna.Study, trial: optuna.Trial, config: dict[str, Any], result: ProbeResult) -> TrialRecord:
        """interpret -> record -> tell -> notify, for one finished trial."""
        if self._secrets:  # a probe that printed its environment: no token into any file, MLflow or the cache
            result.log_tail, result.reason = scrub(result.log_tail, self._secrets), scrub(result.reason, self._secrets)
            result.info = _scrub_values(result.info, self._secrets)
        settle_pruned(result, self._live_steps.pop(trial.number, []), self._prune_reasons.pop(trial.number, None))
        if self.cache_writer is not None:
            self.cache_writer.probe_returned(trial.number, config, result)
        meaning = interpret(config, result, self.context, self.objectives, trial_devices(self.spec, config))
        result.status, result.reason = meaning.probe_status, meaning.probe_reason
        for name, value in ((A.STATUS, result.status), (A.SOURCE, result.source), (A.METRICS, meaning.metrics),
                            (A.WALL, round(result.wall_s, 3))):
            trial.set_user_attr(name, value)
        if result.reason:
            trial.set_user_attr(A.REASON, result.reason[:2000])
        if result.info:
            trial.set_user_attr(A.INFO, _jsonable(result.info))
        self._save_trial_files(trial.number, config, result)
        if meaning.status != result.status:
            trial.set_user_attr(A.STATUS, meaning.status)
            trial.set_user_attr(A.REASON, meaning.reason)
        if meaning.retry == "capacity_lost":  # capacity that was there is gone: stop, leave the config for the re-run
            self._requeue_after_lost_capacity(study, trial, config, meaning.capacity_lost)
        elif meaning.retry == "infra":
            self._retry_after_infra(study, trial, config)
        if meaning.tell in ("values", "infeasible"):
            trial.set_constraint("feasible", 0.0 if meaning.tell == "values" else 1.0)
            _tell(study, trial, meaning.values)
        else:
            _tell(study, trial, state=TrialState.PRUNED if meaning.tell == "pruned" else TrialState.FAIL)
        record = trial_record(study, trial.number)
        for listener in self.listeners:
            listener.trial_finished(study, record, result)
        return record

    def _requeue_after_lost_capacity(self, study: optuna.Study, trial: optuna.Trial, config: dict[str, Any],
                                     lost: list[str]) -> None:
        """The cluster lost nodes the study needs: the config is queued again as it was (a retry
        not spent: the infrastructure, not the config, failed) for the re-run, and the study stops
        once the running trials are in (exit 3), rather than spend its budget on trials that
        cannot be placed and feed them to the search as infeasible."""
        ua = trial.user_attrs
        attrs = {k: v for k, v in ua.items() if k in (A.CONFIG, A.KEY, A.CHOSEN, A.BASELINE, A.PREDICTED,
                                                      A.INFRA_RETRY_OF)}
        study.enqueue_trial(self._params_for(config), user_attrs=attrs, skip_if_exists=False)
        trial.set_user_attr(A.REASON, f"{ua.get(A.REASON, '')}; queued again for the re-run"[:2000])
        if not self.infra_failure:
            self.infra_failure = (f"the Ray cluster lost {', '.join(lost)}: the study stopped with its configs left "
                                  "unmeasured; bring the node(s) back and run the same command to resume them")
            self.observer.on_message(self.infra_failure)

    def _retry_after_infra(self, study: optuna.Study, trial: optuna.Trial, config: dict[str, Any]) -> None:
        """Queue the config once more after an infrastructure failure (Ray places it wherever
        the cluster has room now); a second one in a row is left as it is, with its reason."""
        ua = trial.user_attrs
        if A.INFRA_RETRY_OF in ua:
            trial.set_user_attr(A.REASON, f"{ua.get(A.REASON, '')}; the retry of trial {ua[A.INFRA_RETRY_OF]} "
                                          "failed on the infrastructure too: not retried again"[:2000])
            return
        attrs = {k: v for k, v in ua.items() if k in (A.CONFIG, A.KEY, A.CHOSEN, A.BASELINE, A.PREDICTED)}
        attrs[A.INFRA_RETRY_OF] = trial.number
        attrs[A.CHOSEN] = f"retry of trial {trial.number} after an infrastructure failure; " + str(ua.get(A.CHOSEN, ""))
        study.enqueue_trial(self._params_for(config), user_attrs=attrs, skip_if_exists=False)
        trial.set_user_attr(A.REASON, f"{ua.get(A.REASON, '')}; retried once as a new trial"[:2000])
        self.observer.on_message(f"trial {trial.number}: infrastructure failure; its config is retried once")

    def _save_trial_files(self, number: int, config: dict[str, Any], result: ProbeResult) -> None:
        folder = self.run_dir / "trials" / f"{number:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "result.json").write_text(json.dumps(_jsonable(result.to_json()), indent=1))
        if result.log_tail:
            (folder / "log_tail.txt").write_text(result.log_tail)

    # ---- best ------------------------------------------------------------------------------------
    def _best_single(self, study: optuna.Study) -> TrialRecord | None:
        best = best_records(trial_records(study), self.objectives, guide_estimates(study))
        return best[0] if best else None


def _scrub_values(value: Any, secrets: list[str]) -> Any:
    """``value`` (a probe's info: nested mappings, lists, strings) with the secrets masked."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub(str(k), secrets): _scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_values(v, secrets) for v in value]
    return value


def _predicted(metrics: dict[str, Any], objectives: list[tuple[str, str]]) -> dict[str, float]:
    """The prediction kept with a trial: the metrics a user compares, and the step-time breakdown
    the refit (:mod:`autotune.refit`) learns from."""
    keys = {m for m, _ in objectives} | {"step_time_s", "tokens_per_s_per_device", "mfu", "peak_memory_gib",
                                          "memory_headroom_gib", "ttft_ms", "decode_tokens_per_s"}
    return {k: float(v) for k, v in metrics.items() if (k in keys or k.startswith(("time_", "mem_"))) and _finite(v)}


MAX_INFRA_IN_A_ROW = 3  # then the cluster, not the configs, is the problem: stop and say so


def _tell(study: optuna.Study, trial: Any, *args: Any, **kwargs: Any) -> None:
    """``study.tell``, where a sampler's ``study.stop()`` is not an error. Optuna's GridSampler
    calls it in ``after_trial`` once every grid point was sampled, and ``Study.stop`` raises
    outside ``study.optimize``; Optuna has stored the trial by then (in a ``finally``), and this
    loop ends by itself when the space is exhausted."""
    try:
        study.tell(trial, *args, **kwargs)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))

