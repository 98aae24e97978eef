"""When a config must run again: a trial the previous run was killed under, one the infrastructure
failed (retried once), one the cluster could not place because it lost nodes (queued for the re-run).
Each is queued as a new trial with the attributes that say why (:mod:`autotune.trial_attrs`).
"""

from __future__ import annotations

from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from ..spec.space import Space
from .plan import params_for
from .trial_resolve import rule_rejection
from ..trial_attrs import A

__all__ = ["recover_interrupted", "retry_after_infra", "requeue_after_lost_capacity"]


def recover_interrupted(study: optuna.Study, space: Space, say: Callable[[str], None]) -> int:
    """Mark trials left RUNNING by a killed run as failed and re-queue their configs.

    A trial is re-queued when its whole config is known (it was resolved, or queued from the
    plan); one killed while Optuna was still writing its proposal, param by param, has only
    some params and no probe behind it: it is closed and the sampler proposes afresh. One
    already answered without a probe (rejected by the rules, or a repeat) but killed before it
    was told is closed with that answer: queued again, its config would skip the rules. One with a
    config and no verdict (``_judged``; the resolver writes a rejection before the config, but a study
    killed under an earlier order may hold one) is judged by the rules again first."""
    requeued = 0
    storage = study._storage
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get(A.STATUS) in _ANSWERED_WITHOUT_PROBE:
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            continue
        config = t.user_attrs.get(A.CONFIG)
        if config and not _judged(t.user_attrs) and (violations := _rules_violated(space, config)):
            for name, value in rule_rejection(violations).items():
                storage.set_trial_user_attr(t._trial_id, name, value)
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            continue
        storage.set_trial_user_attr(t._trial_id, A.STATUS, "interrupted")
        storage.set_trial_user_attr(
            t._trial_id,
            A.REASON,
            "the run was killed while this trial was running"
            + ("; re-queued" if config else " (before its probe started)"),
        )
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        if not config:
            continue
        attrs = {**_carried(t.user_attrs), A.REQUEUED_FROM: t.number}
        study.enqueue_trial(params_for(space, config), user_attrs=attrs, skip_if_exists=False)
        requeued += 1
    if requeued:
        say(f"resuming: {requeued} trial(s) interrupted by the previous run re-queued")
    return requeued


def retry_after_infra(
    study: optuna.Study, trial: optuna.Trial, config: dict[str, Any], space: Space, say: Callable[[str], None]
) -> None:
    """Queue the config once more after an infrastructure failure (Ray places it wherever
    the cluster has room now); a second one in a row is left as it is, with its reason."""
    ua = trial.user_attrs
    if A.INFRA_RETRY_OF in ua:
        trial.set_user_attr(
            A.REASON,
            f"{ua.get(A.REASON, '')}; the retry of trial {ua[A.INFRA_RETRY_OF]} "
            "failed on the infrastructure too: not retried again"[:2000],
        )
        return
    attrs = {**_carried(ua), A.INFRA_RETRY_OF: trial.number}
    attrs[A.CHOSEN] = f"retry of trial {trial.number} after an infrastructure failure; " + str(ua.get(A.CHOSEN, ""))
    study.enqueue_trial(params_for(space, config), user_attrs=attrs, skip_if_exists=False)
    trial.set_user_attr(A.REASON, f"{ua.get(A.REASON, '')}; retried once as a new trial"[:2000])
    say(f"trial {trial.number}: infrastructure failure; its config is retried once")


def requeue_after_lost_capacity(
    study: optuna.Study, trial: optuna.Trial, config: dict[str, Any], space: Space, lost: list[str]
) -> str:
    """The cluster lost nodes the study needs: the config is queued again as it was (a retry
    not spent: the infrastructure, not the config, failed) for the re-run, and the study stops
    once the running trials are in (exit 3), rather than spend its budget on trials that
    cannot be placed and feed them to the search as infeasible. Returns why the study stops."""
    ua = trial.user_attrs
    attrs = _carried(ua, A.INFRA_RETRY_OF)  # the retry count as it was: this one was not spent
    study.enqueue_trial(params_for(space, config), user_attrs=attrs, skip_if_exists=False)
    trial.set_user_attr(A.REASON, f"{ua.get(A.REASON, '')}; queued again for the re-run"[:2000])
    return (
        f"the Ray cluster lost {', '.join(lost)}: the study stopped with its configs left unmeasured; bring the "
        "node(s) back and run the same command to resume them"
    )


def _judged(user_attrs: dict[str, Any]) -> bool:
    """Whether the rules' verdict on a trial's config is known: a valid proposal's key is recorded
    right after its config, and every queued trial carries one; a trial sent to a probe passed."""
    return A.KEY in user_attrs or bool(user_attrs.get(A.PROBED))


def _rules_violated(space: Space, config: dict[str, Any]) -> list[str]:
    """The rules a proposal's recorded config (the resolver's, so every searched value is one of the
    space's) violates: what the resolver was about to record when the run was killed. Queued again
    unjudged, such a config reached a worker, which answered it as invalid, a probe counted against
    the budget (the SIGKILL-and-resume test's study ended one measurement short)."""
    return space.resolve(params_for(space, config)).violations


_ANSWERED_WITHOUT_PROBE = ("invalid", "duplicate")
_CARRIED = (A.CONFIG, A.KEY, A.CHOSEN, A.BASELINE, A.PREDICTED)


def _carried(user_attrs: dict[str, Any], *more: str) -> dict[str, Any]:
    """What a config's trial queued again keeps of the trial it replaces: the config and its key,
    why it was chosen, whether it is the baseline, the model's prediction (and ``more``)."""
    return {k: v for k, v in user_attrs.items() if k in (*_CARRIED, *more)}
