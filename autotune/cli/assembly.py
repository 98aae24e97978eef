"""The study's assembly: what a study is given before the loop runs it, built from the spec.

Like Hydra's Optuna sweeper, the search loop never builds or chooses its launcher
(:class:`autotune.study.search.StudyRunner` is given them): this module takes the shared study's lease,
checks that the spec still defines the study kept in the run directory, puts the spec on the
profile it ranks with (measured on this host for a real study), and builds the dispatcher that
runs the probes (the analytical model in the driver; local process groups without Ray,
``ray.enabled: false``; or Ray tasks on the cluster the spec names), the launcher that turns a
trial into its probe's launch, the MLflow tracking listener, the result cache and the runner.

Nothing past this module reads the spec for the loop (issue 43: narrow settings): the loop, the
guide, the pruner, the dispatcher and the probes' request builder each get a small frozen settings
object made here once (:func:`loop_settings`, :func:`dispatch_settings`; the request builder's and
the guide's through :mod:`autotune.spec.resolve`), the objectives resolved once and carried by
them, and the loop's set-up bound to the spec (:class:`autotune.study.plan.StudyPlan`).

It decides and builds; it prints nothing itself. What a user must be told (its errors among
them, said where they happen: inside the phase that failed) goes through the :class:`Voice` the
CLI gives it; a study that cannot be assembled then raises :class:`AssemblyFailed`, which says
whether the input (exit 2) or the infrastructure (exit 3) is to blame.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

from autotune.workers.protocol import TrialRequest

from ..dispatch.backends import BackendChoice, launch_for
from ..dispatch.dispatcher import DispatchSettings
from ..spec.schema import Spec
from ..spec.errors import escape_text

__all__ = [
    "AssemblyFailed",
    "AssembledStudy",
    "Voice",
    "assemble_study",
    "check_definition",
    "dispatch_settings",
    "dispatcher_for",
    "launcher_for",
    "loop_settings",
    "lease_shared_study",
    "measured_profile",
    "open_tracker",
    "planned_profile",
    "relocate_mlflow",
    "study_runner",
    "tracking_for",
]

log = logging.getLogger("autotune")


class AssemblyFailed(Exception):
    """The study cannot be assembled, and the user has been told why (:meth:`Voice.fail`):
    ``infrastructure`` says whether Ray, MLflow or the storage (exit 3) or the input (exit 2) is
    to blame."""

    def __init__(self, message: str, *, infrastructure: bool) -> None:
        super().__init__(message)
        self.infrastructure = infrastructure


@dataclass(frozen=True)
class Voice:
    """How a stage tells the user what they must know, the CLI deciding how it is shown: ``say`` a
    line, ``note`` a line of lesser weight, ``warn`` a warning, ``error`` an error, ``phase`` a
    moving status around a wait of seconds (:func:`autotune.tracking.progress.phase`)."""

    say: Callable[[str], None]
    note: Callable[[str], None]
    warn: Callable[[str], None]
    error: Callable[[str], None]
    phase: Callable[[str], ContextManager[Any]]

    def fail(self, message: str, *, infrastructure: bool, details: Sequence[str] = ()) -> AssemblyFailed:
        """Say ``message`` as an error (``details`` as lines after it); the exception to raise."""
        self.error(message)
        for line in details:
            self.say(line)
        return AssemblyFailed(message, infrastructure=infrastructure)


@dataclass
class AssembledStudy:
    """The spec the study runs (on its measured profile, its usable memory), and its runner."""

    spec: Spec
    runner: Any  # autotune.study.search.StudyRunner


def dispatch_settings(spec: Spec, backend: BackendChoice) -> DispatchSettings:
    """The dispatcher's settings (:class:`autotune.dispatch.dispatcher.DispatchSettings`) from the spec."""
    return DispatchSettings(
        simulated=backend.simulated,
        use_ray=spec.ray.enabled,
        ray_address=spec.ray.address,
        ray_num_cpus=spec.ray.num_cpus,
        max_parallel=spec.search.parallel_trials,
    )


