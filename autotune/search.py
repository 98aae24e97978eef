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

import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from autotune.workers.protocol import ProbeResult, TrialRequest

from .backends import BackendChoice, launch_for, least_trial_devices, trial_placement
from .context import ProbeContext, probe_context
from .guided_sampler import GUIDE_ATTR, GuidedSampler
from .trial_attrs import A
from .ranking import Ranking, rank_space
from .sanity import is_finite_number as _finite
from .refit import RIDGE_DATA_SHEET, RIDGE_MEASURED, Refit, fit_refit
from .secret_env import SPEC_COPY, masked_backend, scrub, secret_values, write_spec_copy
from .space import Space, config_key
from .spec import Spec
from .importance import record_importances
from .ranking import UNDISTINGUISHED
from .storage import open_study, study_storage
from .study_definition import record_definition
from .tracking import TERMINAL_STATUSES, error_line

__all__ = ["StudyRunner", "SearchObserver", "StudyOutcome", "open_study", "study_storage", "make_sampler",
           "trial_records", "best_records", "guide_estimates", "TrialRecord", "A"]

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


# ------------------------------------------------------------------------------------- records
@dataclass
class TrialRecord:
    """A trial as reports and exports see it."""

    number: int
    state: str
    config: dict[str, Any]
    status: str
    source: str
    metrics: dict[str, float]
    predicted: dict[str, float]
    reason: str
    probed: bool
    baseline: bool
    chosen_because: str
    values: list[float] | None
    feasible: bool
    info: dict[str, Any] = field(default_factory=dict)  # what the probe said about itself (software, device)
    wall_s: float = 0.0  # how long the probe ran (OOM probes cost a launch: the summary adds them up)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number, "state": self.state, "status": self.status, "params": self.config,
            "metrics": self.metrics, "predicted": self.predicted, "source": self.source,
            "failure": self.reason if self.status not in ("ok",) else None, "probed": self.probed,
            "baseline": self.baseline, "chosen_because": self.chosen_because,
        }


def trial_records(study: optuna.Study) -> list[TrialRecord]:
    out = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        feasible = all(v <= 0 for v in t.constraints.values()) if t.constraints else True
        out.append(TrialRecord(
            number=t.number, state=t.state.name, config=ua.get(A.CONFIG, dict(t.params)),
            status=ua.get(A.STATUS, "running" if t.state == TrialState.RUNNING else t.state.name.lower()),
            source=ua.get(A.SOURCE, ""), metrics=ua.get(A.METRICS, {}), predicted=ua.get(A.PREDICTED, {}),
            reason=ua.get(A.REASON, ""), probed=bool(ua.get(A.PROBED, False)), baseline=bool(ua.get(A.BASELINE, False)),
            chosen_because=ua.get(A.CHOSEN, ""), values=list(t.values) if t.values else None, feasible=feasible,
            info=ua.get(A.INFO) or {}, wall_s=float(ua.get(A.WALL) or 0.0),
        ))
    return out


def guide_estimates(study: optuna.Study) -> dict[str, tuple[float, float, int]] | None:
    """The guide's estimates of the measured configs (``GuidedSampler.estimates``, kept on the
    study after every probe), or None in a study the guide did not steer."""
    raw = study.user_attrs.get(A.GUIDE_ESTIMATES)
    if not isinstance(raw, dict):
        return None
    return {k: (float(v[0]), float(v[1]), int(v[2])) for k, v in raw.items()
            if isinstance(v, (list, tuple)) and len(v) == 3 and all(_finite(x) for x in v)}


