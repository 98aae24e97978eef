"""One trial, top to bottom: ask -> resolve -> [memory profile -> verdict] -> dispatch -> interpret
-> tell -> notify.

Why a module of its own: the loop (:mod:`autotune.study.search`) decides only when to start a trial and
when to stop; what a trial does, and what it costs the budget, reads here in the order it happens.
Like Optuna's ``_run_trial`` (ask -> run -> tell -> callbacks), except that a probe runs elsewhere
and several trials are in flight at once, so the sequence pauses where it waits on the dispatcher:
:meth:`TrialRunner.start` runs a trial up to its first submit, and :meth:`TrialRunner.returned`
takes each result the loop collects and carries the trial on from there.

The budget (:attr:`LoopState.started <autotune.study.stop_conditions.LoopState.started>`, full-probe
equivalents) is counted in :func:`_count` and :func:`_recount` only. While a trial runs it counts one
full probe, and its memory profile's share once that has run
(:func:`autotune.guide.memory_profile.profile_cost_fpe`). When it ends, every ended trial is counted
again as a resumed study counts them (:func:`autotune.guide.memory_profile.cost_of_trials`, at the
walls' median known now): no full probe where the profile ended the trial; a full probe that ran out
of memory, that the pruner stopped, or a re-measurement made short on purpose
(:mod:`autotune.guide.short_remeasure`), its wall against a full probe's
(:func:`autotune.guide.memory_profile.full_probe_cost_fpe`); a trial the infrastructure failed (not
the config), nothing. A trial starts only where a whole full probe is left
(:func:`autotune.study.stop_conditions.budget_fits_a_probe`): a study spends at most ``search.n_trials``,
but for a memory profile's share.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from autotune.workers.protocol import ProbeResult, TrialRequest

from autotune.workers.parameters import trial_devices
from ..spec.context import RequestSettings
from .interpret import interpret, settle_pruned
from .listeners import SearchObserver, TrialListener
from ..guide.memory_profile import cost_of_trials, layers_per_stage, median_full_wall, profile_cost_fpe
from ..guide.short_remeasure import remeasure_request
from ..guide.projection import project_result, reference_devices, scaling_figures
from .profiling import MemoryProfiler, ProfileRun
from .pruning import LoserPruner
from .records import (
    CONFIRMED_AT_TARGET,
    TrialRecord,
    best_records,
    guide_estimates,
    is_tracked,
    noise_prior_of,
    jsonable,
    save_trial_files,
    trial_record,
    trial_records,
)
from .requeue import requeue_after_lost_capacity, retry_after_infra
from ..spec.secret_env import scrub_result
from ..settings import Objectives
from ..spec.space import Space, config_key
from .stop_conditions import LoopState
from ..trial_attrs import A
from .trial_resolve import TrialResolver, tell

__all__ = ["TrialRunner"]


class TrialRunner:
    """Runs the trials of one study, each from ask to the listeners.

    Given what a trial uses, built once the study is open: the ``request`` settings (what a trial
    file needs, :class:`autotune.spec.context.RequestSettings`), the study's resolved ``objectives``, the
    ``resolver`` (:mod:`autotune.study.trial_resolve`),
    the memory ``profiler`` (None: no profiles), the ``dispatcher`` and ``launcher``, the
    ``listeners`` in the order they are told, the ``pruner`` (what streamed from a trial, why it was
    stopped) and the ``observer``; ``on_profile_cost`` hears what each memory profile cost in
    full-probe equivalents (the guide weighs the next one by it). It reads no sampler's settings."""

    def __init__(
        self,
        space: Space,
        request: RequestSettings,
        objectives: Objectives,
        run_dir: Any,
        *,
        resolver: TrialResolver,
        profiler: MemoryProfiler | None,
        dispatcher: Any,
        launcher: Callable[[TrialRequest], Any],
        listeners: list[TrialListener],
        pruner: LoserPruner,
        observer: SearchObserver,
        on_profile_cost: Callable[[float], None] | None = None,
    ):
        self.space, self.request, self.context, self.run_dir = space, request, request.context, run_dir
        self.objectives = objectives
        self.resolver, self.profiler = resolver, profiler
        self.dispatcher, self.launcher = dispatcher, launcher
        self.listeners, self.pruner, self.observer = listeners, pruner, observer
        self.on_profile_cost = on_profile_cost
        self._profiling: dict[Any, ProfileRun] = {}  # pending handles that are a trial's memory profile runs
        self._secrets = list(request.secrets)  # scrubbed from what a probe printed
        named = {m for m, _ in objectives} | {n for e in space.outcome_constraints for n in e.names}
        self._scaling_named = named & {"scaling_efficiency", "comm_fraction"}  # read by the model where not measured

    # ---- ask -> resolve -> (the cache, or) [memory profile first, or] dispatch ------------------
    def start(self, study: optuna.Study, loop: LoopState) -> None:
        """Ask for a trial and run it up to its first submit (or to its end, when no probe is needed)."""
        trial = study.ask(self.space.distributions())
        handled = self.resolver.resolve(study, trial, loop.seen)
        if handled is None:  # a rule rejection or a repeat: told already, no probe
            loop.misses += 1
            return
        loop.misses = 0
        config, why = handled
        cached = None if A.REMEASURE_OF in trial.user_attrs else self.resolver.from_cache(config)
        trial.set_user_attr(A.PROBED, True)
        loop.seen[config_key(config)] = trial.number
        _count(loop, 1, trial.number)  # one full probe, until its profile or the infrastructure says otherwise
        if cached is not None:  # measured before, in this or another study: no probe
            result, origin = cached
            trial.set_user_attr(
                A.CHOSEN, f"{why}; answered from the result cache (study {origin['study']}, trial {origin['trial']})"
            )
            record = self._interpret_and_tell(study, loop, trial, config, result)
            _recount(study, loop, trial.number)
            self.observer.on_trial_finished(record, self.best(study), len(loop.pending))
            return
        request = self._request(trial, config)
        run = self.profiler.plan(trial, config, request, why) if self.profiler is not None else None
        if run is not None:  # not sure to fit: its memory profile first (autotune.study.profiling)
            self.observer.on_trial_started(trial.number, config, f"{why}; memory profile first")
            self._submit_profile(loop, run)
            return
        launch = self.launcher(request)
        self.observer.on_trial_started(trial.number, config, why)
        loop.pending[self.dispatcher.submit(request, launch)] = (trial, config)

    def _request(self, trial: optuna.Trial, config: dict[str, Any]) -> TrialRequest:
        """What the probe is told: the config, the model, workload and cluster, the backend (masked);
        at the target's full size for a slice study's confirmation (``cluster.confirm_top``); a
        re-measurement, with ``search.remeasure_steps`` timed steps where the probe takes them
        (:mod:`autotune.guide.short_remeasure`)."""
        if trial.user_attrs.get(A.AT_TARGET):
            return self.request.target_request(config, trial.number)
        request = self.request.request(config, trial.number)
        steps = self.request.remeasure_steps
        if steps and A.REMEASURE_OF in trial.user_attrs:  # a new launch's reading: warm-up and a few timed steps
            trial.set_user_attr(A.SHORT_STEPS, int(steps))
            said = trial.user_attrs.get(A.CHOSEN, "")
            timed = f"{steps} timed step{'s' if steps != 1 else ''} after the warm-up (search.remeasure_steps)"
            trial.set_user_attr(A.CHOSEN, f"{said}; {timed}" if said else timed)
            return remeasure_request(request, steps)
        return request

    def _submit_profile(self, loop: LoopState, run: ProfileRun) -> None:
        """Submit the profile's next run (the layers per stage it has not run yet)."""
        request = self.profiler.next_request(run)
        handle = self.dispatcher.submit(request, self.launcher(request))
        loop.pending[handle] = (run.trial, run.config)
        self._profiling[handle] = run

    # ---- a submitted run came back -------------------------------------------------------------
    def returned(self, study: optuna.Study, loop: LoopState, handle: Any, result: ProbeResult) -> None:
        """A run the loop collected: one of a trial's memory profile runs, or its full probe."""
        trial, config = loop.pending.pop(handle)
        run = self._profiling.pop(handle, None)
        if run is not None:
            self._profiled(study, loop, run, result)
        else:
            self._end(study, loop, trial, config, result)

    def full_probes(self, loop: LoopState) -> dict[Any, tuple[optuna.Trial, dict[str, Any]]]:
        """The pending runs the pruner may stop: full probes, not a memory profile, nor a slice
        study's confirmation at full size (its steps are the target's, slower than the slice's
        projected best by design: the first run of the slice benchmark pruned both of its own)."""
        return {
            h: v for h, v in loop.pending.items() if h not in self._profiling and not v[0].user_attrs.get(A.AT_TARGET)
        }

    # ---- [memory profile -> verdict] -----------------------------------------------------------
    def _profiled(self, study: optuna.Study, loop: LoopState, run: ProfileRun, result: ProbeResult) -> None:
        """A profile run came back: the next one, the full probe, or the trial's end (its verdict)."""
        scrub_result(result, self._secrets)
        action, final = self.profiler.take(study, run, result)
        if action == "again":
            self._submit_profile(loop, run)
            return
        median = median_full_wall(t.user_attrs for t in study.get_trials(deepcopy=False))
        per_stage = layers_per_stage(run.request.model, run.config)
        cost = profile_cost_fpe(run.walls_s, run.layers[: run.done], per_stage, median)
        _count(loop, cost, run.trial.number)
        if self.on_profile_cost is not None:
            self.on_profile_cost(cost)
        if action == "probe":
            self.pruner.live_steps.pop(run.trial.number, None)  # the profile's steps are not the probe's
            loop.pending[self.dispatcher.submit(run.request, self.launcher(run.request))] = (run.trial, run.config)
            return
        self._end(study, loop, run.trial, run.config, final)  # no full probe: _recount counts the profile alone

    # ---- the trial's end -----------------------------------------------------------------------
    def _end(
        self, study: optuna.Study, loop: LoopState, trial: optuna.Trial, config: dict[str, Any], result: ProbeResult
    ) -> None:
        """The trial's own result (its full probe's, or its profile's verdict): told, then shown."""
        record = self._interpret_and_tell(study, loop, trial, config, result)
        if record.status == "infra":  # the machine failed, not the config: no budget spent (_recount
            loop.infra_in_a_row += 1  # leaves it out), and its retry (queued by _interpret_and_tell) is no repeat
            if loop.seen.get(config_key(config)) == trial.number:
                del loop.seen[config_key(config)]
        else:
            loop.infra_in_a_row = 0
        # what it cost, counted with every ended trial: an OOM, a pruned probe or a short re-measurement
        # its wall against a full probe's (memory_profile.full_probe_cost_fpe), a profile its share
        _recount(study, loop, trial.number)
        self.observer.on_trial_finished(record, self.best(study), len(loop.pending))

    def _interpret_and_tell(
        self, study: optuna.Study, loop: LoopState, trial: optuna.Trial, config: dict[str, Any], result: ProbeResult
    ) -> TrialRecord:
        """interpret -> record -> tell -> notify the listeners, for one finished trial."""
        scrub_result(result, self._secrets)  # a probe that printed its environment: no token stored anywhere
        settle_pruned(result, *self.pruner.settle(trial.number))
        for listener in self.listeners:
            listener.probe_returned(trial.number, config, result)
        if result.source == "measured" and self.request.workload_kind == "train":
            confirms = trial.user_attrs.get(A.REMEASURE_OF, -1) if trial.user_attrs.get(A.AT_TARGET) else None
            result = self._at_target(config, trial.number, result, confirms)
        meaning = interpret(
            config, result, self.context, self.objectives, trial_devices(self.request.workload_kind, config)
        )
        result.status, result.reason = meaning.probe_status, meaning.probe_reason
        misses = self.space.outcome_misses(meaning.metrics) if meaning.tell == "values" else []
        if misses:  # measured, but not what the spec accepts (scaling_efficiency >= 0.8): never the best
            meaning.reason = f"misses the spec's constraint(s): {'; '.join(misses)}"
        for name, value in (
            (A.STATUS, result.status),
            (A.SOURCE, result.source),
            (A.METRICS, meaning.metrics),
            (A.WALL, round(result.wall_s, 3)),
        ):
            trial.set_user_attr(name, value)
        if result.reason:
            trial.set_user_attr(A.REASON, result.reason[:2000])
        if result.info:
            trial.set_user_attr(A.INFO, jsonable(result.info))
        save_trial_files(self.run_dir, trial.number, result)
        if meaning.status != result.status or misses:
            trial.set_user_attr(A.STATUS, meaning.status)
            trial.set_user_attr(A.REASON, meaning.reason[:2000])
        if meaning.retry == "capacity_lost":  # capacity that was there is gone: stop, leave the config for the re-run
            why = requeue_after_lost_capacity(study, trial, config, self.space, meaning.capacity_lost)
            if not loop.infra_failure:
                loop.infra_failure = why
                self.observer.on_message(why)
        elif meaning.retry == "infra":
            retry_after_infra(study, trial, config, self.space, self.observer.on_message)
        if meaning.tell in ("values", "infeasible"):
            trial.set_constraint("feasible", float(len(misses)) if meaning.tell == "values" else 1.0)
            tell(study, trial, meaning.values)
        else:
            tell(study, trial, state=TrialState.PRUNED if meaning.tell == "pruned" else TrialState.FAIL)
        record = trial_record(study, trial.number)
        for listener in self.listeners:
            listener.trial_finished(study, record, result)
        return record

    def _at_target(
        self, config: dict[str, Any], number: int, result: ProbeResult, confirms: int | None = None
    ) -> ProbeResult:
        """A measured training result as the study reads it at its cluster: projected there when it
        ran on the probe slice; with ``scaling_efficiency`` (and ``comm_fraction`` where the probe
        gave none) when the spec names them, read by the calibrated model from the measurement
        (:func:`autotune.guide.projection.scaling_figures`, said in ``info["scaling_figures"]``).
        ``confirms``: the slice trial whose config this one measured again at full size
        (``cluster.confirm_top``): read as it ran, and marked so (``info["confirmed_at_target"]``)."""
        confirming = confirms is not None
        on_slice = bool(self.context.cluster.get("probe_nodes")) and not confirming
        if confirming:
            where = {"nodes": int(self.context.cluster["nodes"]), "confirms_trial": confirms}
            result = dataclasses.replace(result, info={**result.info, CONFIRMED_AT_TARGET: where})
        if not on_slice and not self._scaling_named:  # measured at full size, nothing to read: as it is
            return result
        target = self.request.target_request(config, number)
        measured_on = self.request.slice_request(target) if on_slice else target
        measured = dict(result.metrics)
        if on_slice:
            result = project_result(result, measured_on, target)
        if not result.ok or not self._scaling_named:
            return result
        figures = {k: v for k, v in scaling_figures(measured, measured_on, target).items() if k in self._scaling_named}
        added = {k: v for k, v in figures.items() if k not in result.metrics}
        if not added:
            return result
        how = {
            "reference_devices": reference_devices(target.params, target.cluster),
            "from": "the calibrated model's projection of the measurement",
            "metrics": sorted(added),
        }
        return dataclasses.replace(
            result, metrics={**result.metrics, **added}, info={**result.info, "scaling_figures": how}
        )

    def best(self, study: optuna.Study) -> TrialRecord | None:
        """The best trial so far (what the progress shows and the pruner measures against)."""
        best = best_records(trial_records(study), self.objectives, guide_estimates(study), noise_prior_of(study))
        return best[0] if best else None


