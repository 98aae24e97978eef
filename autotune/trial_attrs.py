"""Names of the Optuna trial user attributes autotune writes.

One place, so that the study loop, the guided sampler, reports and exports read what was written.
"""

from __future__ import annotations

__all__ = ["A"]


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
    INFRA_RETRY_OF = "autotune.infra_retry_of"  # the config again, after the infrastructure failed under it
    WALL = "autotune.wall_s"
    INFO = "autotune.info"
    # study-level: the guide's estimate of every measured config's objective ({key: [mean, sd, n]}),
    # from which the best is reported (records.best_records)
    GUIDE_ESTIMATES = "autotune.guide_estimates"