def best_records(records: list[TrialRecord], objectives: list[tuple[str, str]],
                 estimates: dict[str, tuple[float, float, int]] | None = None) -> list[TrialRecord]:
    """The best probed trials: the single best for one objective, the Pareto front for several
    (best first by the first objective). Rule rejections and repeats are never "best". A config
    measured more than once (a close call, measured again) is judged on the mean of its
    measurements; the record returned is its latest, with those means as its metrics.

    With ``estimates`` (a guided study, one objective) the best is the measured config with the
    best estimate, not the best single reading: with 2-3 % noise between runs, the highest
    reading among twenty is often a slower config measured high (the winner's curse), while
    the guide's estimate pools every measurement. The record returned then carries
    ``estimated_<metric>`` (and ``_sd``) in its ``predicted``; its metrics stay what was measured."""
    ok = [r for r in records if r.status == "ok" and r.state == "COMPLETE" and r.probed
          and all(_finite(r.metrics.get(m)) for m, _ in objectives)]
    if not ok:
        return []
    groups: dict[str, list[TrialRecord]] = {}
    for r in ok:
        groups.setdefault(config_key(r.config), []).append(r)
    merged = []
    for rs in groups.values():
        latest = max(rs, key=lambda r: r.number)
        if len(rs) > 1:
            metrics = dict(latest.metrics)
            for name in {k for r in rs for k in r.metrics}:
                values = [r.metrics[name] for r in rs if _finite(r.metrics.get(name))]
                if values:
                    metrics[name] = statistics.fmean(values)
            metrics["measurements"] = len(rs)
            latest = dataclasses.replace(latest, metrics=metrics)
        merged.append(latest)
    ok = merged
    m, d = objectives[0]
    ok.sort(key=lambda r: r.metrics[m], reverse=(d == "maximize"))
    if len(objectives) == 1:
        if estimates:
            def estimate(r: TrialRecord) -> float:
                e = estimates.get(config_key(r.config))
                return e[0] if e is not None else float(r.metrics[m])

            top = max(ok, key=estimate) if d == "maximize" else min(ok, key=estimate)
            e = estimates.get(config_key(top.config))
            if e is not None:
                top = dataclasses.replace(top, predicted={**top.predicted, f"estimated_{m}": e[0],
                                                          f"estimated_{m}_sd": e[1]})
            return [top]
        return ok[:1]
    import numpy as np

    from .ranking import pareto_order

    values = np.array([[r.metrics[m] * (1 if d == "maximize" else -1) for m, d in objectives] for r in ok])
    fronts = pareto_order(values)
    return [r for r, f in zip(ok, fronts) if f == 0]


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
    records: list[TrialRecord]
    best: list[TrialRecord]
    baseline: TrialRecord | None
    ranking: Ranking | None
    probes_run: int
    stopped_because: str
    parent_run_id: str | None = None
    artifacts: dict[str, Path] = field(default_factory=dict)
    infra_failure: str | None = None  # the study stopped because the infrastructure failed (exit 3)


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
        self.refit = Refit()  # identity until a probe is measured
        self._refit_shown: Refit | None = None  # the last refit told to the user
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
        self._start_tracking(study)
        self._reconcile_tracking(study)
        self._refit(study)  # a resumed study starts from the fit of what it measured before
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
        records = trial_records(study)
        best = best_records(records, self.objectives, guide_estimates(study))
        baseline = next((r for r in records if r.baseline and r.status == "ok"), None)
        return StudyOutcome(study, records, best, baseline, ranking, started, stopped,
                            parent_run_id=self.tracker.parent_run_id if self.tracker else None,
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
                _tell(study, trial, self._penalty())
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
            original = _frozen_trial(study, seen[key])  # not study.trials: it deep-copies every trial
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
            predicted.update(self.refit.apply(predicted))  # beside the raw prediction, never instead
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
            times = _measured_step_times(self._live_steps.get(trial.number, []))
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

    def _to_cache(self, number: int, config: dict[str, Any], result: ProbeResult) -> None:
        if self.cache is None or "cached_from" in result.info:
            return
        try:
            self.cache.put(self._cache_key(config), result, self.spec.name, number)
        except Exception as exc:  # the cache saves time; losing a write costs a probe later, not data
            log.warning("could not write the result cache %s: %s", self.cache.path, exc)

    def _refit(self, study: optuna.Study, after: int | None = None) -> None:
        """Refit the model's per-group factors (``autotune.refit.GROUPS``) from every measured trial
        (predicted breakdown vs measured step time); later predictions carry ``refit_*`` values."""
        pairs = [(r.predicted, r.metrics.get("step_time_s"), r.metrics.get("comm_time_s")) for r in trial_records(study)
                 if r.status == "ok" and r.source == "measured" and r.probed]
        # a measured profile (autotune calibrate) is trusted more than a data sheet
        ridge = RIDGE_MEASURED if self.context.hardware.get("calibrated_at") else RIDGE_DATA_SHEET
        refit = fit_refit(pairs, ridge=ridge)
        if refit.n == self.refit.n:
            return
        shown = self._refit_shown
        moved = shown is None or any(abs(refit.factors[g] / shown.factors[g] - 1) > 0.10 for g in refit.factors)
        self.refit = refit
        if after is not None and self.tracker:
            self.tracker.log_parent(metrics=refit.as_metrics(), step=refit.n)
        if after is not None and moved:  # a line when the fit moves, not one per trial
            self._refit_shown = refit
            self.observer.on_message(
                f"refit after trial {after} ({refit.n} measured): {refit.describe()}; "
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

    def _penalty(self) -> list[float]:
        """Objective values told for infeasible trials. They are marked infeasible by constraint,
        so constraint-aware samplers rank them below every feasible trial whatever the value."""
        return [0.0 if d == "maximize" else 1e9 for _, d in self.objectives]

    def _finish(self, study: optuna.Study, trial: optuna.Trial, config: dict[str, Any], result: ProbeResult) -> TrialRecord:
        if self._secrets:  # a probe that printed its environment: no token into any file, MLflow or the cache
            result.log_tail, result.reason = scrub(result.log_tail, self._secrets), scrub(result.reason, self._secrets)
            result.info = _scrub_values(result.info, self._secrets)
        live = self._live_steps.pop(trial.number, [])
        pruned_because = self._prune_reasons.pop(trial.number, None)
        if result.status == "pruned" and pruned_because:
            result.reason = pruned_because
            if not result.steps:  # a Ray task cancelled mid-run returns none: keep what streamed
                result.steps = live
            times = _measured_step_times(result.steps)
            if times and "step_time_s" not in result.metrics:  # the partial measurement
                result.metrics = {**result.metrics, "step_time_s": statistics.median(times),
                                  "measured_steps": float(len(times))}
        self._to_cache(trial.number, config, result)
        metrics = dict(result.metrics)
        step_peak = _step_peak_memory(result.steps)
        if step_peak is not None and not (_finite(metrics.get("peak_memory_gib")) and metrics["peak_memory_gib"] >= step_peak):
            metrics["peak_memory_gib"] = step_peak  # the peak of every step, not only the end state
        self._derive_metrics(metrics, config, result)
        if result.ok and result.source != "simulated":
            self._check_plausible(metrics, config, result)
        trial.set_user_attr(A.STATUS, result.status)
        trial.set_user_attr(A.SOURCE, result.source)
        trial.set_user_attr(A.METRICS, metrics)
        trial.set_user_attr(A.WALL, round(result.wall_s, 3))
        if result.reason:
            trial.set_user_attr(A.REASON, result.reason[:2000])
        if result.info:
            trial.set_user_attr(A.INFO, _jsonable(result.info))
        self._save_trial_files(trial.number, config, result)
        missing = [m for m, _ in self.objectives if result.ok and not _finite(metrics.get(m))]
        if missing:
            trial.set_user_attr(A.STATUS, "crash")
            trial.set_user_attr(A.REASON, f"probe reported no value for objective(s) {missing}")
            _tell(study, trial, state=TrialState.FAIL)
        elif result.ok:
            trial.set_constraint("feasible", 0.0)
            _tell(study, trial, [float(metrics[m]) for m, _ in self.objectives])
        elif result.status in ("oom", "invalid", "nan"):
            trial.set_constraint("feasible", 1.0)
            _tell(study, trial, self._penalty())
        elif result.status == "pruned":
            _tell(study, trial, state=TrialState.PRUNED)
        elif result.status == "infra":  # a node or worker died: never fed to the search as a bad config
            lost = result.info.get("capacity_lost")
            if lost:  # capacity that was there is gone: stop, and leave the config for the re-run
                self._requeue_after_lost_capacity(study, trial, config, lost)
            else:
                self._retry_after_infra(study, trial, config)
            _tell(study, trial, state=TrialState.FAIL)
        else:  # crash, timeout: nothing learnt about the config itself
            _tell(study, trial, state=TrialState.FAIL)
        record = next(r for r in trial_records_one(study, trial.number))
        self._log_trial(study, record, result)
        if record.status == "ok" and record.source == "measured" and record.predicted:
            self._refit(study, after=record.number)
        if self.guided is not None and record.status in ("ok", "pruned"):
            # the guide's pooled estimates, which the best is reported from (best_records)
            estimates = self.guided.estimates(study.get_trials(deepcopy=False))
            study.set_user_attr(A.GUIDE_ESTIMATES, {k: [round(m, 6), round(s, 6), n] for k, (m, s, n) in estimates.items()})
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

    def _derive_metrics(self, metrics: dict[str, Any], config: dict[str, Any], result: ProbeResult) -> None:
        if not result.ok or result.source == "simulated":
            return
        from autotune.objectives import derive_metrics

        derived = derive_metrics(metrics, self.context.model, self.context.workload, self.context.hardware,
                                 self._devices(config), str(config.get("precision", "bf16")))
        for k, v in derived.items():
            metrics.setdefault(k, v)

    def _check_plausible(self, metrics: dict[str, Any], config: dict[str, Any], result: ProbeResult) -> None:
        """A measurement that cannot be real (a negative time, MFU above 100 %) is a crash with
        the reason: its metrics stay recorded, and it never becomes the best."""
        from .sanity import implausible_metrics

        c = self.context
        problems = implausible_metrics(metrics, c.model, c.workload, c.hardware, str(config.get("precision", "bf16")))
        if problems:
            result.status = "crash"
            result.reason = "implausible metrics from the probe: " + "; ".join(problems)

    def _devices(self, config: dict[str, Any]) -> int:
        if self.space.training:
            return int(config.get("tp", 1)) * int(config.get("pp", 1)) * int(config.get("cp", 1)) * int(config.get("dp", 1))
        return int(config.get("tp", 1))

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

    # ---- tracking ----------------------------------------------------------------------------------
    def _start_tracking(self, study: optuna.Study) -> None:
        if not self.tracker:
            return
        previous = study.user_attrs.get("autotune.parent_run_id")
        params = {
            "model": self.spec.model.name, "workload": self.spec.workload.kind, "world_size": self.spec.cluster.world_size,
            "accelerator": self.spec.cluster.accelerator, "hardware_profile": self.spec.cluster.profile_name,
            "backend": self.backend.kind, "sampler": self.spec.search.sampler, "n_trials": self.spec.search.n_trials,
            "parallel_trials": self.parallel, "objectives": ",".join(f"{m}:{d}" for m, d in self.objectives),
            "space_size": self.space.size,
        }
        tags = {"autotune.study": self.spec.name, "autotune.backend": self.backend.kind,
                "autotune.source": "simulated" if self.backend.simulated else "measured",
                "autotune.backend_reason": self.backend.reason}
        if self.parallel != self.spec.search.parallel_trials:  # the effective setting, and why
            tags["autotune.parallel_trials_note"] = (
                f"parallel_trials {self.parallel}, the spec says {self.spec.search.parallel_trials}: "
                "simulated trials are predictions, computed one after another in the driver")
        run_id = self.tracker.start_parent(self.spec.name, params, tags, resume_run_id=previous)
        study.set_user_attr("autotune.parent_run_id", run_id)
        if self.spec.source_path:  # the copy the run directory keeps, secrets masked
            copy = self.run_dir / SPEC_COPY
            if not copy.exists():
                write_spec_copy(self.spec.source_path, self.run_dir)
            self.tracker.log_parent(artifacts=[copy], artifact_path="spec")
        if self.ranking is not None:
            self.tracker.log_parent(metrics={"space_valid": self.ranking.enumeration.valid,
                                             "space_fit_predicted": self.ranking.fit},
                                    artifacts=[self.run_dir / "ranking.csv"])

    def _reconcile_tracking(self, study: optuna.Study) -> None:
        """Make MLflow hold exactly the tracked trials of Optuna storage (:func:`is_tracked`).

        A trial finished in Optuna but missing in MLflow (the run was killed between the two
        writes, or the server was down) is logged now; a child left ``RUNNING`` (a write broken
        half-way) is not complete, so it is deleted and the trial logged again; a second child of
        one trial is deleted. Nothing measured is lost, and a re-run of a finished study changes
        nothing in MLflow."""
        if not self.tracker:
            return
        # MLflow itself says which trials it holds: a finished Optuna trial cannot take a user
        # attribute any more, so the child run's ``autotune.trial`` tag is the record of it.
        try:
            children = self.tracker.child_runs()
        except Exception as exc:  # the server went away since the start: the next run reconciles
            log.warning("could not read MLflow's child runs (%s); the trials MLflow lacks are logged by the next run",
                        error_line(exc))
            return
        logged: set[int] = set()
        for run in sorted(children, key=lambda r: r.info.status not in TERMINAL_STATUSES):
            number = run.data.tags.get("autotune.trial", "")
            if not number.isdigit():
                continue
            if run.info.status in TERMINAL_STATUSES and int(number) not in logged:
                logged.add(int(number))
            else:  # half-written, or a second child of the same trial
                self.tracker.delete_run(run.info.run_id)
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            if t.number in logged or A.STATUS not in t.user_attrs:
                continue
            record = trial_records_one(study, t.number)[0]
            if not is_tracked(record):
                continue
            path = self.run_dir / "trials" / f"{t.number:04d}" / "result.json"
            result = ProbeResult.from_json(json.loads(path.read_text())) if path.exists() else None
            self._log_trial(study, record, result)

    def _log_trial(self, study: optuna.Study, record: TrialRecord, result: ProbeResult | None) -> None:
        if not self.tracker or not is_tracked(record):
            return
        metrics = {k: v for k, v in record.metrics.items() if _finite(v)}
        for k, v in record.predicted.items():
            if _finite(v):
                metrics[f"predicted_{k}"] = v
        first = self.objectives[0][0]
        measured = record.metrics.get(first)
        for prefix in ("", "refit_"):
            predicted = record.predicted.get(prefix + first)
            if _finite(predicted) and _finite(measured) and measured:
                metrics[f"{prefix}prediction_error_pct"] = 100.0 * (predicted - measured) / abs(measured)
        tags = {"autotune.status": record.status, "autotune.source": record.source or "rules",
                "autotune.backend": self.backend.kind, "autotune.chosen_because": record.chosen_because,
                "autotune.optuna_state": record.state}
        if record.reason:
            tags["autotune.failure_reason"] = record.reason
        if record.baseline:
            tags["autotune.baseline"] = "true"
        artifacts = [self.run_dir / "trials" / f"{record.number:04d}" / n for n in ("result.json", "log_tail.txt")]
        self.tracker.log_trial(record.number, record.config, metrics, tags,
                               steps=result.steps if result else None, artifacts=artifacts,
                               failed=record.status not in ("ok", "pruned"))


def is_tracked(record: TrialRecord) -> bool:
    """The one rule for what becomes an MLflow child run, on a first run and on every resume: a
    config that was probed, simulated or answered from the cache. Rule rejections and repeats are
    answered without a probe (they are counted on the parent run and listed by ``autotune
    report``), and an interrupted probe measured nothing (its config is probed again)."""
    return bool(record.probed) and record.status not in ("duplicate", "interrupted")


def _scrub_values(value: Any, secrets: list[str]) -> Any:
    """``value`` (a probe's info: nested mappings, lists, strings) with the secrets masked."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {scrub(str(k), secrets): _scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub_values(v, secrets) for v in value]
    return value


def _frozen_trial(study: optuna.Study, number: int) -> Any:
    """One trial by number, straight from the storage (None if there is no such trial)."""
    try:
        return study._storage.get_trial(study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number))
    except KeyError:
        return None


def trial_records_one(study: optuna.Study, number: int) -> list[TrialRecord]:
    t = _frozen_trial(study, number)
    dummy = _OneTrialStudy(t)
    return trial_records(dummy)  # type: ignore[arg-type]


class _OneTrialStudy:
    def __init__(self, trial: Any):
        self._trial = trial

    def get_trials(self, deepcopy: bool = False, states: Any = None) -> list[Any]:
        return [self._trial]


def _predicted(metrics: dict[str, Any], objectives: list[tuple[str, str]]) -> dict[str, float]:
    """The prediction kept with a trial: the metrics a user compares, and the step-time breakdown
    the refit (:mod:`autotune.refit`) learns from."""
    keys = {m for m, _ in objectives} | {"step_time_s", "tokens_per_s_per_device", "mfu", "peak_memory_gib",
                                          "memory_headroom_gib", "ttft_ms", "decode_tokens_per_s"}
    return {k: float(v) for k, v in metrics.items() if (k in keys or k.startswith(("time_", "mem_"))) and _finite(v)}


def _step_peak_memory(steps: list[dict[str, Any]]) -> float | None:
    """The highest memory any step reported (``memory_gib`` / ``peak_memory_gib``), warm-up included:
    a config that peaks in its first step needs that memory too."""
    values = [float(e[k]) for e in steps for k in ("memory_gib", "peak_memory_gib") if _finite(e.get(k))]
    return max(values) if values else None


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


def _measured_step_times(steps: list[dict[str, Any]]) -> list[float]:
    """Step times of the measured phase (all steps when the probe names no phases)."""
    phased = any("phase" in e for e in steps)
    return [float(e["step_time_s"]) for e in steps
            if _finite(e.get("step_time_s")) and (not phased or e.get("phase") == "measure")]


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)))

