"""Names of the Optuna trial user attributes autotune writes.

One place, so that the study loop, the guided sampler, reports and exports read what was written.
"""

from __future__ import annotations

__all__ = ["A", "RAN", "UNDISTINGUISHED", "ROOMIEST", "undistinguished_in", "roomiest_in"]

# the statuses (``A.STATUS``) of a probe that ran to its figures: ``ok``, and ``pruned`` (stopped once
# its measured steps showed it slower than the best: its partial measurement is kept). What may be
# exported, read as a measurement of speed and memory, and is no failure in MLflow
RAN = ("ok", "pruned")

# how a trial's reason (``A.CHOSEN``) names the knobs its layout leaves to the probes: the ranking
# writes it, the run's preview, the report and best.env read it
UNDISTINGUISHED = "not distinguished by the model (probe to choose): "


# how a trial's reason names the knobs the model prices alike in speed but not in memory: the
# layout's config takes the value the model predicts roomiest (a probe would choose on speed)
ROOMIEST = "priced alike in speed by the model, its roomiest value taken (probe to choose on speed): "


def roomiest_in(reason: str) -> str:
    """The knobs a trial's reason names after :data:`ROOMIEST`; "" when it names none."""
    if ROOMIEST not in reason:
        return ""
    return reason.split(ROOMIEST, 1)[1].split("; ", 1)[0].strip()


def undistinguished_in(reason: str) -> str:
    """The knobs a trial's reason names after :data:`UNDISTINGUISHED` (``env.HCCL_BUFFSIZE
    120|200|400, precision bf16|fp16``), up to the reason's next part; "" when it names none."""
    if UNDISTINGUISHED not in reason:
        return ""
    return reason.split(UNDISTINGUISHED, 1)[1].split("; ", 1)[0].strip()


class A:
    """Names of the trial user attributes autotune writes (one place, so report/export agree)."""

    CONFIG = "autotune.config"
    KEY = "autotune.key"
    STATUS = "autotune.status"
    REASON = "autotune.reason"
    SOURCE = "autotune.source"
    METRICS = "autotune.metrics"
    PREDICTED = "autotune.predicted"
    PROBED = "autotune.probed"
    CHOSEN = "autotune.chosen_because"
    BASELINE = "autotune.baseline"
    DUPLICATE_OF = "autotune.duplicate_of"
    REQUEUED_FROM = "autotune.requeued_from"
    REMEASURE_OF = "autotune.remeasure_of"  # a deliberate second measurement of a close call
    GAMBLE_ON = "autotune.gamble_on"  # the full probe of a config the memory profile of this trial turned away
    # a slice study's config measured again at the target's full size (cluster.confirm_top)
    AT_TARGET = "autotune.at_target"
    # a re-measurement that ran this many timed steps, not the workload's (autotune.guide.short_remeasure)
    SHORT_STEPS = "autotune.short_steps"
    INFRA_RETRY_OF = "autotune.infra_retry_of"  # the config again, after the infrastructure failed under it
    WALL = "autotune.wall_s"
    # the trial's memory profile (autotune.guide.memory_profile.ProfileRecord): the layers per stage run,
    # the peaks, the fitted full peak and sd, P(fits) after it, the verdict and its cost
    MEMORY_PROFILE = "autotune.memory_profile"
    INFO = "autotune.info"
    # study-level: the guide's estimate of every measured config's objective ({key: [mean, sd, n]}),
    # from which the best is reported (records.best_records)
    GUIDE_ESTIMATES = "autotune.guide_estimates"
    # the guide's P(no config it has not measured beats its leader by more than search.tie_tolerance)
    GUIDE_UNMEASURED = "autotune.guide_unmeasured"
    # the guide's leave-one-out prediction (mean, sd) of every measured config: the certificate's
    # second measurement of each (objectives.race.certificate's priors)
    GUIDE_PRIORS = "autotune.guide_priors"
