"""The search loop: an Optuna study driven by ask/tell, feeding trials to a dispatcher.

Why ask/tell rather than ``study.optimize``: trials run as separate processes on remote devices,
several at once, and a failure (OOM, timeout) is information for the sampler, not an exception.
Like Optuna's ``study/_optimize.py``, one trial is one path, read top to bottom in
:mod:`autotune.trial_run` (ask -> resolve -> [memory profile -> verdict] -> dispatch -> interpret
-> tell -> notify the listeners); this loop only starts trials, hands back what the dispatcher
returned, and stops: the stop conditions are a flat list of small named checks. The loop is given
its dispatcher and launcher (the CLI assembles them, :mod:`autotune.assembly`); it never chooses
them.

Guarantees, all backed by Optuna storage: resumable (a killed run's trials re-queued,
:mod:`autotune.requeue`); no config probed twice (a repeat answered from the earlier result);
infeasibility reaches the sampler (``trial.set_constraint("feasible", > 0)``); a simulated result
is never a measured one (``autotune.source``).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import optuna

from autotune.workers.protocol import TrialRequest

from .backends import BackendChoice
from .context import ProbeContext, probe_context
from .guided_sampler import GuidedSampler
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
from .memory_profile import cost_of_trials
from .profiling import MemoryProfiler
from .pruning import LoserPruner
from .ranking import Ranking
from .records import is_tracked, measured_configs, trial_records
from .refit import Refit
from .requeue import recover_interrupted
from .space import Space
from .spec import Spec
from .storage import open_study, study_storage
from .study_definition import record_definition
from .usable_memory import USABLE_ATTR
from .study_plan import Unplaceable, check_placeable, enqueue_plan, make_sampler, rank_for_study, valid_count
from .study_result import StudyOutcome, StudyResult
from .stop_conditions import (
    MAX_INFRA_IN_A_ROW,
    LoopState,
    deadline_reached,
    guide_says_stop,
    sampler_stuck,
    space_exhausted,
)
from .trial_attrs import A
from .trial_resolve import TrialResolver
from .trial_run import TrialRunner

__all__ = [
    "StudyRunner",
    "SearchObserver",
    "StudyOutcome",
    "ALREADY_COMPLETE",
    "Unplaceable",
    "open_study",
    "study_storage",
    "make_sampler",
    "A",
]

log = logging.getLogger(__name__)

# the stop reason of a run that found the study's budget already spent
ALREADY_COMPLETE = (
    "already complete, nothing run: earlier runs spent the budget (search.n_trials); raise it to measure more, "
    "or --fresh-study to start over"
)


class StudyRunner:
    """Runs one study to its budget with the ``dispatcher`` (and ``launcher``: a trial request ->
    the launch of its probe, None for an in-process dispatcher) it is given, and the study's MLflow
    listener ``tracking`` (:func:`autotune.assembly.tracking_for`; None in tests and with
    ``--no-tracking``): the loop tells it what it tells every listener and imports no tracking module."""

    def __init__(
        self,
        spec: Spec,
        run_dir: Path,
        backend: BackendChoice,
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
        self.spec, self.run_dir, self.backend = spec, run_dir, backend
        self.dispatcher, self.launcher = dispatcher, launcher
        self.definition = definition  # what defines the study (study_definition), kept on it when created
        self.usable_memory = usable_memory  # what the device check said (autotune.usable_memory), kept on it
        # a signal whose handler's exception Python swallowed (raised inside a garbage-collection
        # callback, "Exception ignored in ...") still stops the loop: the CLI's flag, checked here
        self.stop_requested = stop_requested or (lambda: False)
        self.observer = observer or _Quiet()
        self.space = Space(spec)
        self.context: ProbeContext = probe_context(spec)
        self.objectives = spec.objective_list()
        self.parallel = 1 if backend.simulated else spec.search.parallel_trials
        self.cache = None if backend.simulated else cache  # real probes' results across studies (autotune.cache)
        self.reuse_cache = reuse_cache
        self.ranking: Ranking | None = None
        self.guided: GuidedSampler | None = None  # sampler auto on real probes: model-guided proposals
        self.resolver: TrialResolver | None = None
        # what observes each finished trial, in this order: MLflow, the model's refit, the guide
        self.tracking = tracking  # MLflow (autotune.study_tracking), built by the assembly; None: untracked
        self.refits = RefitListener(
            bool(self.context.hardware.get("calibrated_at")), on_moved=self._say_refit, on_refit=self._refit_changed
        )
        self.listeners: list[TrialListener] = [x for x in (self.tracking, self.refits) if x is not None]
        self.pruner = LoserPruner(spec, backend.simulated)
        self.profiler: MemoryProfiler | None = None  # profile-then-probe (autotune.profiling), set in _open
        self.trials: TrialRunner | None = None  # each trial, ask to listeners (autotune.trial_run), set in _open
        # checked, in order, before each proposal: the first that answers stops asking
        self.stop_checks: list[Callable[[optuna.Study, LoopState], str | None]] = [
            deadline_reached,
            space_exhausted,
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
        and says so (:data:`ALREADY_COMPLETE`)."""
        study, loop = self._open()
        try:
            while True:
                if self.stop_requested():
                    raise KeyboardInterrupt
                if not loop.pending and (why := self._infrastructure_stop(loop)):
                    loop.stopped = why
                    break
                while self._may_start(loop):
                    why = next((w for check in self.stop_checks if (w := check(study, loop))), None)
                    if why:
                        loop.stopped = why
                        break
                    self.trials.start(study, loop)
                if not loop.pending:
                    if loop.started >= loop.budget:
                        loop.stopped = ALREADY_COMPLETE if loop.done_before >= loop.budget else "budget reached"
                    break
                for handle, result in self.dispatcher.wait_any(timeout=0.25):
                    self.trials.returned(study, loop, handle, result)
                    if self.stop_requested():
                        raise KeyboardInterrupt
                d = self.dispatcher
                full = self.trials.full_probes(loop)  # a memory profile is not pruned
                self.pruner.prune(d.step_events(), full, lambda: self.trials.best(study), d.cancel)
        except KeyboardInterrupt:
            loop.stopped = "interrupted by the user"
            for handle in list(loop.pending):
                self.dispatcher.cancel(handle)
            raise
        # once, for every output (report, MLflow, plots): the model's over the whole feasible space
        # when the trials are its predictions, fANOVA over the measured trials otherwise
        record_importances(study, self.objectives, self.ranking if self.backend.simulated else None)
        parent = getattr(self.tracking, "parent_run_id", None)
        result = StudyResult.load(self.spec, study)
        return StudyOutcome(study, result, self.ranking, loop.started, loop.stopped, parent, loop.infra_failure)

    def _open(self) -> tuple[optuna.Study, LoopState]:
        """Rank the space, open (or resume) the study, recover and plan; start the listeners."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.search.sampler == "auto":
            self.ranking = rank_for_study(
                self.spec,
                self.space,
                self.context,
                self.run_dir,
                self.observer.on_message,
                phase=lambda text: observer_phase(self.observer, text),
            )
        ranking = self.ranking
        if ranking is not None and not self.backend.simulated and len(self.objectives) == 1 and ranking.order.size:
            self.guided = GuidedSampler.from_spec(self.spec, space=self.space, ranking=ranking)
        self.profiler = MemoryProfiler(self.spec, self.guided)
        if self.guided is not None and not self.profiler.available and self.spec.search.memory_profiles:
            self.observer.on_message(f"memory profiles off: {self.profiler.why_not}")
        sampler = self.guided or make_sampler(self.spec, self.space, len(self.objectives), self.parallel)
        study = open_study(self.spec, self.run_dir, sampler)
        if self.definition is not None:
            record_definition(study, self.definition)
        if self.usable_memory:
            study.set_user_attr(USABLE_ATTR, self.usable_memory)
        existing = len(study.get_trials(deepcopy=False))
        if existing and self.guided is None:  # resumed: continue the sampler's sequence, not replay it
            study.sampler = make_sampler(self.spec, self.space, len(self.objectives), self.parallel, existing)
        recover_interrupted(study, self.space, self.observer.on_message)
        # the budget counts full-probe equivalents: a memory profile costs its share of a full probe
        probes_done = cost_of_trials(
            r.budget_attrs() for r in trial_records(study) if is_tracked(r) and r.status != "infra"
        )
        budget = self.spec.search.n_trials
        simulated = self.backend.simulated
        left = int(math.floor(budget - probes_done + 1e-9))  # whole full probes left
        enqueue_plan(study, self.spec, self.space, ranking, left, simulated, self.guided is not None)
        refit = lambda: self.refits.refit  # noqa: E731 - the latest, read at each resolution
        self.resolver = TrialResolver(
            self.spec, self.space, self.context, simulated, self.guided, ranking, refit, self.cache, self.reuse_cache
        )
        if self.cache is not None:
            self.listeners.append(ResultCacheListener(self.cache, self.resolver.cache_key, self.spec.name))
        if self.guided is not None:
            self.listeners.append(GuideEstimatesListener(self.guided))
        self.trials = TrialRunner(
            self.spec,
            self.space,
            self.context,
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
        if not self.backend.simulated:
            check_placeable(self.spec, self.dispatcher)
        deadline = time.monotonic() + self.spec.search.timeout_s if self.spec.search.timeout_s else None
        total = valid_count(self.spec, self.space, ranking)
        return study, LoopState(budget, probes_done, seen, total, deadline, done_before=probes_done)

    def _may_start(self, loop: LoopState) -> bool:
        return (
            len(loop.pending) < self.parallel
            and loop.started < loop.budget
            and loop.infra_in_a_row < MAX_INFRA_IN_A_ROW
            and not loop.infra_failure
        )

    # ---- stop conditions ---------------------------------------------------------------------------
    def _infrastructure_stop(self, loop: LoopState) -> str | None:
        if loop.infra_failure:
            return loop.infra_failure
        if loop.infra_in_a_row >= MAX_INFRA_IN_A_ROW:
            loop.infra_failure = (
                f"the infrastructure failed {loop.infra_in_a_row} trials in a row (see their "
                "reasons): fix the cluster and run the same command to resume"
            )
            return loop.infra_failure
        return None

    # ---- helpers -----------------------------------------------------------------------------------
    def close(self) -> None:
        self.dispatcher.shutdown()

    def _refit_changed(self, refit: Refit) -> None:
        for listener in self.listeners:
            listener.refit_changed(refit)

    def _say_refit(self, refit: Refit, after: int) -> None:
        self.observer.on_message(
            f"refit after trial {after} ({refit.n} measured): {refit.describe()}; "
            f"model error {refit.mape_before:.0f} % -> {refit.mape_after:.0f} %"
        )
