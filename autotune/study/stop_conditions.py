"""When the search loop stops asking for trials: the state of one run of the loop, and the checks
made before each proposal (the first that answers stops the asking; the running trials finish).
The infrastructure's failures (a node lost, trials failed on it in a row) are checked by the loop
itself first, since they stop the study with exit 3.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.trial import TrialState

__all__ = [
    "ALREADY_COMPLETE",
    "LoopState",
    "MAX_INFRA_IN_A_ROW",
    "budget_fits_a_probe",
    "budget_stop",
    "infrastructure_stop",
    "MAX_MISSES",
    "deadline_reached",
    "space_exhausted",
    "sampler_stuck",
    "guide_says_stop",
]

MAX_INFRA_IN_A_ROW = 3  # then the cluster, not the configs, is the problem: stop and say so
MAX_MISSES = 200  # proposals in a row answered without a probe (rejected or repeats): the sampler is stuck

# the stop reason of a run that found the study's budget already spent
ALREADY_COMPLETE = (
    "already complete, nothing run: earlier runs spent the budget (search.n_trials); raise it to measure more, "
    "or --fresh-study to start over"
)


@dataclass
class LoopState:
    """The state of one run of the loop."""

    budget: int
    started: float  # full-probe equivalents counted against the budget (an infrastructure failure is not
    # one; a memory profile counts its share of a full probe: autotune.guide.memory_profile.cost_of_trials)
    seen: dict[str, int]  # canonical config -> the trial that measured it
    total_valid: int | None
    deadline: float | None
    pending: dict[Any, tuple[optuna.Trial, dict[str, Any]]] = field(default_factory=dict)
    misses: int = 0
    infra_in_a_row: int = 0
    stopped: str = "budget reached"
    done_before: float = 0.0  # full-probe equivalents earlier runs of the study spent (a resumed study)
    infra_failure: str | None = None  # set when the cluster lost capacity (or failed trials in a row)
    confirming: bool = False  # running a slice study's confirmations at full size: no stop check applies
    in_flight: dict[int, float] = field(default_factory=dict)  # trial -> what ``started`` counts of it so far


DEADLINE_REACHED = "search timeout reached"


def deadline_reached(study: optuna.Study, loop: LoopState) -> str | None:
    """``search.timeout_s`` has passed."""
    return DEADLINE_REACHED if loop.deadline and time.monotonic() > loop.deadline else None


def space_exhausted(study: optuna.Study, loop: LoopState) -> str | None:
    """Every valid config of a countable space has been probed."""
    if loop.total_valid is not None and len(loop.seen) >= loop.total_valid:
        return f"every valid config of the space ({loop.total_valid}) has been probed"
    return None


def sampler_stuck(study: optuna.Study, loop: LoopState) -> str | None:
    """The sampler keeps proposing configs answered without a probe."""
    if loop.misses >= MAX_MISSES:
        return f"the sampler proposed only rejected or already measured configs {MAX_MISSES} times in a row"
    return None


def guide_says_stop(guide: Any, study: optuna.Study) -> str | None:
    """The guide's stopping rule (nothing is left that could beat the best, by its model), once its
    queued plan has run."""
    if guide is None or study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        return None
    why = guide.stop_reason(study)
    return f"stopped early: {why}" if why else None


def infrastructure_stop(loop: LoopState) -> str | None:
    """The cluster lost capacity, or failed :data:`MAX_INFRA_IN_A_ROW` trials in a row: checked by the
    loop before anything else, with nothing in flight (the study ends with exit 3)."""
    if loop.infra_failure:
        return loop.infra_failure
    if loop.infra_in_a_row >= MAX_INFRA_IN_A_ROW:
        loop.infra_failure = (
            f"the infrastructure failed {loop.infra_in_a_row} trials in a row (see their "
            "reasons): fix the cluster and run the same command to resume"
        )
        return loop.infra_failure
    return None


def budget_fits_a_probe(loop: LoopState) -> bool:
    """Whether what is left of the budget pays for one more full probe. A trial starts only then:
    one started with a fraction left (after memory profiles, OOMs or re-measurements that cost
    less than a whole probe) would spend past ``search.n_trials``, the figure the user set, and
    its reading would come after the budget a benchmark judges the study by."""
    return loop.started + 1.0 <= loop.budget + 1e-9


def budget_stop(loop: LoopState) -> str:
    """Why a loop with nothing in flight and its budget started stops: spent now, or by earlier runs;
    where less than a full probe is left, how much (unspent: another probe would overspend it)."""
    if not budget_fits_a_probe(replace(loop, started=loop.done_before)):
        return ALREADY_COMPLETE
    left = loop.budget - loop.started
    if left > 0.005:
        return f"budget reached ({left:.2f} of a full probe left, too little for another)"
    return "budget reached"
