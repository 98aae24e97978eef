"""The spec's sections on how a study searches and where it records: the budget and strategy
(``search``), the config it recommends (``recommend``), MLflow and Optuna storage (``tracking``),
and Ray (``ray``). Plain fields with their descriptions, no rule across sections; a module of its
own to keep :mod:`autotune.spec.schema` (which re-exports these) within reading length.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .fields import Strict

__all__ = ["RaySpec", "RecommendSpec", "SearchSpec", "TrackingSpec"]


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
        "of n_trials (at least one); past it only configs fit_confidence likely to fit "
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
        description="sampler auto: two configs whose difference is surely within this share of the best are "
        "tied: the race of the two best (each measured in turn while the noise cannot order them) stops there, "
        "and the recommendation decides between them by memory headroom (docs/GUIDE.md)",
    )
    max_readings: int = Field(
        3, ge=2, le=10, description="sampler auto: the most readings the race of the two best takes of one config"
    )
    memory_profiles: bool = Field(
        True,
        description="sampler auto: before a full probe of a config not sure to fit, run its layout with 1 and "
        "a few layers per pipeline stage (a memory profile, one or two steps) and probe it in full only if the "
        "fitted peak says it fits; skipped where the backend cannot shrink the model (a command backend "
        "without {num_layers}); the budget counts full-probe equivalents (docs/GUIDE.md)",
    )
    profile_go_probability: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="sampler auto: the probability of fitting, after its memory profile, that a config needs "
        "for its full probe; below it the trial ends as oom_predicted (no full probe)",
    )


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
