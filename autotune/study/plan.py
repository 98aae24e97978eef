"""How a study is set up before its first trial: the sampler, the simulator's ranking of the space,
the plan queued from it (the baseline, the model's best bets), and the check that its trials can be
placed at all. Functions of the spec and the study.

The loop (:mod:`autotune.study.search`) never sees the spec (issue 43: narrow settings): the assembly
gives it a :class:`StudyPlan`, these functions bound to the spec, its space, its probe context and
its resolved objectives, which the loop calls once each (as Hydra's sweeper is given its launcher).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import optuna
from optuna.trial import TrialState

from ..dispatch.backends import least_trial_devices, trial_placement
from ..spec.context import ProbeContext
from ..guide.ranking import Ranking, rank_space
from ..sanity import is_finite_number as _finite
from ..spec.space import Space, SpaceTooLarge, config_key
from ..settings import Objectives
from ..spec.schema import Spec
from ..trial_attrs import ROOMIEST, UNDISTINGUISHED, A

__all__ = [
    "StudyPlan",
    "Unplaceable",
    "make_sampler",
    "rank_for_study",
    "enqueue_plan",
    "params_for",
    "predicted_of",
    "valid_count",
    "check_placeable",
]


class Unplaceable(RuntimeError):
    """No trial of the study can ever be placed on the cluster: refused before the first trial."""


def make_sampler(
    spec: Spec, space: Space, n_objectives: int, parallel: int, resumed_at: int = 0
) -> optuna.samplers.BaseSampler:
    """The spec's sampler. A resumed study (``resumed_at`` trials already in it) gets a seed
    derived from the spec's and that count: with the spec's own seed a seeded sampler would
    replay its earlier proposals, all measured already, and probe nothing new."""
    name = spec.search.sampler
    seed = spec.search.seed
    if seed is not None and resumed_at:
        seed = (seed * 1_000_003 + resumed_at) % 2**32
    if name in ("auto", "tpe"):
        return optuna.samplers.TPESampler(
            seed=seed,
            multivariate=True,
            constant_liar=parallel > 1,
            n_startup_trials=min(10, max(3, spec.search.n_trials // 4)),
        )
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


def rank_for_study(
    spec: Spec,
    space: Space,
    context: ProbeContext,
    run_dir: Path,
    say: Callable[[str], None],
    phase: Callable[[str], ContextManager[Any]] | None = None,
    objectives: Objectives | None = None,
) -> Ranking | None:
    """Whole-space simulator ranking when the space is small enough to enumerate. ``phase``
    keeps the user's status moving while a large space is enumerated and priced (``objectives``:
    the spec's, resolved, when the caller has them)."""
    if space.size > spec.search.exhaustive_limit:
        say(
            f"space of {space.size:,} combinations is above the exhaustive limit "
            f"({spec.search.exhaustive_limit:,}): sampling instead of ranking"
        )
        return None
    started = time.perf_counter()
    text = f"ranking the space with the simulator ({space.size:,} combinations)"
    if phase is None:
        say(text)
    with phase(text) if phase is not None else contextlib.nullcontext() as step:
        try:
            enumeration = space.enumerate()
        except SpaceTooLarge as exc:  # `run` refuses such a spec first (cli._refuse_empty)
            say(f"{exc}: sampling instead of ranking")
            return None
        if step is not None:
            step.update(f"pricing {enumeration.valid:,} valid configs")
        ranking = rank_space(enumeration, context, objectives if objectives is not None else _objectives(spec))
        ranking.write_csv(run_dir / "ranking.csv")
    say(
        f"ranked {enumeration.valid:,} valid configs, {ranking.fit:,} predicted to fit "
        f"({time.perf_counter() - started:.1f} s)"
    )
    return ranking


def enqueue_plan(
    study: optuna.Study,
    spec: Spec,
    space: Space,
    ranking: Ranking | None,
    budget_left: int,
    simulated: bool,
    guided: bool,
    objectives: Objectives | None = None,
) -> None:
    """Queue the baseline and, for ``sampler: auto``, the simulator's best bets (``objectives``:
    the spec's, resolved, when the caller has them).

    A resumed study already holds its plan (waiting trials) and gets no second one."""
    trials = study.get_trials(deepcopy=False)
    if any(t.state == TrialState.WAITING for t in trials):
        return
    already = {t.user_attrs.get(A.KEY) for t in trials}
    if spec.baseline and not any(t.user_attrs.get(A.BASELINE) for t in trials):
        params = params_for(space, spec.baseline)
        resolved = space.resolve({**params, **spec.baseline})
        study.enqueue_trial(
            params,
            user_attrs={
                A.BASELINE: True,
                A.CONFIG: resolved.config,
                A.KEY: resolved.key,
                A.CHOSEN: "baseline from the spec",
            },
        )
        already.add(resolved.key)
        budget_left -= 1
    if spec.search.sampler != "auto" or ranking is None or budget_left <= 0 or guided:
        return  # the guide proposes one config at a time, from what was measured
    # simulate: the top n configs are the study; real probes without a guide (several
    # objectives): the top half, then the sampler
    # one config per layout the model can tell apart: 20 trials are 20 layouts, not one
    # layout with 20 allocator settings the model prices the same
    objectives = objectives if objectives is not None else _objectives(spec)
    k = budget_left if simulated else max(1, math.ceil(budget_left / 2))
    queued = 0
    # the ranked rows of the configs already in the study (a layout with one of them is taken)
    taken = {i for i in (ranking.index_of(key) for key in already if key) if i is not None}
    for layout in ranking.layouts():  # taken one at a time: a huge ranking is read only as far as needed
        config, metrics = ranking.enumeration.configs[layout.index], ranking.metrics_of(layout.index)
        key = config_key(config)
        if key in already or any(j in taken for j in layout.members):
            continue
        why = f"rank {layout.rank} by model"
        if layout.undistinguished:
            why += f"; {UNDISTINGUISHED}{layout.undistinguished_text()}"
        if layout.roomiest:
            why += f"; {ROOMIEST}{layout.roomiest_text()}"
        study.enqueue_trial(
            params_for(space, config),
            user_attrs={A.CONFIG: config, A.KEY: key, A.PREDICTED: predicted_of(metrics, objectives), A.CHOSEN: why},
        )
        already.add(key)
        taken.add(layout.index)
        queued += 1
        if queued >= k:
            break