def dispatcher_for(spec: Spec, backend: BackendChoice, run_dir: Path) -> Any:
    """The study's dispatcher: the simulator in the driver, local process groups, or Ray tasks."""
    return make_dispatcher(dispatch_settings(spec, backend), run_dir)


def make_dispatcher(settings: DispatchSettings, run_dir: Path) -> Any:
    """The dispatcher ``settings`` ask for."""
    from ..dispatch import dispatcher as dispatch

    if settings.simulated:
        from autotune.workers.simulate import simulate_trial

        return dispatch.InProcessDispatcher(simulate_trial)
    if not settings.use_ray:
        return dispatch.LocalProcessDispatcher.from_settings(settings)
    from ..dispatch.ray_dispatch import RayDispatcher

    return RayDispatcher.from_settings(settings, run_dir)


def loop_settings(spec: Spec, backend: BackendChoice, context: Any = None) -> Any:
    """The loop's settings (:class:`autotune.study.search.LoopSettings`), made once from the spec, the
    objectives resolved (``context``: the study's probe context, when made already)."""
    from ..study.pruning import PruneSettings
    from ..study.search import LoopSettings
    from ..guide.spec_settings import guide_settings
    from ..guide.short_remeasure import remeasure_steps_of, why_full_remeasure_of
    from ..spec.resolve import objectives_of, probe_context, request_settings

    context = context if context is not None else probe_context(spec, backend.kind)
    remeasure_steps = remeasure_steps_of(spec, backend.kind)  # the race's readings and the request's steps
    sp = spec.search
    return LoopSettings(
        objectives=objectives_of(spec),
        simulated=backend.simulated,
        n_trials=sp.n_trials,
        timeout_s=sp.timeout_s,
        parallel=1 if backend.simulated else sp.parallel_trials,
        rank_first=sp.sampler == "auto",
        memory_profiles=sp.memory_profiles,
        seed=sp.seed,
        guide=guide_settings(spec, context, remeasure_steps),
        prune=PruneSettings(prune=sp.prune, prune_margin=sp.prune_margin, prune_min_steps=sp.prune_min_steps),
        request=request_settings(spec, context, remeasure_steps),
        # a simulated study predicts the target directly (it has no slice): nothing to confirm
        confirm_top=0 if backend.simulated or not spec.cluster.probe_slice else spec.cluster.confirm_top,
        full_remeasure_why=why_full_remeasure_of(spec, backend.kind),
    )


def study_runner(spec: Spec, run_dir: Path, backend: BackendChoice, **kwargs: Any) -> Any:
    """The study's runner (:class:`autotune.study.search.StudyRunner`): its settings and its plan made
    from ``spec`` here, once; ``kwargs`` as the runner takes them (``dispatcher`` first)."""
    from ..study.search import StudyRunner
    from ..spec.space import Space
    from ..study.plan import StudyPlan
    from ..spec.resolve import probe_context

    context = probe_context(spec, backend.kind)
    settings = loop_settings(spec, backend, context)
    plan = StudyPlan(spec, Space(spec), context, settings.objectives)
    return StudyRunner(settings, plan, run_dir, **kwargs)


def tracking_for(tracker: Any, spec: Spec, backend: BackendChoice, run_dir: Path, objectives: Any = None) -> Any:
    """The study's MLflow listener (:class:`autotune.tracking.study_tracking.StudyTracking`) over ``tracker``
    (an open :class:`autotune.tracking.tracker.Tracker`), None without one: built here, handed to the loop
    (``objectives``: the study's, resolved, when at hand)."""
    if tracker is None:
        return None
    from ..spec.space import Space
    from ..tracking.study_tracking import StudyTracking

    parallel = 1 if backend.simulated else spec.search.parallel_trials
    return StudyTracking(
        tracker, spec, backend, run_dir, parallel=parallel, space_size=Space(spec).size, objectives=objectives
    )


def launcher_for(spec: Spec, backend: BackendChoice) -> Callable[[TrialRequest], Any]:
    """A trial request -> its probe's launch (None for the simulator, which runs in the driver)."""
    if backend.simulated:
        return lambda request: None
    return lambda request: launch_for(spec, backend, request)


