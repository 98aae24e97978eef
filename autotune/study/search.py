"""The search loop: an Optuna study driven by ask/tell, feeding trials to a dispatcher.

Why ask/tell rather than ``study.optimize``: trials run as separate processes on remote devices,
several at once, and a failure (OOM, timeout) is information for the sampler, not an exception.
Like Optuna's ``study/_optimize.py``, one trial is one path, read top to bottom in
:mod:`autotune.study.trial_run` (ask -> resolve -> [memory profile -> verdict] -> dispatch -> interpret
-> tell -> notify the listeners); this loop only starts trials, hands back what the dispatcher
returned, and stops: the stop conditions are a flat list of small named checks. The loop is given
its dispatcher and launcher (the CLI assembles them, :mod:`autotune.cli.assembly`); it never chooses
them. Nor does it read the spec (issue 43): like Hydra's sweeper, it takes typed settings
(:class:`LoopSettings`, made once by the assembly, the objectives resolved) and its set-up
(:class:`autotune.study.plan.StudyPlan`: rank, sampler, storage, plan, the study's result) from
outside.

Guarantees, all backed by Optuna storage: resumable (a killed run's trials re-queued,
:mod:`autotune.study.requeue`); no config probed twice (a repeat answered from the earlier result);
infeasibility reaches the sampler (``trial.set_constraint("feasible", > 0)``); a simulated result
is never a measured one (``autotune.source``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import optuna

from autotune.workers.protocol import TrialRequest

from ..spec.context import ProbeContext, RequestSettings
from ..guide.guided import GuideSettings
from ..guide.sampler import GuidedSampler
from .importance import record_importances
from .listeners import (
    GuideEstimatesListener,
    RefitListener,
    ResultCacheListener,
    SearchObserver,
    TrialListener,
    _Quiet,
    observer_phase,
)
from ..guide.memory_profile import cost_of_trials
from .profiling import MemoryProfiler
from .pruning import LoserPruner, PruneSettings
from ..guide.ranking import Ranking
from .records import NOISE_PRIOR_ATTR, is_tracked, measured_configs, trial_records
from ..objectives.intervals import NoisePrior
from ..guide.refit import Refit
from .requeue import recover_interrupted
from ..settings import Objectives
from .definition import record_definition
from .usable_memory import USABLE_ATTR
from .plan import StudyPlan
from .result import StudyOutcome
from .confirm import queue_confirmations
from .stop_conditions import (
    DEADLINE_REACHED,
    MAX_INFRA_IN_A_ROW,
    LoopState,
    budget_fits_a_probe,
    budget_stop,
    deadline_reached,
    infrastructure_stop,
    guide_says_stop,
    sampler_stuck,
    space_exhausted,
)
from .trial_resolve import TrialResolver
from .trial_run import TrialRunner

__all__ = ["LoopSettings", "StudyRunner", "SearchObserver", "StudyOutcome"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """What the loop and its trials read of the spec, made once by the assembly
    (:func:`autotune.cli.assembly.loop_settings`)."""

    objectives: Objectives  # the study's, resolved once: what Optuna is told, what "best" means, what the guide aims at
    simulated: bool  # the analytical model answers: one trial at a time, no guide, no pruning, no placement check
    n_trials: int  # search.n_trials: the budget, in full-probe equivalents
    timeout_s: float | None  # search.timeout_s: no trial is started after this many seconds
    parallel: int  # trials in flight at once: search.parallel_trials, 1 on the simulator
    rank_first: bool  # search.sampler is auto: the simulator ranks the space; its best bets or the guide propose
    memory_profiles: bool  # search.memory_profiles: the user asked for profiles (said when the guide cannot run them)
    seed: int | None  # search.seed: the guide's independent sampler
    guide: GuideSettings  # the guide's knobs, for sampler auto on real probes
    prune: PruneSettings  # when a running probe is stopped as one that cannot win
    request: RequestSettings  # what each trial file says beside its config: the probe context, the study, the backend
    confirm_top: int = 0  # cluster.confirm_top: a slice study's best configs measured again at full size at the end
    full_remeasure_why: str | None = None  # why search.remeasure_steps, set, changes nothing here (said at the start)


class StudyRunner:
    """Runs one study to its budget under its ``settings`` and ``plan`` (the study's set-up, bound
    to its spec by the assembly: :func:`autotune.cli.assembly.study_runner` makes all three), with the
    ``dispatcher`` (and ``launcher``: a trial request -> the launch of its probe, None for an
    in-process dispatcher) it is given, and the study's MLflow listener ``tracking``
    (:func:`autotune.cli.assembly.tracking_for`; None in tests and with ``--no-tracking``): the loop
    tells it what it tells every listener and imports no tracking module."""

    def __init__(
        self,
        settings: LoopSettings,
        plan: StudyPlan,
        run_dir: Path,
        *,
        dispatcher: Any,
        launcher: Callable[[TrialRequest], Any] = lambda request: None,
        tracking: TrialListener | None = None,
        observer: SearchObserver | None = None,
        cache: Any = None,
        reuse_cache: bool = False,
        stop_requested: Any = None,
        definition: dict[str, Any] | None = None,
        usable_memory: dict[str, Any] | None = None,
    ):
        self.settings, self.plan, self.run_dir = settings, plan, run_dir
        self.dispatcher, self.launcher = dispatcher, launcher
        self.definition = definition  # what defines the study (study_definition), kept on it when created
        self.usable_memory = usable_memory  # what the device check said (autotune.study.usable_memory), kept on it
        # a signal whose handler's exception Python swallowed (raised inside a garbage-collection
        # callback, "Exception ignored in ...") still stops the loop: the CLI's flag, checked here
        self.stop_requested = stop_requested or (lambda: False)
        self.observer = observer or _Quiet()
        self.space = plan.space
        self.context: ProbeContext = settings.request.context
        self.objectives = settings.objectives
        self.parallel = settings.parallel
        self.cache = None if settings.simulated else cache  # real probes' results across studies (autotune.study.cache)
        self.reuse_cache = reuse_cache
        self.ranking: Ranking | None = None
        self.guided: GuidedSampler | None = None  # sampler auto on real probes: model-guided proposals
        self.resolver: TrialResolver | None = None
        # what observes each finished trial, in this order: MLflow, the model's refit, the guide
        self.tracking = tracking  # MLflow (autotune.tracking.study_tracking), built by the assembly; None: untracked
        self.refits = RefitListener(
            bool(self.context.hardware.get("calibrated_at")), on_moved=self._say_refit, on_refit=self._refit_changed
        )
        self.listeners: list[TrialListener] = [x for x in (self.tracking, self.refits) if x is not None]
        self.pruner = LoserPruner(settings.prune, settings.objectives, settings.simulated)
        self.profiler: MemoryProfiler | None = None  # profile-then-probe (autotune.study.profiling), set in _open
        self.trials: TrialRunner | None = None  # each trial, ask to listeners (autotune.study.trial_run), set in _open
        # checked, in order, before each proposal: the first that answers stops asking
        self.stop_checks: list[Callable[[optuna.Study, LoopState], str | None]] = [
            deadline_reached,
            # with the guide, a space probed whole may still race its contenders: the guide says when done
            lambda study, loop: None if self.guided is not None else space_exhausted(study, loop),
            sampler_stuck,
            lambda study, loop: guide_says_stop(self.guided, study),
        ]

    @property
    def refit(self) -> Refit:
        """The model's current refit (what later predictions carry as ``refit_*``)."""
        return self.refits.refit

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> StudyOutcome:
        """Probe until a stop condition holds; a study whose budget earlier runs spent runs nothing
        and says so (:data:`autotune.study.stop_conditions.ALREADY_COMPLETE`)."""
        study, loop = self._open()
        try:
            self._probe(study, loop)
            if self._confirm(study, loop):  # a slice study's best, measured again at full size
                first_stop = loop.stopped
                self._probe(study, loop)
                if not loop.infra_failure:
                    loop.stopped = (
                        f"{first_stop}; then its best {self.settings.confirm_top} by projection measured again at "
                        f"the target's full size (cluster.confirm_top)"
                    )
        except KeyboardInterrupt:
            loop.stopped = "interrupted by the user"
            for handle in list(loop.pending):
                self.dispatcher.cancel(handle)
            raise
        finally:
            self._search_ended(study)
        # once, for every output (report, MLflow, plots): the model's over the whole feasible space
        # when the trials are its predictions, fANOVA over the measured trials otherwise
        record_importances(study, self.objectives, self.ranking if self.settings.simulated else None)
        parent = getattr(self.tracking, "parent_run_id", None)
        result = self.plan.result(study)
        return StudyOutcome(study, result, self.ranking, loop.started, loop.stopped, parent, loop.infra_failure)

    def _probe(self, study: optuna.Study, loop: LoopState) -> None:
        """Ask, run and tell trials until a stop condition holds (the stop checks do not apply while
        a slice study's confirmations run: they are the study's last word, not its search)."""
        while True:
            if self.stop_requested():
                raise KeyboardInterrupt
            if not loop.pending and (why := infrastructure_stop(loop)):
                loop.stopped = why
                break
            while self._may_start(loop):
                checks = () if loop.confirming else self.stop_checks
                why = next((w for check in checks if (w := check(study, loop))), None)
                if why:
                    loop.stopped = why
                    break
                self.trials.start(study, loop)
            if not loop.pending:
                if not budget_fits_a_probe(loop):
                    loop.stopped = budget_stop(loop)
                break
            for handle, result in self.dispatcher.wait_any(timeout=0.25):
                self.trials.returned(study, loop, handle, result)
                if self.stop_requested():
                    raise KeyboardInterrupt
            d = self.dispatcher
            full = self.trials.full_probes(loop)  # a memory profile is not pruned
            self.pruner.prune(d.step_events(), full, lambda: self.trials.best(study), d.cancel)

    def _confirm(self, study: optuna.Study, loop: LoopState) -> bool:
        """Queue a slice study's confirmations (:mod:`autotune.study.confirm`) once its search ended
        on its own (not on the infrastructure or ``search.timeout_s``); True when some were."""
        if not self.settings.confirm_top or loop.infra_failure or loop.stopped == DEADLINE_REACHED:
            return False
        nodes = int(self.context.cluster["nodes"])
        queued = queue_confirmations(study, self.space, self.objectives, self.settings.confirm_top, nodes)
        if not queued:
            return False
        self.observer.on_message(
            f"measuring the best {queued} config(s) by projection again at the target's full size ({nodes} nodes)"
        )
        loop.confirming = True
        loop.budget = loop.started + queued
        return True

    def _open(self) -> tuple[optuna.Study, LoopState]:
        """Rank the space, open (or resume) the study, recover and plan; start the listeners."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        settings, plan = self.settings, self.plan
        if settings.rank_first:
            self.ranking = plan.rank(
                self.run_dir, self.observer.on_message, phase=lambda text: observer_phase(self.observer, text)
            )
        ranking = self.ranking
        if ranking is not None and not settings.simulated and len(self.objectives) == 1 and ranking.order.size:
            self.guided = GuidedSampler(
                ranking,
                self.space,
                self.objectives[0],
                settings=settings.guide,
                seed=settings.seed,
                n_trials=settings.n_trials,
            )
        self.profiler = plan.memory_profiler(self.guided)
        if self.guided is not None and not self.profiler.available and settings.memory_profiles:
            self.observer.on_message(f"memory profiles off: {self.profiler.why_not}")
        if self.guided is not None and settings.full_remeasure_why:
            self.observer.on_message(f"re-measurements run the full probe: {settings.full_remeasure_why}")
        sampler = self.guided or plan.sampler(self.parallel)
        study = plan.open(self.run_dir, sampler)
        if self.definition is not None:
            record_definition(study, self.definition)
        if self.usable_memory:
            study.set_user_attr(USABLE_ATTR, self.usable_memory)
        guide = settings.guide
        if guide.noise_dof > 0:  # the host's measured noise, what the report's certificate reads as the guide did
            prior = NoisePrior(guide.noise, guide.noise_dof, guide.noise_from)
            study.set_user_attr(NOISE_PRIOR_ATTR, prior.to_json())
            self.observer.on_message(
                f"noise between runs before any repeat: {prior.noise:.1%} per reading, measured by {prior.source} "
                f"({prior.dof} degrees of freedom)"
            )
        existing = len(study.get_trials(deepcopy=False))
        if existing and self.guided is None:  # resumed: continue the sampler's sequence, not replay it
            study.sampler = plan.sampler(self.parallel, existing)
        recover_interrupted(study, self.space, self.observer.on_message)
        # the budget counts full-probe equivalents: a memory profile costs its share of a full probe
        probes_done = cost_of_trials(
            r.budget_attrs() for r in trial_records(study) if is_tracked(r) and r.status != "infra"
        )
        budget = settings.n_trials
        simulated = settings.simulated
        left = int(math.floor(budget - probes_done + 1e-9))  # whole full probes left
        if existing:  # the same command resumes a study: say so, and what it had spent, before it goes on
            self.observer.on_message(
                f"resuming the study in {self.run_dir}: {existing} trial(s) so far, {probes_done:.3g} of the "
                f"budget's {budget} full-probe equivalents spent"
            )
        plan.enqueue(study, ranking, left, simulated, self.guided is not None)
        refit = lambda: self.refits.refit  # noqa: E731 - the latest, read at each resolution
        self.resolver = TrialResolver(
            self.space,
            settings.request,
            self.objectives,
            simulated,
            self.guided,
            ranking,
            refit,
            self.cache,
            self.reuse_cache,
        )
        if self.cache is not None:
            self.listeners.append(ResultCacheListener(self.cache, self.resolver.cache_key, settings.request.study))
        if self.guided is not None:
            self.listeners.append(GuideEstimatesListener(self.guided))
        self.trials = TrialRunner(
            self.space,
            settings.request,
            self.objectives,
            self.run_dir,
            resolver=self.resolver,
            profiler=self.profiler,
            dispatcher=self.dispatcher,
            launcher=self.launcher,
            listeners=self.listeners,
            pruner=self.pruner,
            observer=self.observer,
            # the guide weighs the next memory profile at what this one cost
            on_profile_cost=self.guided.profile_cost_measured if self.guided is not None else None,
        )
        for listener in self.listeners:
            listener.study_started(study, ranking)
        self.observer.on_start(budget, int(round(probes_done)))
        seen = measured_configs(study)
        if not simulated:
            plan.check_placeable(self.dispatcher)
        deadline = time.monotonic() + settings.timeout_s if settings.timeout_s else None
        total = plan.valid_count(ranking)
        return study, LoopState(budget, probes_done, seen, total, deadline, done_before=probes_done)

    def _may_start(self, loop: LoopState) -> bool:
        return (
            len(loop.pending) < self.parallel
            and budget_fits_a_probe(loop)
            and loop.infra_in_a_row < MAX_INFRA_IN_A_ROW
            and not loop.infra_failure
        )

    # ---- helpers -----------------------------------------------------------------------------------
    def close(self) -> None:
        self.dispatcher.shutdown()

    def _search_ended(self, study: optuna.Study) -> None:
        """Every listener's last word on the trials (``TrialListener.search_ended``), interrupted or
        not; one that fails is logged, and the study's result is still read."""
        for listener in self.listeners:
            try:
                listener.search_ended(study)
            except Exception as exc:  # noqa: BLE001 - the result of what was measured comes first
                log.warning("%s could not finish: %s", type(listener).__name__, exc)

    def _refit_changed(self, refit: Refit) -> None:
        for listener in self.listeners:
            listener.refit_changed(refit)

    def _say_refit(self, refit: Refit, after: int) -> None:
        self.observer.on_message(
            f"refit after trial {after} ({refit.n} measured): {refit.describe()}; "
            f"model error {refit.mape_before:.0f} % -> {refit.mape_after:.0f} %"
        )