def params_for(space: Space, config: dict[str, Any]) -> dict[str, Any]:
    """The Optuna params (searched names only) of a config; unsearched names stay in the config."""
    params = {}
    for name, values in space.choices.items():
        if name in config and config[name] in values:
            params[name] = config[name]
        else:
            params[name] = values[0]
    return params


def predicted_of(metrics: dict[str, Any], objectives: Sequence[tuple[str, str]]) -> dict[str, float]:
    """The prediction kept with a trial: the metrics a user compares, and the step-time breakdown
    the refit (:mod:`autotune.guide.refit`) learns from."""
    keys = {m for m, _ in objectives} | {
        "step_time_s",
        "tokens_per_s_per_device",
        "mfu",
        "peak_memory_gib",
        "memory_headroom_gib",
        "ttft_ms",
        "decode_tokens_per_s",
    }
    return {k: float(v) for k, v in metrics.items() if (k in keys or k.startswith(("time_", "mem_"))) and _finite(v)}


def valid_count(spec: Spec, space: Space, ranking: Ranking | None) -> int | None:
    """Number of valid canonical configs, when the space is small enough to count."""
    if ranking is not None:
        return ranking.enumeration.valid
    if space.size <= min(spec.search.exhaustive_limit, 200_000):
        return space.enumerate().valid
    return None


def check_placeable(spec: Spec, dispatcher: Any) -> None:
    """Refuse a study no trial of which the cluster can ever place, before its first trial
    (every one would be ``invalid`` and the budget spent on nothing)."""
    devices = least_trial_devices(spec)
    placement = trial_placement(spec, devices)
    problem = dispatcher.placement_problem(**placement)
    if problem is not None:
        spread = f" over {placement['nodes']} nodes" if placement["nodes"] > 1 else ""
        raise Unplaceable(
            f"no trial of this study can be placed on the Ray cluster: {problem[1]}. Each trial needs "
            f"{devices} {spec.cluster.accelerator} device(s){spread} (the spec's cluster "
            "section): start the nodes it needs, or change the spec's cluster"
        )


def _objectives(spec: Spec) -> Objectives:
    from ..spec.resolve import objectives_of

    return objectives_of(spec)


class StudyPlan:
    """The study's set-up, bound to its spec: what the loop calls once, never reading the spec itself.

    Made by the assembly (:func:`autotune.cli.assembly.study_runner`) with the study's ``space``, probe
    ``context`` and resolved ``objectives``, the ones the loop's settings carry, so that the plan and
    the trials can never rank, queue and judge by different ones."""

    def __init__(self, spec: Spec, space: Space, context: ProbeContext, objectives: Objectives) -> None:
        self._spec = spec
        self.space, self.context, self.objectives = space, context, objectives

    def rank(
        self, run_dir: Path, say: Callable[[str], None], phase: Callable[[str], ContextManager[Any]] | None = None
    ) -> Ranking | None:
        """:func:`rank_for_study`."""
        return rank_for_study(self._spec, self.space, self.context, run_dir, say, phase, self.objectives)

    def sampler(self, parallel: int, resumed_at: int = 0) -> optuna.samplers.BaseSampler:
        """:func:`make_sampler`, for the study's objectives."""
        return make_sampler(self._spec, self.space, len(self.objectives), parallel, resumed_at)

    def open(self, run_dir: Path, sampler: optuna.samplers.BaseSampler) -> optuna.Study:
        """The study in its storage (:func:`autotune.study.storage.open_study`), created or resumed."""
        from .storage import open_study

        return open_study(self._spec, run_dir, sampler, objectives=self.objectives)

    def enqueue(
        self, study: optuna.Study, ranking: Ranking | None, budget_left: int, simulated: bool, guided: bool
    ) -> None:
        """:func:`enqueue_plan`."""
        enqueue_plan(study, self._spec, self.space, ranking, budget_left, simulated, guided, self.objectives)

    def memory_profiler(self, guided: Any) -> Any:
        """The study's memory profiler (:class:`autotune.study.profiling.MemoryProfiler`) over the guide ``guided``."""
        from .profiling import MemoryProfiler

        return MemoryProfiler(self._spec, guided)

    def check_placeable(self, dispatcher: Any) -> None:
        """:func:`check_placeable`."""
        check_placeable(self._spec, dispatcher)

    def valid_count(self, ranking: Ranking | None) -> int | None:
        """:func:`valid_count`."""
        return valid_count(self._spec, self.space, ranking)

    def result(self, study: optuna.Study) -> Any:
        """What the study found (:class:`autotune.study.result.StudyResult`), read once."""
        from .result import StudyResult

        return StudyResult.load(self._spec, study, self.objectives)