def lease_shared_study(spec: Spec, directory: Path, voice: Voice) -> Any:
    """The lease of a study in a shared database (:func:`.run_lock.lease_shared_study`), taken before
    the spec check, so that a second driver is refused before it can set the live study aside."""
    from ..study.run_lock import StudyInUse, lease_shared_study as lease
    from ..study.storage import StorageDamaged

    try:
        return lease(spec, directory)
    except (StudyInUse, StorageDamaged) as exc:
        raise voice.fail(str(exc), infrastructure=True) from None


def check_definition(
    spec: Spec, spec_path: Path, directory: Path, defined_as: dict[str, Any], fresh: bool, voice: Voice
) -> None:
    """Refuse to resume a study whose defining sections the spec has changed, naming the fields;
    with ``fresh``, say that the old study was set aside (:mod:`.study_definition`)."""
    from ..study.storage import StorageDamaged
    from ..study.definition import StudyRedefined, redefinition

    try:
        aside = redefinition(spec, directory, defined_as, fresh)
    except StorageDamaged as exc:
        raise voice.fail(str(exc), infrastructure=True) from None
    except StudyRedefined as exc:
        raise voice.fail(
            f"{escape_text(str(spec_path))}: the spec changed what defines the study {spec.name!r} kept in {directory} "
            f"({exc.trials} trial(s) measured under the old definition):",
            infrastructure=False,
            details=[
                *(f"  {line}" for line in exc.changes),
                "resuming would mix trials of two different studies. Either start it in a new directory "
                "(--run-dir NEW_DIR), or start a fresh study in this one with --fresh-study (the old study is "
                "kept in the same storage under another name, its trial folders under superseded-*/; nothing "
                "is deleted); or undo the edit to resume the old study.",
            ],
        ) from None
    if aside is not None:
        name, changes = aside
        voice.note(
            f"--fresh-study: the earlier study ({len(changes)} change(s): {'; '.join(changes[:3])}) is kept as "
            f"{name!r} in the same storage; starting a new study {spec.name!r}"
        )


def measured_profile(spec: Spec, choice: BackendChoice, voice: Voice) -> Spec:
    """The spec on this host's measured profile when a real study would otherwise rank with
    data-sheet figures (``host_profile``: calibrates once, cached per host and software)."""
    from ..study.host_profile import ensure_measured_profile

    try:
        return ensure_measured_profile(spec, choice.simulated, voice.note, voice.phase)
    except ConnectionError as exc:  # the Ray cluster does not answer (dispatch.RayUnreachable)
        raise voice.fail(str(exc), infrastructure=True) from None
    except ValueError as exc:  # AUTOTUNE_CALIBRATE set to something else than auto / never
        raise voice.fail(str(exc), infrastructure=False) from None


def planned_profile(spec: Spec, voice: Voice) -> tuple[Spec, dict[str, Any]]:
    """The spec on the profile ``plan`` ranks with (the one a run of it would use), and what it is."""
    from ..dispatch.backends import select_backend
    from ..study.host_profile import planned_profile as planned

    try:
        simulated = select_backend(spec).simulated
    except ValueError:  # a backend the run would refuse: plan still ranks, with the spec's profile
        simulated = True
    try:
        return planned(spec, simulated)
    except ValueError as exc:
        raise voice.fail(str(exc), infrastructure=False) from None


def relocate_mlflow(directory: Path, note: Callable[[str], None]) -> None:
    """A moved run directory's own MLflow store, pointed at its new place (and said)."""
    from ..tracking.tracker import relocate_artifacts

    try:
        moved = relocate_artifacts(directory)
    except Exception as exc:  # a store in use, or not MLflow's: browsing may miss artifacts, nothing else
        log.debug("MLflow artifact paths not checked: %s", exc)
        return
    if moved:
        note(moved)


