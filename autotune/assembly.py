"""What the CLI assembles for a study before the loop runs it: the dispatcher that runs its probes
and the launcher that turns a trial into its probe's launch.

Like Hydra's Optuna sweeper, the search loop never chooses these (:class:`autotune.search.StudyRunner`
is given them): a simulated study runs the analytical model in the driver; real probes run as local
process groups without Ray (``ray.enabled: false``), or as Ray tasks on the cluster the spec names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from autotune.workers.protocol import TrialRequest

from .backends import BackendChoice, launch_for
from .spec import Spec

__all__ = ["dispatcher_for", "launcher_for", "tracking_for"]


def dispatcher_for(spec: Spec, backend: BackendChoice, run_dir: Path) -> Any:
    from . import dispatch

    if backend.simulated:
        from autotune.workers.simulate import simulate_trial

        return dispatch.InProcessDispatcher(simulate_trial)
    if not spec.ray.enabled:
        return dispatch.LocalProcessDispatcher(max_parallel=spec.search.parallel_trials)
    from .ray_dispatch import RayDispatcher

    return RayDispatcher(address=spec.ray.address, num_cpus=spec.ray.num_cpus, resources=None, run_dir=run_dir)


def tracking_for(tracker: Any, spec: Spec, backend: BackendChoice, run_dir: Path) -> Any:
    """The study's MLflow listener (:class:`autotune.study_tracking.StudyTracking`) over ``tracker``
    (an open :class:`autotune.tracking.Tracker`), None without one: built here, handed to the loop."""
    if tracker is None:
        return None
    from .space import Space
    from .study_tracking import StudyTracking

    parallel = 1 if backend.simulated else spec.search.parallel_trials
    return StudyTracking(tracker, spec, backend, run_dir, parallel=parallel, space_size=Space(spec).size)


def launcher_for(spec: Spec, backend: BackendChoice) -> Callable[[TrialRequest], Any]:
    """A trial request -> its probe's launch (None for the simulator, which runs in the driver)."""
    if backend.simulated:
        return lambda request: None
    return lambda request: launch_for(spec, backend, request)
