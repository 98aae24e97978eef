"""A re-measurement runs the workload's warm-up and a few timed steps, not the whole probe.

Why: the race of the contenders, the drift check and a suspect reading's re-read measure a config
again to learn what a new launch reads: placement, the allocator's state, the machine, the noise
between runs (issue 44). A launch draws that noise whatever its length, so a re-measurement needs
the start-up and the warm-up (what makes a reading a steady-state one) and
``search.remeasure_steps`` (2) timed steps after them, not the workload's ``measured_steps`` (null:
all of them). At the workload's default (2 warm-up, 5 timed) and two timed steps, a
re-measurement is about 0.6 of a full probe, so the race takes 10 readings where it took 6 for the
budget share it is given (``search.confirm_budget``). What a shorter reading adds, the spread of
the steps inside a run, is measured with the noise: the study's noise is the spread of its
repeated readings, short ones included, and a short reading's own within-run interval (two steps
give one) raises its floor.
Two steps by default, not one and not the whole probe: on the search benchmark (benchmarks/README.md,
"Short re-measurements") at the same worlds, 1,080 studies a family, two steps took the 5 % noise
family from 87.8 % to 90.1 % within 3 % of the optimum (p 0.01), left the 2 % family where it was
(95.8 % / 96.1 % within 2 %) and the heavy-tailed one no lower, at fewer full-probe equivalents
in each, and its certificates were right 212 times in 218; one timed step bought more at 5 % noise
but made the certificate over-claim (74 of 79 right).

The trial is an ordinary :class:`TrialRequest` whose workload says fewer ``measured_steps``, as a
memory profile's does (:func:`autotune.guide.memory_profile.profile_request`): the torch and
MindSpore probes run it as it is; a ``command`` backend's launcher is told through
``{measured_steps}`` in its argv (and the ``AUTOTUNE_MEASURED_STEPS`` variable), and one whose argv
has no placeholder cannot be trusted to honour it, so its re-measurements stay full probes
(:func:`why_no_short_remeasure`). The budget counts a re-measurement's wall over a full probe's
(:func:`autotune.guide.memory_profile.full_probe_cost_fpe`), so a launcher that ran it in full
anyway costs what it ran.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping

from ..workers.protocol import TrialRequest
from .memory_profile import STARTUP_SHARE

__all__ = [
    "MEASURED_STEPS_ENV",
    "MEASURED_STEPS_PLACEHOLDER",
    "fill_measured_steps",
    "remeasure_cost_estimate",
    "remeasure_request",
    "remeasure_steps_of",
    "short_remeasure_steps",
    "why_full_remeasure",
    "why_full_remeasure_of",
    "why_no_short_remeasure",
]

MEASURED_STEPS_PLACEHOLDER = "{measured_steps}"  # a command backend's argv: the timed steps this trial runs
MEASURED_STEPS_ENV = "AUTOTUNE_MEASURED_STEPS"  # ... and the same number in its environment


def why_no_short_remeasure(backend_kind: str, argv: Iterable[Any] | None = None) -> str | None:
    """None when the backend runs the timed steps a trial's workload asks for, else why a
    re-measurement stays a full probe. ``argv``: a command backend's argv."""
    if backend_kind in ("torch", "mindspore"):
        return None  # the probes read the trial file's workload
    if backend_kind == "command":
        if any(MEASURED_STEPS_PLACEHOLDER in str(a) for a in (argv or [])):
            return None
        return (
            f"the command backend's argv has no {MEASURED_STEPS_PLACEHOLDER} placeholder, so its launcher may run "
            f"every step whatever the trial asks (add {MEASURED_STEPS_PLACEHOLDER} where it takes its step count)"
        )
    if backend_kind == "simulate":
        return "the simulator measures nothing"
    # the stack presets render their iterations from the spec's workload (backend.iterations), the serving
    # engines measure a rate, not steps
    return f"the {backend_kind} backend runs its own step count"