def open_tracker(spec: Spec, directory: Path, voice: Voice) -> Any:
    """The study's MLflow store (:class:`autotune.tracking.tracker.Tracker`): the spec's server, else the
    run directory's own store (pointed at its place first, for a study whose directory moved)."""
    from ..tracking.tracker import Tracker, default_tracking_uri, error_line

    uri = spec.tracking.mlflow_uri or default_tracking_uri(directory)
    if not spec.tracking.mlflow_uri:
        relocate_mlflow(directory, voice.note)  # a resumed study whose run directory was moved
    if uri.startswith(("http://", "https://")):
        voice.say(f"connecting to MLflow at {uri} ...")
    try:
        return Tracker(uri, spec.tracking.experiment or spec.name, directory / "mlartifacts")
    except Exception as exc:
        raise voice.fail(
            f"cannot open the MLflow store {uri} (tracking.mlflow_uri): {error_line(exc, 300)}. Start the server or "
            "fix the URI; or run with --no-tracking and run the same command again once it answers: the trials "
            "measured meanwhile are logged then, and nothing is probed twice",
            infrastructure=True,
        ) from None


def assemble_study(
    spec: Spec,
    directory: Path,
    choice: BackendChoice,
    defined_as: dict[str, Any],
    voice: Voice,
    *,
    observer: Callable[[], Any],
    no_tracking: bool,
    reuse_cache: bool,
    stop_requested: Callable[[], bool],
) -> AssembledStudy:
    """The study's runner, given its dispatcher, launcher, tracking listener, progress observer
    (``observer()`` makes it: its clock starts once the study is set up) and result cache; the spec
    on its measured profile and usable memory. Raises :class:`AssemblyFailed`."""
    from ..spec.space import Space
    from ..study.search import StudyRunner
    from ..study.plan import StudyPlan
    from ..spec.resolve import probe_context
    from ..study.usable_memory import with_usable_memory

    spec = measured_profile(spec, choice, voice)
    spec, usable_memory = with_usable_memory(spec, choice.simulated, voice.note)
    space = Space(spec)  # a layout the probe slice cannot hold stays outside it, simulated or not (as `plan` says)
    if spec.cluster.probe_slice:
        if choice.simulated:  # the model predicts the target size directly: no slice to project from
            voice.note(
                f"cluster.probe_nodes {spec.cluster.probe_nodes}: the simulator predicts the target's "
                f"{spec.cluster.nodes} nodes directly, over the layouts the slice can run"
            )
            spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"probe_nodes": None})})
        else:
            voice.note(
                f"probes run on {spec.cluster.probe_nodes} of the target's {spec.cluster.nodes} nodes "
                "(cluster.probe_nodes); each measurement is projected to the target by the calibrated model"
            )
    try:
        # a real backend's dispatcher starts (or joins) Ray: seconds; the simulator's is in-process
        with voice.phase("starting the trials' dispatcher") if not choice.simulated else contextlib.nullcontext():
            dispatcher = dispatcher_for(spec, choice, directory)
    except ConnectionError as exc:  # dispatch.RayUnreachable: its message names the address
        raise voice.fail(str(exc), infrastructure=True) from None
    except Exception as exc:  # Ray would not start: say what failed, keep the traceback for -v
        log.debug("dispatcher failed", exc_info=True)
        raise voice.fail(
            f"cannot start the trials' dispatcher: {type(exc).__name__}: {exc}", infrastructure=True
        ) from None
    tracker = None
    if not no_tracking:
        with voice.phase("opening the MLflow store"):
            tracker = open_tracker(spec, directory, voice)
    progress = observer()
    cache: Optional[Any] = None
    if not choice.simulated:
        from ..study.cache import ResultCache

        try:
            cache = ResultCache()
        except Exception as exc:  # an unwritable home: run without the cache, and say so
            voice.warn(f"result cache unavailable ({exc}); set AUTOTUNE_CACHE to a writable file")
    context = probe_context(spec, choice.kind)  # the spec on its measured profile and usable memory: made once, here
    settings = loop_settings(spec, choice, context)
    runner = StudyRunner(
        settings,
        StudyPlan(spec, space, context, settings.objectives),
        directory,
        dispatcher=dispatcher,
        launcher=launcher_for(spec, choice),
        tracking=tracking_for(tracker, spec, choice, directory, settings.objectives),
        observer=progress,
        cache=cache,
        reuse_cache=reuse_cache,
        stop_requested=stop_requested,
        definition=defined_as,
        usable_memory=usable_memory or None,
    )
    return AssembledStudy(spec, runner)
