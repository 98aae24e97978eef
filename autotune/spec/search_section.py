"""The spec's sections on how a study searches and where it records: the budget and strategy
(``search``), the config it recommends (``recommend``), MLflow and Optuna storage (``tracking``),
and Ray (``ray``). Plain fields with their descriptions, no rule across sections; a module of its
own to keep :mod:`autotune.spec.schema` (which re-exports these) within reading length.
"""

from __future__ import annotations

from typing import Literal

import math

from pydantic import Field, ValidationInfo, field_validator

from .fields import Strict

__all__ = ["RaySpec", "RecommendSpec", "SearchSpec", "TrackingSpec"]

DRIFT_EVERY_AUTO = 10  # search.drift_every null: a drift check every this many probes ...
DRIFT_AUTO_FROM = 30  # ... in a study of at least this many trials (a long study), else none


class SearchSpec(Strict):
    """Budget and strategy. ``auto`` lets autotune choose (simulator ranking, then model-guided)."""

    n_trials: int = Field(20, gt=0, description="probes to run (configs measured)")
    parallel_trials: int = Field(1, gt=0)
    sampler: Literal["auto", "tpe", "nsga2", "gp", "random", "grid", "exhaustive"] = "auto"
    seed: int | None = Field(0, ge=0, lt=2**32, description="sampler seed (numpy's range: 0 <= seed < 2**32)")
    timeout_s: float | None = Field(None, gt=0, description="stop starting new trials after this long")
    exhaustive_limit: int = Field(
        2_000_000,
        gt=0,
        description="largest space ranked exhaustively by the simulator (larger ones are sampled); a space "
        "under it whose ranking could not fit in this machine's memory is refused (validate/plan/run: exit 2, "
        "with the estimate: autotune.spec.space.memory_problem)",
    )
    prune: bool = Field(
        True,
        description="stop a real probe early once its measured steps are confidently slower "
        "than the best trial's (throughput and step-time objectives)",
    )
    prune_margin: float = Field(
        0.5,
        gt=0,
        description="stop when the median measured step time exceeds the best's "
        "by more than this fraction (0.5: 50 %, above run-to-run noise)",
    )
    prune_min_steps: int = Field(2, ge=1, description="measured steps a probe shows before it may be stopped")
    stop_early: bool = Field(
        True,
        description="sampler auto: stop before the budget when the model's optimistic "
        "bound of every remaining config is below the best measured",
    )
    explore_kappa: float = Field(
        1.0,
        ge=0,
        description="sampler auto: optimism of the next pick, in standard deviations of the model's uncertainty",
    )
    fit_confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="sampler auto: probability of fitting in memory the first probe needs (nothing measured yet)",
    )
    min_fit_probability: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="sampler auto: the least probability of fitting "
        "in memory a config needs to be probed while likelier ones remain; higher: "
        "fewer OOM probes, a near-limit optimum found later (benchmarks/README.md)",
    )
    max_oom_share: float | None = Field(
        0.05,
        gt=0,
        lt=1,
        description="sampler auto: cap on OOM probes, as a share "
        "of n_trials (rounded up, at least one; two where memory profiles send the full probes); past it only "
        "configs fit_confidence likely to fit "
        "are probed; null: no cap (benchmarks/README.md shows the trade-off)",
    )
    max_doubt_probes: int = Field(
        2,
        ge=0,
        description="sampler auto: probes the guide may spend on families (tp/pp/cp/zero/recompute) not yet "
        "measured once a measured family has run consistently off its predictions (the model in doubt); 0: never",
    )
    tie_tolerance: float = Field(
        0.02,
        gt=0,
        lt=1,
        description="sampler auto: the recommendation is certified when it is within this share of the best "
        "measured config with probability `confidence`; configs the readings cannot order are then tied, and "
        "the recommendation chooses between them by memory headroom (docs/GUIDE.md, the race of the contenders)",
    )
    confidence: float = Field(
        0.95,
        gt=0,
        lt=1,
        description="sampler auto: the probability the race of the contenders aims for that the recommendation "
        "is within `tie_tolerance` of the best measured config (a lower bound over the measured configs)",
    )
    confirm_budget: float = Field(
        0.25,
        gt=0,
        description="sampler auto: the re-measurements the race of the contenders may spend, a share of "
        "n_trials (below 1: full-probe equivalents, so more of them where a re-measurement is short, "
        "remeasure_steps) or a count (a whole number, at most n_trials); held back at the end of the budget "
        "while the recommendation is not certified, spent on new configs when it is; a study that would stop "
        "early with budget left races past it, with the budget left",
    )
    remeasure_steps: int | None = Field(
        2,
        ge=1,
        description="sampler auto, training: the timed steps a re-measurement (the race, a drift check, a suspect "
        "reading) runs after the workload's warm-up: it reads the noise between runs, which a launch draws "
        "whatever its length, at about 0.6 of a full probe (2 warm-up + 2 of 7 steps), and the race's share "
        "(confirm_budget) buys readings at that cost. null: the workload's measured_steps (a full probe). Where the "
        "probe is not told its steps (a command backend without {measured_steps}, a stack preset) a re-measurement "
        "is a full probe, and a command backend's study says so. On the search benchmark (1,080 studies a family, "
        "benchmarks/README.md) 2 against null: the 5 % noise family 90.1 % within 3 % of the optimum against 87.8 % "
        "(p 0.01), the 2 % family 96.1 % within 2 % against 95.8 %, fewer full-probe equivalents in both",
    )
    max_readings: int = Field(
        3, ge=2, le=10, description="sampler auto: the most readings the race of the contenders takes of one config"
    )
    drift_every: int | None = Field(
        None,
        ge=0,
        description="sampler auto: re-measure the control config (the baseline, else the first measured) after "
        "this many probes, and report a change beyond the noise as drift; 0: never; null: every "
        f"{DRIFT_EVERY_AUTO} probes in a study of at least {DRIFT_AUTO_FROM} trials, else never",
    )
    memory_profiles: bool = Field(
        True,
        description="sampler auto: before a full probe of a config not sure to fit, run its layout with 1 and "
        "a few layers per pipeline stage (a memory profile, one or two steps) and probe it in full only if the "
        "fitted peak says it fits; skipped where the backend cannot shrink the model (a command backend "
        "without {num_layers}); the budget counts full-probe equivalents (docs/GUIDE.md)",
    )
    profile_go_probability: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="sampler auto: the probability of fitting, after its memory profile, that a config needs "
        "for its full probe; below it the trial ends as oom_predicted (no full probe). 0.4: a profile's P(fits) "
        "is a rank more than a probability (its stated sd is 1.75x the error), and on the search benchmark's "
        "held-out worlds the configs it put at 0.3-0.5 fitted 46 % of the time (benchmarks/README.md)",
    )

    @field_validator("confirm_budget")
    @classmethod
    def _confirm_within_budget(cls, v: float, info: ValidationInfo) -> float:
        n = info.data.get("n_trials")
        if v >= 1 and v != int(v):
            raise ValueError("a share of n_trials is below 1, a count is a whole number")
        if n is not None and v > n:
            raise ValueError(f"{v:g} re-measurements is above the budget (n_trials {n}): give at most {n} or a share")
        return v

    @field_validator("drift_every")
    @classmethod
    def _drift_every(cls, v: int | None) -> int | None:
        if v == 1:
            raise ValueError("1 would re-measure the control after every probe: give 0 (never) or at least 2")
        return v

    def drift_checks_every(self) -> int:
        """``drift_every`` resolved: probes between drift checks, 0 for none."""
        if self.drift_every is not None:
            return self.drift_every
        return DRIFT_EVERY_AUTO if self.n_trials >= DRIFT_AUTO_FROM else 0

    def confirm_readings(self, remeasure_cost: float = 1.0) -> int:
        """``confirm_budget`` as a count of re-measurements: a count as given; a share of ``n_trials``
        (full-probe equivalents) over what one re-measurement costs (``remeasure_cost``: 1 for a full
        probe, about 0.6 for one of 2 of 5 timed steps, :mod:`autotune.guide.short_remeasure`), at least one."""
        if self.confirm_budget >= 1:
            return int(self.confirm_budget)
        return max(1, math.floor(self.confirm_budget * self.n_trials / max(remeasure_cost, 1e-9) + 1e-9))


class RecommendSpec(Strict):
    """Which config the study recommends and exports (autotune/study/recommend.py states the rule)."""

    min_headroom_gib: float | None = Field(
        4.0,
        ge=0,
        description="when the best leaves less device memory free, "
        "recommend the best config within `tolerance` of it that leaves this much; "
        "null: always the best",
    )
    tolerance: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="how close to the best counts as as good (a share); "
        "default: the simulator's error on published runs (5.3 %) for predictions, the "
        "measurement noise (3 %) for measured trials",
    )


class TrackingSpec(Strict):
    mlflow_uri: str | None = Field(None, description="default: SQLite file in the run directory")
    experiment: str | None = Field(None, description="default: the spec name")
    storage: str | None = Field(None, description="Optuna storage URL; default: a journal file in the run directory")


class RaySpec(Strict):
    address: str | None = Field(None, description="None starts a local Ray; 'auto' or ray://host:port connects")
    num_cpus: int | None = Field(None, gt=0, description="CPUs for a local Ray (default: the machine's)")
    enabled: bool = Field(True, description="false runs real probes as local subprocesses without Ray")
    placement_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a trial spanning several nodes waits for "
        "its placement group (one bundle per node) before it is an infrastructure "
        "failure",
    )