def why_full_remeasure(steps: int | None, workload: Mapping[str, Any], backend_kind: str, argv: Any) -> str | None:
    """Why a study that asked for short re-measurements (``steps``: ``search.remeasure_steps``)
    re-measures in full after all: the workload is not training, the backend cannot be told its
    steps, or the steps asked save none. None where they run, or where none were asked: the study
    says this once at its start, so that a setting which does nothing does not do it silently."""
    if not steps:
        return None
    if workload.get("kind", "train") != "train":
        return "a serving workload measures a rate, not timed steps"
    why = why_no_short_remeasure(backend_kind, argv)
    if why is not None:
        return why
    measured = int(workload.get("measured_steps") or 1)
    if int(steps) >= measured:
        return (
            f"search.remeasure_steps is {int(steps)}, not fewer than the workload's measured_steps ({measured}): "
            f"set it below {measured}"
        )
    return None


def short_remeasure_steps(steps: int | None, workload: Mapping[str, Any], backend_kind: str, argv: Any) -> int | None:
    """The timed steps a training re-measurement runs (``search.remeasure_steps``, fewer than the
    workload's ``measured_steps``), or None where it runs the full probe: the spec turned it off,
    or :func:`why_full_remeasure` says why not."""
    if not steps or why_full_remeasure(steps, workload, backend_kind, argv) is not None:
        return None
    return int(steps)


def remeasure_steps_of(spec: Any, backend_kind: str | None) -> int | None:
    """The timed steps a re-measurement of the study ``spec`` runs on ``backend_kind`` (None: a
    full probe, and where the backend is not named): :func:`short_remeasure_steps` of its settings."""
    if backend_kind is None:
        return None
    argv = getattr(spec.backend, "argv", None)
    return short_remeasure_steps(spec.search.remeasure_steps, spec.workload.model_dump(), backend_kind, argv)


def why_full_remeasure_of(spec: Any, backend_kind: str) -> str | None:
    """:func:`why_full_remeasure` of the study ``spec`` on ``backend_kind``, where it is worth saying:
    always where the spec sets ``search.remeasure_steps``; at the default, only where the user can
    act on it (a command backend's launcher not told its steps), not for a stack preset or a
    serving study, which have nothing to change."""
    argv = getattr(spec.backend, "argv", None)
    why = why_full_remeasure(spec.search.remeasure_steps, spec.workload.model_dump(), backend_kind, argv)
    if why is None or "remeasure_steps" in spec.search.model_fields_set:
        return why
    return why if backend_kind == "command" and spec.workload.kind == "train" else None


def remeasure_request(request: TrialRequest, steps: int) -> TrialRequest:
    """The trial's probe with ``steps`` timed steps after the workload's warm-up."""
    if steps < 1:
        raise ValueError(f"a re-measurement needs at least one timed step, got {steps}")
    short = copy.deepcopy(request)
    short.workload["measured_steps"] = int(steps)
    return short


def remeasure_cost_estimate(workload: Mapping[str, Any], steps: int | None) -> float:
    """What a re-measurement of ``steps`` timed steps costs in full-probe equivalents, before one
    has run: the start-up (``memory_profile.STARTUP_SHARE``, as a profile's is weighed), and its share
    of the steps (1 where it runs the full probe); the budget counts the measured walls."""
    if not steps:
        return 1.0
    warmup = int(workload.get("warmup_steps") or 0)
    measured = int(workload.get("measured_steps") or 1)
    if steps >= measured:
        return 1.0
    return STARTUP_SHARE + (1.0 - STARTUP_SHARE) * (warmup + steps) / (warmup + measured)


def fill_measured_steps(args: Iterable[Any], workload: Mapping[str, Any]) -> list[str]:
    """A launcher's arguments with ``{measured_steps}`` replaced by the timed steps this trial runs."""
    steps = str(int(workload.get("measured_steps") or 1))
    return [str(a).replace(MEASURED_STEPS_PLACEHOLDER, steps) for a in args]
