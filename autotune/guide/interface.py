"""What the guide is told and what it answers: its knobs (:class:`GuideSettings`, the ``search:``
fields of the same names), a study's trials as the guide sees them (:class:`Observation`), its
answer (:class:`Proposal`), and the readings a study holds of each config. The models
(:mod:`.bayes`), the memory belief (:mod:`.memory_belief`), the race of the contenders
(:mod:`.contenders`) and the guide that proposes (:mod:`.guided`) all read these, and nothing
here reads them back.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable


FAMILY_PARAMS = ("tp", "pp", "cp", "zero_stage", "recompute")  # what makes a config's family


@dataclass(frozen=True)
class GuideSettings:
    """Knobs of the guide (``search:`` fields of the spec carry the same names)."""

    prior_sigma: float = 0.25  # how wrong a component factor of the simulator may be (25 %)
    value_sigma: float = 0.04  # effect of one parameter value beyond what the simulator prices (4 %)
    # ... its scale fitted to the study's readings (empirical Bayes, :func:`_fitted_sigma`): the factor
    # on value_sigma among VALUE_SIGMA_FACTORS that explains them best; False: value_sigma as given
    fit_value_sigma: bool = True
    unpriced_sigma: float = 1.5  # log-factor of an execution parameter the simulator does not price (mode, jit level)
    memory_sigma: float = 0.12  # how wrong a memory component may be
    memory_value_sigma: float = (
        0.08  # memory effect of one parameter value beyond what the simulator prices (share of the peak)
    )
    noise: float = 0.03  # measurement noise, relative (median of repeated steps)
    # the degrees of freedom ``noise`` was measured with on this host (a serving profile's
    # ``serving_steps.repeat_noise``, autotune calibrate --serving's probes); 0: assumed
    noise_dof: int = 0
    noise_from: str = ""  # what measured ``noise``, in words (with ``noise_dof`` > 0)
    peak_noise: float = 0.01  # measurement noise of a peak, relative: a config's peak repeats to about 1 %
    explore_kappa: float = 1.0  # optimism of the next pick, in standard deviations
    fit_confidence: float = 0.95  # P(fits in memory) a config needs to be probed
    stop_early: bool = True  # apply the stopping rule (else the budget is spent)
    stop_kappa: float = 2.0  # optimism of the stopping rule
    stop_margin: float = 0.0  # stop when every bound is below best * (1 + margin)
    min_probes_before_stop: int = 3
    min_fit_probability: float = 0.5  # probe a config less likely than this to fit only when none is likelier
    give_up_probability: float = 0.05  # stop when no remaining config is even this likely to fit
    fit_power: float = 3.0  # weight of P(fits) against the expected improvement
    max_readings: int = 3  # readings of one config the race of the contenders may take
    tie_tolerance: float = 0.02  # the leader is certified when within this share of the best measured ...
    confidence: float = 0.95  # ... with this probability (autotune.objectives.race)
    confirm_readings: int = 5  # re-measurements the race may spend in a study; held back for it at the end
    # what one re-measurement costs in full-probe equivalents (about 0.6 where it runs 2 of 5 timed steps,
    # autotune.guide.short_remeasure): the budget held back for the race is its readings at this cost
    remeasure_cost: float = 1.0
    drift_every: int = 0  # re-measure the control config (the first measured) after this many probes; 0: never
    scout: bool = True  # value a sure config for the unsure ones its measurement would make sure
    max_oom_share: float | None = (
        0.05  # OOM probes the study may risk (share of its budget, at least one); then only sure fits
    )
    doubt_threshold: float = 0.10  # a measured family this consistently off its predictions (log ratio) ...
    max_doubt_probes: int = 2  # ... buys up to this many probes of unmeasured families before exploiting
    # memory profiles (autotune.guide.memory_profile): the runner can run a config's layout with fewer
    # layers first; a config not sure to fit then costs its profile, plus its full probe only if the
    # profile says it fits, and is no OOM risk taken blind
    memory_profiles: bool = False
    profile_cost: float = 0.3  # a profile's cost in full-probe equivalents, as the guide weighs it
    # a memory profile's measured step read as the speed of its layout on the cut model (priced by the
    # simulator at those layers): it informs the choice of what to probe and when to stop, never the
    # estimate a measured config is reported or raced by (Guide._profile_rows)
    profile_steps: bool = True
    profile_step_noise: float = 2.0  # a profile step's noise, in units of ``noise``: one step after one warm-up
    # prior sd of the log-factor between the profiles' steps and their pricing, fitted per study: a
    # profile's one step may sit apart from a full probe's median (warm-up, a start-up the model does
    # not cut); measured on this CPU: the cut model's steps at 0.80-0.99 of the full model's, priced alike
    profile_factor_sigma: float = 0.2
    # ... read only while they grow with their layers as priced, within this factor either way (the median
    # over the layouts profiled at two sizes): a launcher whose step ignores its layers says nothing
    profile_scaling_tolerance: float = 1.5
    # what the device check measured a probe's allocator can use on one device (autotune.study.usable_memory;
    # the hardware profile's usable_memory_gib), None where no check ran
    device_usable_gib: float | None = None


@dataclass(frozen=True)
class Observation:
    """One measured (or failed) trial, as the guide sees it."""

    index: int  # row in the ranking
    status: str  # ok / oom / pruned / nan / error ...
    objective: float | None = None  # measured value of the first objective
    step_time_s: float | None = None
    peak_memory_gib: float | None = None
    number: int = -1
    oom_needed_gib: float | None = None  # an OOM's "in use + requested" from the allocator's message
    oom_in_use_gib: float | None = None  # ... and what was in use when the request failed
    peak_counts: str = "device"  # what ``peak_memory_gib`` counts (a key of ``PEAK_LEAVES_OUT``)
    # the full model's peak its memory profile predicted (counted as ``peak_counts``), and its sd
    profile_peak_gib: float | None = None
    profile_sd_gib: float | None = None
    # the memory the probe's allocator could have used at its peak (its reserve plus what the device
    # still had free): the usable memory measured without an OOM (protocol USABLE_KEY)
    usable_gib: float | None = None
    # the P(fits) its memory profile gave the full model, where a profile decided (its verdict's
    # figure: the line through the profile's peaks against the memory its allocator could use)
    profile_p_fit: float | None = None
    # the P(fits) the full probe was run at (the guide's when it chose it, or its profile's verdict)
    stated_p_fit: float | None = None
    # a reading set aside as interference (autotune.objectives.interference: far slower than another
    # reading of its config): its objective and step time teach nothing; its peak still does
    interference: bool = False
    # the relative standard error of ``objective`` within its run, from the probe's own steps
    # (autotune.objectives.intervals.step_reading_noise); None where the probe gave no steps
    reading_noise: float | None = None
    # the step times its memory profiles measured: ((layers per stage, seconds), ...); the same layout
    # on a cut model, a reading of its speed (Guide._profile_rows)
    profile_steps: tuple[tuple[int, float], ...] = ()

    @property
    def oom_counts(self) -> str:
        """What an OOM's ``oom_needed_gib`` / ``oom_in_use_gib`` count (a key of ``PEAK_LEAVES_OUT``):
        the device's; or, where its message named the fixed pool the framework took at start
        (MindSpore's, then this OOM's ``usable_gib``), the pool's, as an allocator's reserve does."""
        return "reserved" if self.status == "oom" and self.usable_gib else "device"


@dataclass
class Proposal:
    index: int
    config: dict[str, Any]
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)
    remeasure: bool = False  # the same config again: the race of the contenders
    stake: float = 0.0  # a race re-measurement's: the expected relative loss of reporting the leader over the threat
    scout_for: int | None = None  # probed to learn the memory of this row, a promising config not yet sure to fit
    gamble: bool = False  # the full probe of a config its memory profile turned away (Guide._last_gamble)


def readings_of(obs: Iterable[Observation]) -> dict[int, list[float]]:
    """Every measured config's readings of the objective (row -> readings in trial order), the
    readings set aside as interference left out: what the race, the claims and the best read."""
    values: dict[int, list[float]] = {}
    for o in obs:
        if o.status == "ok" and o.objective is not None and math.isfinite(o.objective) and not o.interference:
            values.setdefault(o.index, []).append(o.objective)
    return values


def readings_taken(obs: Iterable[Observation]) -> dict[int, int]:
    """Readings taken of each measured config (row -> count), those set aside as interference
    included: what a re-measurement has spent."""
    return dict(Counter(o.index for o in obs if o.status == "ok" and o.objective is not None))


def family_of(config: dict[str, Any]) -> tuple:
    return tuple(config.get(k) for k in FAMILY_PARAMS)