def _count(loop: LoopState, fpe: float, number: int) -> None:
    """The budget, counted here and in :func:`_recount` only: ``fpe`` full-probe equivalents more for
    trial ``number`` (less, when a trial turns out to cost less than it was counted at: see the
    module docstring)."""
    loop.started += fpe
    loop.in_flight[number] = loop.in_flight.get(number, 0.0) + fpe


def _recount(study: optuna.Study, loop: LoopState, number: int) -> None:
    """Trial ``number`` has ended: the budget spent is counted again, the study's ended trials as a
    resumed study counts them (:func:`autotune.guide.memory_profile.cost_of_trials`, with the median
    full probe's wall known now) and the trials in flight as counted so far. Why: a probe that ran
    out of memory, or a memory profile, before any full probe's wall was known was counted at an
    estimate (a whole probe; a profile's layers), and a trial starts only where a whole probe is
    left (:func:`autotune.study.stop_conditions.budget_fits_a_probe`): a stale count would leave
    budget unspent that the same study, resumed, would spend."""
    loop.in_flight.pop(number, None)
    ended = [
        r.budget_attrs()
        for r in trial_records(study)
        if r.state != "RUNNING" and r.number not in loop.in_flight and is_tracked(r) and r.status != "infra"
    ]
    loop.started = cost_of_trials(ended) + sum(loop.in_flight.values())
