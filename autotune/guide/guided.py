"""Model-guided search: which config to probe next, from the simulator and what was measured.

The simulator prices every valid config of the space (``ranking.rank_space``) as a sum of time
components (GEMM, attention, recompute, TP/DP/PP communication, bubble, ...) and memory
components (weights, gradients, optimizer states, activations, buffers, reserve). A real machine
departs from the model mostly component by component — this GEMM efficiency is lower, that
collective is faster, activations take more room — plus effects the model does not price at all
(an allocator setting, a kernel that is slow for one micro-batch size). So the guide keeps a
Bayesian linear model on top of the simulator, fitted to every measurement of the study:

    measured step time ≈ Σ_k f_k · t_k(x)  +  Σ_j g_j · φ_j(x) · t(x)
    measured peak mem  ≈ Σ_k h_k · m_k(x)  +  Σ_j u_j · φ_j(x) · m(x)

with ``t_k``/``m_k`` the predicted components, ``φ_j`` one-hot indicators of the parameter values
(tp=4, recompute=full, env.X=...; none for the derived dp and grad_accum), priors
``f_k, h_k ~ N(1, σ²)`` and ``g_j, u_j ~ N(0, σ²)``, and relative (not absolute) residuals. The
posterior is closed-form (a small ridge solve), cheap over tens of thousands of configs, and gives
every config a mean *and* an uncertainty:

- **Next probe** = the highest optimistic objective (upper confidence bound, ``explore_kappa``
  standard deviations) among configs not yet probed whose probability of fitting in memory is at
  least ``fit_confidence``. A measured family pins down its components and parameter values;
  structurally different families (other tp/pp/zero/recompute) keep their uncertainty, so they
  are tried while they could still win, and never when they cannot.
- **Scouting**: a promising config whose P(fits) falls short only because nothing like it was
  measured (its ZeRO stage, its micro-batch size) is not risked; a config that surely fits and
  shares what is uncertain about it is worth probing first, by what it would make sure
  (``scout_value``). A parameter value's memory effect beyond the simulator's components has a
  prior of ``memory_value_sigma`` of the peak (8 %): real stacks differ from the model by terms
  it does not have (fp32 gradient buffers, unsharded activations), not only by factors.
- **What a measured peak counts**: a framework's own counter sees only its caching allocator
  (``max_memory_allocated``, printed by Megatron-LM and DeepSpeed, used by the probes; torchtitan
  prints ``max_memory_reserved``); the device also holds the allocator's fragmentation, the
  runtime's context and the communication buffers. A peak is fitted against the components it
  counts (``PEAK_LEAVES_OUT``, from the probe's ``peak_memory_counts``), the prediction that
  decides whether a config fits is the whole: the components no probe measures keep their prior,
  until an OOM's byte counts (the device's, not the allocator's) pin them.
- **Feasibility learning**: an OOM is a censored memory measurement (at least the capacity); a
  config that fits although predicted over the limit lowers the estimate. Both move the memory
  factors, hence the margin every similar config must keep.
- **Stopping rule**: when even the optimistic bound (``stop_kappa`` standard deviations) of every
  remaining config that may fit is below the best measured value by ``stop_margin``, no further
  probe can win: the study stops and says so.

Everything is derived from the study's trials each time it is asked (nothing to store, and a
resumed study continues with the same ranking and the same fit).

Why one module of over 500 lines: the model, its priors, its fit and the acquisition that reads
it share one set of matrices and one derivation; split, each half would have to restate the other.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import numpy as np

from autotune.objectives.interference import interference_flags, interference_gap, slowed_by_interference
from autotune.objectives.intervals import noise_belief, noise_floor, repeat_noise, separated
from autotune.objectives.race import certificate

from .ranking import Ranking
from .refit import COMPONENTS
from ..spec.space_section import DERIVED_PARAMS
from ..workers.protocol import PEAK_LEAVES_OUT

__all__ = [
    "GuideSettings",
    "Observation",
    "Proposal",
    "Guide",
    "STEP_DERIVED",
    "PEAK_LEAVES_OUT",
    "family_of",
    "readings_of",
]

# objectives that every config of a study derives from its step time (same global batch and world)
STEP_DERIVED = {"tokens_per_s_per_device": -1, "tokens_per_s": -1, "samples_per_s": -1, "mfu": -1, "step_time_s": 1}
FAMILY_PARAMS = ("tp", "pp", "cp", "zero_stage", "recompute")
# how the framework executes (graph vs eager, compiler level, fusion): can change a step several
# fold, and the simulator does not price it; environment variables get the narrow prior
EXECUTION_PARAMS = ("mode", "jit_level", "graph_kernel_flags", "compile")
_MAX_ONE_HOT_VALUES = 16
# knobs that cannot make a config that ran out of memory fit (issue 41): the half precisions hold the
# same bytes, a graph or fusion flag moves no tensor out of memory, an HCCL setting other than a
# smaller buffer allocates as much; a layout that ran out of memory is not probed again with only these
# changed ("the same wall")
SAME_WALL_PRECISIONS = ("bf16", "fp16")
SAME_WALL_FLAGS = ("graph_kernel_flags", "jit_level", "compile", "mode")
HCCL_BUFFER = "env.HCCL_BUFFSIZE"


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


@dataclass
class _Posterior:
    mean: np.ndarray
    cov: np.ndarray

    def draws(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` joint draws of the coefficients, (n, k): the factor of the covariance by its
        eigen-decomposition (a posterior covariance can be singular to rounding)."""
        values, vectors = np.linalg.eigh((self.cov + self.cov.T) / 2.0)
        root = vectors * np.sqrt(np.clip(values, 0.0, None))
        return self.mean + rng.standard_normal((n, len(self.mean))) @ root.T


@dataclass
class _ObjectiveBelief:
    """The objective model's posterior: the mean and sd of every config (in the objective's units)
    and joint draws of any subset of configs. The configs share the model's coefficients, so their
    errors move together: a claim over many configs (none beats the leader) is a claim over the
    draws, not a product of each config's chance (issue 44's certificate)."""

    mean: np.ndarray
    sd: np.ndarray
    post: _Posterior
    design: np.ndarray
    # the step-time model's execution factors (exp(Σ e_j φ_j)); None for a direct objective
    exec_post: _Posterior | None = None
    execution: np.ndarray | None = None
    # step-derived objectives: objective = scale / step (throughput-like) or the step itself
    scale: np.ndarray | None = None
    floor: np.ndarray | None = None
    inverse: bool = False

    def draws(self, indices: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` joint draws of the objective of the configs ``indices``: (len(indices), n)."""
        values = self.design[indices] @ self.post.draws(n, rng).T
        if self.execution is None or self.exec_post is None:
            return values
        if self.execution.shape[1]:
            values = values * np.exp(self.execution[indices] @ self.exec_post.draws(n, rng).T)
        values = np.maximum(values, self.floor[indices, None])
        return self.scale[indices, None] / values if self.inverse else values


@dataclass
class _MemoryBelief:
    """The memory model's posterior over its factors, and what it says of every config: the
    mean and sd of the peak (GiB), the sd including ``discrepancy`` (the model's relative
    leave-one-out error beyond its own predictive uncertainty, a per-config error that no
    measurement of another config removes)."""

    post: _Posterior
    design: np.ndarray
    mean: np.ndarray
    sd: np.ndarray
    discrepancy: float = 0.0


@dataclass
class LeaveOneOut:
    """The objective model checked against this study's readings (:meth:`Guide.leave_one_out`):
    ``rows``: measured config -> (its prediction from every other measurement, that prediction's
    sd, the config's mean reading, the variance of that mean at the study's noise); ``scale``: the
    factor on the model's sd that those misses bear out (:func:`_sd_scale`)."""

    rows: dict[int, tuple[float, float, float, float]]
    scale: float


def _sd_scale(rows: list[tuple[float, float, float, float]]) -> float:
    """The factor ``k`` on the model's sd for which its leave-one-out misses are as large as it
    says: mean((reading - prediction)^2 / (k^2 sd^2 + se^2)) at the lower ``LOO_SCALE_QUANTILE``
    of chi-square(n) / n, so that the few configs a study measured prove no more than they can (an
    upper bound on ``k``), within [``LOO_SCALE_MIN``, ``LOO_SCALE_MAX``]. The model's sd is its
    prior's, set wide for the search's sake: on the search benchmark its misses of the measured
    configs were 0.5-1.1 of its sd (median 0.7), of the configs it did not measure 0.3-1.2, and
    the claims over the configs not measured said P 0.80 on average where 40 of 40 held."""
    from scipy.stats import chi2

    target = float(chi2.ppf(LOO_SCALE_QUANTILE, len(rows))) / len(rows)

    def misses(k: float) -> float:
        return float(np.mean([(r - m) ** 2 / ((k * sd) ** 2 + se2) for m, sd, r, se2 in rows]))

    lo, hi = LOO_SCALE_MIN, LOO_SCALE_MAX
    if misses(lo) <= target:
        return lo
    if misses(hi) >= target:
        return hi
    for _ in range(50):  # misses(k) falls as k grows: bisect
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if misses(mid) > target else (lo, mid)
    return hi


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


def _solve(z: np.ndarray, y: np.ndarray, prior_mean: np.ndarray, prior_sd: np.ndarray, noise: np.ndarray) -> _Posterior:
    """Bayesian linear regression y = z·θ + ε, θ ~ N(prior_mean, diag(prior_sd²)), ε ~ N(0, noise²)."""
    prec0 = np.diag(1.0 / prior_sd**2)
    w = 1.0 / noise**2
    a = prec0 + (z * w[:, None]).T @ z
    b = prec0 @ prior_mean + (z * w[:, None]).T @ y
    cov = np.linalg.inv(a)
    return _Posterior(cov @ b, cov)


VALUE_SIGMA_FACTORS = (0.25, 0.5, 1.0, 2.0)  # the scales of value_sigma a study's readings choose among
VALUE_SIGMA_MIN_READINGS = 3  # below this many readings the prior's scale stands (a pair proves no scale)
VALUE_SIGMA_PRIOR = math.log(2.0)  # sd of the log of that factor a priori (centred on value_sigma itself)


def _fitted_sigma(
    z: np.ndarray, y: np.ndarray, prior_mean: np.ndarray, prior_sd: np.ndarray, values: np.ndarray, noise: np.ndarray
) -> np.ndarray:
    """``prior_sd`` with the value effects' sd (the columns ``values``) scaled by the factor of
    ``VALUE_SIGMA_FACTORS`` under which the readings are likeliest (the marginal likelihood of the
    linear model, y ~ N(z prior_mean, z S z' + noise^2), times a log-normal prior on the factor):
    empirical Bayes. How much a parameter value moves the objective beyond the simulator differs
    by world and stack. A fixed 4 % kept the model from pooling the readings of configs that
    differ only in values that move nothing (an HCCL buffer, an allocator flag, in a world where
    they cost no time): at 5 % noise each such config stood on its own one or two readings, and a
    config 4 % slower that read high was reported over the optimum read once low. Fitted (and the
    doubt's widening ended with its probes), the search benchmark's reported best at 5 % noise was
    within 3 % of the optimum in 90.0 % of 120 worlds instead of 75.8 %, at 2 % within 2 % in 95.8 %
    instead of 95.0 % (benchmarks/README.md). It fits from ``VALUE_SIGMA_MIN_READINGS``
    readings on: with fewer rows ``prior_sd`` is returned as it is."""
    if len(y) < VALUE_SIGMA_MIN_READINGS:
        return prior_sd
    resid = y - z @ prior_mean
    best, chosen = -np.inf, prior_sd
    for factor in VALUE_SIGMA_FACTORS:
        sd = np.where(values, prior_sd * factor, prior_sd)
        cov = (z * sd**2) @ z.T + np.diag(noise**2)
        try:
            chol = np.linalg.cholesky(cov)
        except np.linalg.LinAlgError:
            continue
        w = np.linalg.solve(chol, resid)
        score = (
            -0.5 * float(w @ w) - float(np.log(np.diag(chol)).sum()) - 0.5 * (math.log(factor) / VALUE_SIGMA_PRIOR) ** 2
        )
        if score > best:
            best, chosen = score, sd
    return chosen


def _predict(post: _Posterior, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sd of z·θ for every row of ``z`` (the quadratic form through a matrix product: a
    three-operand einsum loops in C without BLAS, 30x slower on a 13B space's rows)."""
    mean = z @ post.mean
    var = np.einsum("ij,ij->i", z @ post.cov, z)
    return mean, np.sqrt(np.maximum(var, 0.0))


class Guide:
    """Proposals over one ranking; rebuilt from the observations at every call (cheap)."""

    def __init__(self, ranking: Ranking, objective: tuple[str, str], settings: GuideSettings | None = None):
        self.ranking = ranking
        self.metric, self.direction = objective
        self.settings = settings or GuideSettings()
        p = ranking.predictions
        n = len(ranking.enumeration.configs)
        self.n = n
        self.valid = np.asarray(p.get("valid", np.ones(n, bool)), dtype=bool)
        self.limit = np.asarray(p.get("memory_limit_gib", np.full(n, np.inf)), dtype=float)
        self.objective_raw = np.asarray(p[self.metric], dtype=float)
        self.step_derived = self.metric in STEP_DERIVED and "step_time_s" in p
        comp_names = [k for k in COMPONENTS if f"time_{k}" in p]
        self.time_components = (
            np.stack([np.nan_to_num(np.asarray(p[f"time_{k}"], dtype=float)) for k in comp_names], axis=1)
            if comp_names and self.step_derived
            else None
        )
        mem_names = sorted(k for k in p if k.startswith("mem_"))
        self.mem_names = [k[len("mem_") :] for k in mem_names]
        self.mem_components = (
            np.stack([np.nan_to_num(np.asarray(p[k], dtype=float)) for k in mem_names], axis=1) if mem_names else None
        )
        self.peak = np.nan_to_num(np.asarray(p.get("peak_memory_gib", np.zeros(n)), dtype=float))
        self.one_hot, self.one_hot_names = self._one_hot(ranking.enumeration.configs)
        self.unpriced = self._unpriced_columns(
            ranking.enumeration.configs, np.asarray(p.get("step_time_s", self.objective_raw))
        )
        self.families = [family_of(c) for c in ranking.enumeration.configs]
        self._step_design_cache: tuple[np.ndarray, np.ndarray] | None = None
        self.walls: dict[tuple, list[int]] = {}  # a config's wall (_wall_of) -> the configs that share it
        self.wall_of: list[tuple] = []
        for i, c in enumerate(ranking.enumeration.configs):
            wall = _wall_of(c)
            self.wall_of.append(wall)
            self.walls.setdefault(wall, []).append(i)

    # ---- features ----------------------------------------------------------------------------------
    @staticmethod
    def _one_hot(configs: list[dict[str, Any]]) -> tuple[np.ndarray, list[str]]:
        """One indicator column per value of each parameter that varies, the value effects' basis.

        Derived values (``dp``, ``grad_accum``: functions of tp, pp, cp, micro-batch and the global
        batch) get no columns. Columns of their own would give every change of tp or micro-batch
        two or three independent effects in the prior (tp=1 is also dp=8 and grad_accum=8) that
        no measurement can tell apart: how two configs one tp or micro-batch value apart differ
        in memory was 1.4-1.7 times as uncertain as ``memory_value_sigma`` means, and an optimum
        with 6 % of the memory to spare was never sure enough to probe (13B world 8 of
        benchmarks/search_efficiency.py). Whatever a derived value adds beyond the simulator is
        an interaction of the parameters it follows from, and stays in the model's leave-one-out
        error (``_memory_discrepancy``)."""
        names: list[str] = []
        columns: list[np.ndarray] = []
        keys = sorted({k for c in configs for k in c} - set(DERIVED_PARAMS))
        for key in keys:
            values = [repr(c.get(key)) for c in configs]
            distinct = sorted(set(values))
            if not 2 <= len(distinct) <= _MAX_ONE_HOT_VALUES:
                continue
            arr = np.array(values)
            for v in distinct:
                names.append(f"{key}={v}")
                columns.append((arr == v).astype(float))
        if not columns:
            return np.zeros((len(configs), 0)), []
        return np.stack(columns, axis=1), names

    def _unpriced_columns(self, configs: list[dict[str, Any]], predicted: np.ndarray) -> np.ndarray:
        """One-hot columns of execution parameters (``EXECUTION_PARAMS``) whose value never changes
        the simulator's prediction: the model knows nothing of them, so their prior is wide and
        the first measurements decide."""
        unpriced = np.zeros(len(self.one_hot_names), dtype=bool)
        names = sorted({n.split("=", 1)[0] for n in self.one_hot_names} & set(EXECUTION_PARAMS))
        values = np.nan_to_num(predicted.astype(float))
        for name in names:
            groups: dict[str, float] = {}
            priced = False
            for config, v in zip(configs, values):
                key = repr(sorted((k, repr(x)) for k, x in config.items() if k != name))
                first = groups.setdefault(key, v)
                if abs(first - v) > 1e-9 * max(abs(first), 1e-30):
                    priced = True
                    break
            if not priced:
                unpriced |= np.array([n.split("=", 1)[0] == name for n in self.one_hot_names])
        return unpriced

    def _value_prior(self, sigma: float) -> np.ndarray:
        return np.where(self.unpriced, self.settings.unpriced_sigma, sigma)

    def _mem_design(self, rows: np.ndarray | slice, counts: Iterable[str] | None = None) -> np.ndarray:
        """Design rows of the memory model: the whole peak by default, or for each row what a
        measured peak of that kind counts (``PEAK_LEAVES_OUT``): the components it leaves out
        are zero, and a parameter value's effect is a share of what it counts."""
        comps = self.mem_components[rows] if self.mem_components is not None else self.peak[rows][:, None]
        if counts is not None and self.mem_components is not None:
            keep = np.array(
                [[name not in PEAK_LEAVES_OUT.get(c, ()) for name in self.mem_names] for c in counts], dtype=float
            )
            comps = comps * keep
        total = comps.sum(axis=1, keepdims=True)
        return np.concatenate([comps, self.one_hot[rows] * total], axis=1)

    # ---- models --------------------------------------------------------------------------------------
    def _objective_model(self, obs: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the objective for every config (in the objective's units)."""
        belief = self._objective_belief(obs)
        return belief.mean, belief.sd

    def _objective_belief(self, obs: list[Observation], at: np.ndarray | None = None) -> _ObjectiveBelief:
        """The objective model's posterior (:class:`_ObjectiveBelief`): the step-time model for
        step-derived objectives, else a multiplicative correction of the raw prediction by
        parameter values. ``at``: what it says of these rows only (its arrays indexed as ``at``;
        a leave-one-out prediction needs one row, not the whole space)."""
        s = self.settings
        sel = slice(None) if at is None else np.asarray(at, dtype=int)
        k = self.one_hot.shape[1]
        if self.step_derived and self.time_components is not None:
            rows = [
                (o.index, o.step_time_s)
                for o in obs
                if o.step_time_s and o.step_time_s > 0 and math.isfinite(o.step_time_s) and not o.interference
            ]
            design, post, execution, exec_post = self._step_posteriors(rows)
            design, execution = design[sel], execution[sel]
            step_mean, step_sd = self._step_prediction(design, post, execution, exec_post)
            raw_step = np.asarray(self.ranking.predictions["step_time_s"], dtype=float)[sel]
            floor = 0.05 * raw_step
            step_mean = np.maximum(step_mean, floor)
            inverse = STEP_DERIVED[self.metric] < 0
            scale = self.objective_raw[sel] * raw_step
            if inverse:  # throughput-like: inversely proportional to the step
                mean = scale / step_mean
                sd = mean * step_sd / step_mean
            else:
                mean, sd = step_mean, step_sd
            return _ObjectiveBelief(mean, sd, post, design, exec_post, execution, scale, floor, inverse)
        rows = [
            (o.index, o.objective)
            for o in obs
            if o.objective is not None
            and o.objective > 0
            and math.isfinite(o.objective)
            and self.objective_raw[o.index] > 0
            and not o.interference
        ]
        prior_mean = np.concatenate([[1.0], np.zeros(k)])
        prior_sd = np.concatenate([[s.prior_sigma], self._value_prior(s.value_sigma)])
        design = (
            np.concatenate([np.ones((self.n, 1)), self.one_hot], axis=1) * np.nan_to_num(self.objective_raw)[:, None]
        )
        if rows:
            idx = np.array([r[0] for r in rows])
            measured = np.array([r[1] for r in rows], dtype=float)
            z, y, noise = design[idx] / measured[:, None], np.ones(len(rows)), np.full(len(rows), s.noise)
            if s.fit_value_sigma:
                values = np.concatenate([[False], ~self.unpriced])  # the value effects the simulator prices
                prior_sd = _fitted_sigma(z, y, prior_mean, prior_sd, values, noise)
            post = _solve(z, y, prior_mean, prior_sd, noise)
        else:
            post = _Posterior(prior_mean, np.diag(prior_sd**2))
        mean, sd = _predict(post, design[sel])
        return _ObjectiveBelief(mean, sd, post, design[sel])

    def _step_design(self) -> tuple[np.ndarray, np.ndarray]:
        """The step-time model's design over the whole space (the predicted components, and the
        priced parameter values times the predicted step) and its execution one-hot: fixed by the
        ranking, built once (on a 70B space of 11,000 configs it was a third of each fit, and the
        certificate's leave-one-out fits a dozen)."""
        if self._step_design_cache is None:
            lin_cols = ~self.unpriced
            design = np.concatenate(
                [self.time_components, self.one_hot[:, lin_cols] * self.time_components.sum(axis=1, keepdims=True)],
                axis=1,
            )
            self._step_design_cache = (design, self.one_hot[:, self.unpriced])
        return self._step_design_cache

    def _step_posteriors(self, rows: list[tuple[int, float]]) -> tuple[np.ndarray, _Posterior, np.ndarray, _Posterior]:
        """The step-time model's posteriors: the linear model over the predicted components
        and the priced parameter values, times ``exp(Σ e_j φ_j)`` for the execution parameters
        the simulator does not price (graph vs pynative can be 20x apart: a factor, not a term).
        The two parts are fitted alternately (three rounds are plenty: each is a small solve).
        Returns (design, its posterior, the execution one-hot, its posterior)."""
        s = self.settings
        ncomp = self.time_components.shape[1]
        lin_cols = ~self.unpriced
        design, execution = self._step_design()
        prior_mean = np.concatenate([np.ones(ncomp), np.zeros(int(lin_cols.sum()))])
        prior_sd = np.concatenate([np.full(ncomp, s.prior_sigma), np.full(int(lin_cols.sum()), s.value_sigma)])
        n_exec = execution.shape[1]
        exec_prior = _Posterior(np.zeros(n_exec), np.eye(n_exec) * s.unpriced_sigma**2)
        if not rows:
            return design, _Posterior(prior_mean, np.diag(prior_sd**2)), execution, exec_prior
        idx = np.array([r[0] for r in rows])
        measured = np.array([r[1] for r in rows], dtype=float)
        noise = np.full(len(rows), s.noise)
        exec_post = exec_prior
        values = np.arange(len(prior_sd)) >= ncomp  # the value effects' columns
        rounds = 3 if n_exec else 1
        for round_ in range(rounds):
            adjusted = measured / np.exp(execution[idx] @ exec_post.mean)
            z = design[idx] / adjusted[:, None]
            if s.fit_value_sigma and round_ == rounds - 1:  # on the last round's execution factors
                prior_sd = _fitted_sigma(z, np.ones(len(rows)), prior_mean, prior_sd, values, noise)
            post = _solve(z, np.ones(len(rows)), prior_mean, prior_sd, noise)
            if not n_exec:
                break
            linear = np.maximum(design[idx] @ post.mean, 1e-12)
            exec_post = _solve(
                execution[idx], np.log(measured / linear), exec_prior.mean, np.full(n_exec, s.unpriced_sigma), noise
            )
        return design, post, execution, exec_post

    @staticmethod
    def _step_prediction(
        design: np.ndarray, post: _Posterior, execution: np.ndarray, exec_post: _Posterior
    ) -> tuple[np.ndarray, np.ndarray]:
        """Step time mean and sd of every config from :meth:`_step_posteriors`."""
        mean, sd = _predict(post, design)
        if execution.shape[1]:
            factor_log, factor_sd = _predict(exec_post, execution)
            mean = mean * np.exp(factor_log)
            sd = mean * np.sqrt((sd / np.maximum(mean / np.exp(factor_log), 1e-300)) ** 2 + factor_sd**2)
        return mean, sd

    def _memory_model(self, obs: list[Observation]) -> tuple[np.ndarray, np.ndarray]:
        belief = self._memory_belief(obs)
        return belief.mean, belief.sd

    def _memory_belief(self, obs: list[Observation]) -> "_MemoryBelief":
        """Mean and standard deviation of every config's peak memory (GiB).

        Three kinds of evidence: a measured peak; an OOM, censored at the capacity, or at what the
        allocator said the config needed at least (in use + requested) when its message carries
        the byte counts; a fit although predicted over the limit (at most the capacity). The
        posterior's own uncertainty only covers what the linear model can represent, so it is
        widened by the model's error on the configs it has seen, measured leave-one-out: when
        the first peaks disagree with the prediction in a way the factors cannot absorb (a term
        the simulator does not have), every unmeasured config's memory becomes less certain."""
        rows, targets, noise, bound, counts = self._memory_evidence(obs)
        design = self._mem_design(slice(None))
        prior = self._memory_prior()
        if not rows:
            return _MemoryBelief(prior, design, *_predict(prior, design))
        idx = np.array(rows)
        t = np.array(targets)
        nz = np.array(noise)
        kinds = np.array(counts)
        active = self._informative_bounds(idx, t, nz, np.array(bound), kinds)
        if not active.any():
            return _MemoryBelief(prior, design, *_predict(prior, design))
        idx, t, nz, kinds = idx[active], t[active], nz[active], kinds[active]
        post = self._memory_fit(idx, t, nz, kinds)
        mean, sd = _predict(post, design)
        discrepancy = self._memory_discrepancy(idx, t, nz, post, kinds)
        if discrepancy > 0:
            sd = np.sqrt(sd**2 + (discrepancy * np.abs(mean)) ** 2)
        return _MemoryBelief(post, design, mean, sd, discrepancy)

    def _memory_prior(self) -> _Posterior:
        s = self.settings
        k = self.one_hot.shape[1]
        ncomp = self.mem_components.shape[1] if self.mem_components is not None else 1
        prior_mean = np.concatenate([np.ones(ncomp), np.zeros(k)])
        prior_sd = np.concatenate([np.full(ncomp, s.memory_sigma), np.full(k, s.memory_value_sigma)])
        return _Posterior(prior_mean, np.diag(prior_sd**2))

    def _memory_fit(self, idx: np.ndarray, targets: np.ndarray, noise: np.ndarray, counts: np.ndarray) -> _Posterior:
        prior = self._memory_prior()
        return _solve(
            self._mem_design(idx, counts) / targets[:, None],
            np.ones(len(idx)),
            prior.mean,
            np.sqrt(np.diag(prior.cov)),
            noise,
        )

    def usable_limit(
        self, obs: list[Observation], belief: "_MemoryBelief | None" = None
    ) -> tuple[np.ndarray, np.ndarray | float]:
        """The memory each config may use, and its uncertainty (GiB). The profile's capacity, until
        an OOM's byte counts prove less is usable: a request that failed although in use +
        requested stayed below the capacity (runtime and communication reserves, a driver that
        keeps some). The usable memory then lies between what was in use (and every peak that
        fitted) and in use + requested; the middle of that interval, with its spread as
        uncertainty.

        That interval is learnt on the config that failed. HCCL and NCCL allocate their buffers
        per communicator, outside the framework's allocator, and how much of them the measured
        peaks counted is unknown: a config with more communication buffers than that one (more
        communicators, a larger ``HCCL_BUFFSIZE``) may have up to the difference less usable. Its
        usable memory is lowered by half the difference of the predicted buffers, with the
        difference's uniform spread added to its uncertainty; one with fewer is not credited."""
        nominal = self.limit
        failed = [
            o
            for o in obs
            if o.status == "oom"
            and o.oom_counts == "device"
            and o.oom_needed_gib
            and o.oom_needed_gib < 0.995 * nominal[o.index]
        ]
        lows = [float(o.peak_memory_gib) for o in obs if o.status in ("ok", "pruned") and o.peak_memory_gib]
        # an OOM whose message gives no numbers still bounds what is usable: below what that config
        # needed, where its peak is known (its memory profile, or a memory model the measured peaks
        # pin down), and above every peak that fitted
        bounds = [(o.oom_needed_gib, o) for o in failed]
        bounds += [b for b in self._plain_oom_bounds(obs, lows) if b[0] < 0.995 * nominal[b[1].index]]
        reported = [o for o in obs if o.usable_gib and o.usable_gib > 0]
        if reported and not bounds:
            return self._reported_usable(reported, belief)
        if not bounds:
            return self.device_limit(), 0.0
        upper, taught_by = min(bounds, key=lambda b: b[0])
        lows += [o.oom_in_use_gib for o in failed if o.oom_in_use_gib is not None and o.oom_in_use_gib <= upper]
        lower = max(lows) if lows else 0.9 * upper
        lower = min(lower, upper)
        if taught_by.oom_needed_gib:  # byte counts: in use and in use + requested, a narrow interval
            middle, sd = 0.5 * (lower + upper), (upper - lower) / math.sqrt(12.0)
        else:
            middle, sd = self._below_plain_oom(lower, upper, taught_by.index)
        usable = np.minimum(self.device_limit(), middle)
        return self._less_for_more_buffers(usable, sd, taught_by.index)

    def _below_plain_oom(self, lower: float, upper: float, taught_by: int) -> tuple[float, float]:
        """The usable memory after an OOM whose message gave no numbers: what was usable before (the
        capacity the device check measured, within 3 %; the nominal one, within 8 %, without a check:
        the usable memory runs 3-12 % below it), known now to lie between the highest peak that
        fitted and what the failed config needed. The middle of that interval threw the device
        check away: in a 13B world of benchmarks/search_efficiency.py one plain OOM of a config a
        few GiB over the limit put the usable memory at 54.6 GiB (the world's: 60.0), and every
        memory profile after it, the optimum's included, predicted an OOM that would not have
        happened. The prior truncated to the interval keeps it near the bound."""
        prior = float(self.device_limit()[taught_by])
        spread = (0.03 if self.settings.device_usable_gib else 0.08) * prior
        if upper - lower <= 1e-9:
            return upper, 0.0
        return _truncated_normal(prior, spread, lower, upper)

    def device_limit(self) -> np.ndarray:
        """The capacity each config's predicted peak may reach: the nominal one, or, where the device
        check measured less usable by the allocator (``settings.device_usable_gib``), that plus what
        the model puts outside the allocator for the config (the runtime reserve its peak counts),
        when that is clearly (1 %) below the nominal."""
        usable = self.settings.device_usable_gib
        if not usable or usable <= 0:
            return self.limit
        outside = (
            self.mem_components[:, self.mem_names.index("runtime_reserve")]
            if self.mem_components is not None and "runtime_reserve" in self.mem_names
            else 0.0
        )
        limit = np.minimum(self.limit, float(usable) + outside)
        return np.where(limit < 0.99 * self.limit, limit, self.limit)

    def _plain_oom_bounds(self, obs: list[Observation], fitted: list[float]) -> list[tuple[float, Observation]]:
        """(what the config needed, at least, by its known peak; the OOM) for each out-of-memory probe
        whose message gave no byte counts: the peak its memory profile predicted (plus one sd), else
        the peak the measured peaks alone predict where they pin it within 3 %. None where the peak is
        not known that well, or where a config that fitted already peaked higher (the estimate was
        wrong, not the capacity)."""
        plain = [o for o in obs if o.status == "oom" and not o.oom_needed_gib and not o.usable_gib]
        if not plain:
            return []
        highest = max(fitted) if fitted else 0.0
        out = []
        measured = None
        for o in plain:
            if o.profile_peak_gib:
                needed = float(o.profile_peak_gib) + float(o.profile_sd_gib or 0.0)
            else:
                if measured is None:  # the belief from the peaks alone (no OOM censoring in it)
                    measured = self._memory_belief([x for x in obs if x.status in ("ok", "pruned")])
                mean, sd = float(measured.mean[o.index]), float(measured.sd[o.index])
                if not (mean > 0 and sd <= 0.03 * mean):
                    continue
                needed = mean + sd
            if needed > highest:
                out.append((needed, o))
        return out

    def _less_for_more_buffers(
        self, usable: np.ndarray, sd: np.ndarray | float, taught_by: int
    ) -> tuple[np.ndarray, np.ndarray | float]:
        """A usable memory learnt on config ``taught_by``, for every config: one with more
        communication buffers than it (HCCL/NCCL's, per communicator, outside the allocator) is
        lowered by half the difference, with the difference's uniform spread as uncertainty; one
        with fewer is not credited."""
        if self.mem_components is None or "comm_buffers" not in self.mem_names:
            return usable, sd
        comm = self.mem_components[:, self.mem_names.index("comm_buffers")]
        more = np.maximum(comm - comm[taught_by], 0.0)
        return np.minimum(self.limit, usable - 0.5 * more), np.sqrt(np.asarray(sd) ** 2 + more**2 / 12.0)

    def _reported_usable(
        self, reported: list[Observation], belief: "_MemoryBelief | None" = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The usable memory from what probes reported their allocator could use. A report is the
        allocator's share; the device's is that plus what the memory model puts outside the
        allocator for the config that reported (runtime, communication buffers: ``PEAK_LEAVES_OUT``'s
        "reserved"), the same figure it adds to every config's peak, as fitted to the peaks
        measured so far (``belief``; the prior without one), with that part's uncertainty. The
        lowest report teaches (the device with the least to spare decides a multi-device trial),
        and only when it is clearly (2 sd) below the capacity;
        a config with more communication buffers than it is lowered by half the difference, with
        the difference's uniform spread as uncertainty (as after an OOM, :meth:`usable_limit`)."""
        nominal = self.limit
        post = belief.post if belief is not None else self._memory_prior()
        rows = np.array(sorted({o.index for o in reported}))
        outside_design = self._mem_design(rows) - self._mem_design(rows, ["reserved"] * len(rows))
        outside = dict(zip(rows.tolist(), outside_design @ post.mean))
        outside_var = dict(zip(rows.tolist(), np.einsum("ij,jk,ik->i", outside_design, post.cov, outside_design)))
        device = [(float(o.usable_gib) + float(outside[o.index]), o) for o in reported]
        least, taught_by = min(device, key=lambda d: d[0])
        spread = math.hypot(self.settings.peak_noise * least, math.sqrt(max(0.0, float(outside_var[taught_by.index]))))
        if least + 2.0 * spread >= nominal[taught_by.index]:
            # not clearly below the capacity: what the model puts outside the allocator is itself
            # uncertain, and a capacity lowered by that error would turn fitting configs away
            return nominal, 0.0
        usable = np.minimum(nominal, least)
        sd = np.full(self.n, spread)
        return self._less_for_more_buffers(usable, sd, taught_by.index)

    def _memory_evidence(
        self, obs: list[Observation]
    ) -> tuple[list[int], list[float], list[float], list[int], list[str]]:
        """Rows, target peaks, relative noise, what each target is (0 a measured peak, +1 a lower
        bound: an OOM, it needed at least this; -1 an upper bound: it fitted, at most this) and
        what it counts (``PEAK_LEAVES_OUT``: an OOM's and a bound's are the device's)."""
        rows, targets, noise, bound, counts = [], [], [], [], []
        usable, _ = self.usable_limit(obs)
        for o in obs:
            cap = usable[o.index]
            if o.oom_counts == "reserved":
                # censored within the pool it could use: it needed more than the pool, at least in use +
                # requested, counted as the pool counts (the runtime and communicators beside it left out)
                rows.append(o.index)
                targets.append(max(float(o.oom_needed_gib or 0.0), float(o.usable_gib)))
                noise.append(0.03)
                bound.append(1)
                counts.append(o.oom_counts)
            elif o.status == "oom" and math.isfinite(cap):
                # censored: it needed more than what is usable; the allocator's byte counts say how much
                needed = o.oom_needed_gib if o.oom_needed_gib and o.oom_needed_gib > cap * 1.02 else cap * 1.02
                rows.append(o.index)
                targets.append(needed)
                noise.append(0.03)
                bound.append(1)
                counts.append("device")
            elif o.peak_memory_gib and o.peak_memory_gib > 0 and o.status in ("ok", "pruned"):
                rows.append(o.index)
                targets.append(float(o.peak_memory_gib))
                noise.append(self.settings.peak_noise)
                bound.append(0)
                counts.append(o.peak_counts if o.peak_counts in PEAK_LEAVES_OUT else "device")
            elif o.profile_peak_gib and o.profile_peak_gib > 0 and o.status != "oom":
                # the memory profile's extrapolation: a measurement of this config's peak, as noisy
                # as the profile's fit (a full probe's own peak, where it ran, is the better one)
                rows.append(o.index)
                targets.append(float(o.profile_peak_gib))
                noise.append(max(self.settings.peak_noise, float(o.profile_sd_gib or 0.0) / o.profile_peak_gib))
                bound.append(0)
                counts.append(o.peak_counts if o.peak_counts in PEAK_LEAVES_OUT else "device")
            elif o.status in ("ok", "pruned") and math.isfinite(cap) and self.peak[o.index] > cap:
                rows.append(o.index)  # fit although predicted over: at most the capacity
                targets.append(cap * 0.97)
                noise.append(0.05)
                bound.append(-1)
                counts.append("device")
        return rows, targets, noise, bound, counts

    def _informative_bounds(
        self, idx: np.ndarray, targets: np.ndarray, noise: np.ndarray, bound: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """Which evidence rows to fit: every measured peak, and a bound only where the model
        without it violates it (a censored observation, as in a Tobit fit). An OOM at 41 GiB of
        a config predicted at 60 says nothing new; fitted as a point it would pull the
        prediction down to 41 and make the config that failed look likely to fit."""
        active = bound == 0
        for _ in range(4):
            post = (
                self._memory_fit(idx[active], targets[active], noise[active], counts[active])
                if active.any()
                else self._memory_prior()
            )
            predicted = self._mem_design(idx, counts) @ post.mean
            violated = ((bound > 0) & (predicted < targets)) | ((bound < 0) & (predicted > targets))
            grown = active | violated
            if (grown == active).all():
                break
            active = grown
        return active

    def _memory_discrepancy(
        self, idx: np.ndarray, targets: np.ndarray, noise: np.ndarray, post: _Posterior, counts: np.ndarray
    ) -> float:
        """Relative error of the memory model on configs it was not fitted to (leave-one-out),
        beyond what the model itself expected there: 0 while its errors stay within its own
        predictive uncertainty and the measurement noise.

        The discrepancy is the error no measurement of another config removes, so it is what the
        leave-one-out errors show *in excess* of the left-out row's predictive variance and its
        noise (``mean(e² - v - n²)``). Counting the whole error counted twice what the posterior
        already carries for every config that shares the left-out row's unmeasured values: the
        one config of a ZeRO stage measured 7 % above its prediction (a value effect's prior is
        8 %) widened every config by 1.9 % of its peak, those the other measurements pin down
        included (benchmarks/README.md, "The model's error beyond its own uncertainty")."""
        n = len(idx)
        if n < 2:
            # one measurement: its error against the prior prediction is all there is to go on
            # (nothing is left out yet, so nothing to compare with an expected error)
            raw = float(self._mem_design(idx, counts)[0] @ self._memory_prior().mean)
            err = abs(targets[0] / max(raw, 1e-9) - 1.0)
            return float(max(0.0, err - noise[0]))
        excess = []
        for i in range(n):
            keep = np.arange(n) != i
            loo = self._memory_fit(idx[keep], targets[keep], noise[keep], counts[keep])
            z = self._mem_design(idx[i : i + 1], counts[i : i + 1])[0]
            predicted = max(float(z @ loo.mean), 1e-9)
            err = targets[i] / predicted - 1.0
            excess.append(err * err - float(z @ loo.cov @ z) / predicted**2 - noise[i] ** 2)
        return float(math.sqrt(max(0.0, float(np.mean(excess)))))

    def fit_probability(
        self, obs: list[Observation], mem_mean: np.ndarray, mem_sd: np.ndarray, belief: "_MemoryBelief | None" = None
    ) -> np.ndarray:
        """P(fits in memory) of every config. After an OOM (or a memory profile that predicted one),
        a config the model gives less headroom than the one that failed is at most as likely to
        fit as the model now says the failed one is: whatever made it fail (a term the model
        lacks) is there at least as much."""
        usable, usable_sd = self.usable_limit(obs, belief)
        z = (usable - mem_mean) / np.maximum(np.sqrt(mem_sd**2 + usable_sd**2), 1e-9)
        p_fit = _norm_cdf(z) ** self.fit_correction(obs)
        relative = (usable - mem_mean) / np.maximum(usable, 1e-9)  # headroom as a share of what is usable
        for o in obs:
            if o.status in ("oom", "oom_predicted"):  # measured over, or profiled over, the limit
                tighter = relative <= relative[o.index]
                cap = p_fit[o.index]
                if o.status == "oom_predicted" and o.profile_p_fit is not None:
                    # the profile's own verdict, where the model still thinks it likelier: a profile
                    # measured this layout against what its allocator could use, which the model's
                    # capacity may not know (70B act-extra world 2 of benchmarks/search_efficiency.py:
                    # 34 of 38 trials were profiles of siblings the model kept at P(fits) 0.4-0.6,
                    # and their profiles said no)
                    cap = min(cap, o.profile_p_fit)
                p_fit = np.where(tighter, np.minimum(p_fit, cap), p_fit)
        return np.where(self.same_wall(obs), 0.0, p_fit)

    def _after_wall(self, obs: list[Observation], index: int, mem_mean: np.ndarray, belief: "_MemoryBelief") -> str:
        """Where the chosen config is a near sibling (two knobs or fewer apart) of one that ran out of
        memory: what it changes, the saving the model predicts, and the shortfall it must cover."""
        configs = self.ranking.enumeration.configs
        chosen = configs[index]
        usable, _ = self.usable_limit(obs, belief)
        for o in obs:
            if o.status != "oom":
                continue
            failed = configs[o.index]
            changed = sorted(k for k in set(chosen) | set(failed) if chosen.get(k) != failed.get(k))
            if not changed or len([k for k in changed if k not in ("dp", "grad_accum")]) > 2:
                continue
            if o.oom_counts == "reserved" and o.oom_needed_gib:  # within the pool it had
                shortfall = max(o.oom_needed_gib - o.usable_gib, 0.0)
            else:
                shortfall = max((o.oom_needed_gib or float(mem_mean[o.index])) - float(usable[o.index]), 0.0)
            saving = float(mem_mean[o.index] - mem_mean[index])
            return (
                f"after trial {o.number} ran out of memory: {', '.join(f'{k} {chosen.get(k)}' for k in changed)} "
                f"predicted to save {saving:.1f} GiB against a shortfall of {shortfall:.1f} GiB (usable "
                f"{float(usable[o.index]):.1f} GiB)"
            )
        return ""

    def same_wall(self, obs: list[Observation]) -> np.ndarray:
        """The configs that differ from one that ran out of memory only in knobs that cannot save
        memory (:data:`SAME_WALL_FLAGS`, bf16 for fp16, an HCCL setting other than a smaller
        ``HCCL_BUFFSIZE``): they run into the same wall, and are not probed. (The config that ran
        out keeps the model's P(fits), which caps its less roomy neighbours'.)"""
        out = np.zeros(self.n, dtype=bool)
        configs = self.ranking.enumeration.configs
        for o in obs:
            if o.status != "oom":
                continue
            buffer = _buffer_of(configs[o.index])
            for i in self.walls[self.wall_of[o.index]]:
                if i != o.index and not (buffer is not None and (_buffer_of(configs[i]) or buffer) < buffer):
                    out[i] = True
        return out

    def fit_correction(self, obs: list[Observation]) -> float:
        """The exponent that corrects P(fits) where it over-promised (1: it did not). Among the full
        probes run at a stated P(fits) of 0.5 or more, fewer fitted than the sum of those P(fits)
        promised, beyond one binomial sd: the exponent ``g`` (P(fits) ** g) that makes the promise
        match what happened, from 1 up to 8."""
        stated = [
            (o.stated_p_fit, o.status != "oom") for o in obs if o.stated_p_fit is not None and o.stated_p_fit >= 0.5
        ]
        stated = [(p, fit) for p, fit in stated if p < 1.0]
        if len(stated) < 3:
            return 1.0
        p = np.array([x for x, _ in stated])
        fits = sum(1 for _, fit in stated if fit)
        if fits >= p.sum() - math.sqrt(float(np.sum(p * (1.0 - p)))):
            return 1.0
        low, high = 1.0, 8.0
        for _ in range(30):
            mid = 0.5 * (low + high)
            if np.sum(p**mid) > fits:
                low = mid
            else:
                high = mid
        return high

    # ---- decisions -----------------------------------------------------------------------------------
    def close_call(
        self,
        obs: list[Observation],
        exclude: Iterable[int] = (),
        allowed: np.ndarray | None = None,
        estimate: np.ndarray | None = None,
        measure_noise: bool = True,
    ) -> Proposal | None:
        """Another measurement in the race of the contenders (issue 44), or None when the race is
        settled or may not go on. ``measure_noise``: whether a noise no repeat has measured is
        reason enough to race (before the study stops, where nothing else would use the budget;
        not where a re-measurement competes with a new config).

        The leader is what the study reports: among the measured configs whose mean reading the
        noise cannot tell from the best mean reading, the one with the best estimate
        (``estimate``, the objective model's mean; the mean reading without one), as
        :func:`autotune.study.records.best_records` chooses. Its certificate
        (:func:`autotune.objectives.race.certificate`) says how likely it is within
        ``tie_tolerance`` of the best measured config; below ``confidence`` the config that
        threatens it most is raced against it, while that threat alone could keep the claim short
        (its own P below 1 - (1 - confidence) / K for K threats, the union bound; stopping at a
        threat above ``confidence`` left many threats of 0.97 each, a claim of 0.82, unraced). The
        less-measured of the two is measured again (A, B, A, B: a drift of the machine hits both).
        A config already has ``max_readings``, is running, or is not ``allowed``: the next threat.
        The race spends at most ``confirm_readings`` re-measurements in the study. The noise is the
        study's: the spread of the configs it measured more than once, never below ``noise``; while
        no config but the first
        measured (the drift control) was read twice it is assumed, nothing is certified, and the
        closest threat is raced whatever its P."""
        s = self.settings
        maximize = self.direction == "maximize"
        values = readings_of(obs)
        if len(values) < 2 or self.race_spent(obs) >= s.confirm_readings:
            return None
        first = self._control(obs)  # the report's control, drift checks or not (records.best_certificate)
        control = first if s.drift_every > 0 else None
        floor = self.noise_floor(obs)
        noise = self._noise({i: v for i, v in values.items() if i != control}, floor)  # the control spans any drift
        leader = self.race_leader(values, noise, estimate)
        believed, dof = noise_belief((v for i, v in values.items() if i != first), floor)
        measured_noise = dof > 0
        # each config's readings with the model's prediction of it from the others, as the report reads
        # them (a leave-one-out fit per measured config: the race runs only at the end of the budget)
        priors = self.measured_priors(obs)
        cert = certificate(values, leader, believed, s.tie_tolerance, s.confidence, maximize, dof, priors)
        if cert.certified:
            return None
        busy = set(exclude)
        numbers = {o.index: o.number for o in obs}
        configs = self.ranking.enumeration.configs
        for threat, p in cert.threats:
            # a threat is raced while it alone could keep the claim below the confidence: with K threats,
            # each above 1 - (1 - confidence) / K puts the whole claim above it (the union bound)
            if p >= 1.0 - (1.0 - s.confidence) / len(cert.threats) and (measured_noise or not measure_noise):
                break
            for index in sorted((threat, leader), key=lambda i: (len(values[i]), i != leader)):
                if len(values[index]) < s.max_readings and index not in busy and (allowed is None or allowed[index]):
                    a, b = float(np.mean(values[leader])), float(np.mean(values[threat]))
                    sign = 1.0 if maximize else -1.0
                    spread = noise * math.sqrt(1.0 / len(values[leader]) + 1.0 / len(values[threat]))
                    stake = (
                        float(_expected_improvement(np.array([sign * (b - a) / abs(a)]), np.array([spread]), 0.0)[0])
                        if a
                        else 0.0
                    )
                    why = (
                        f"the leader is within {s.tie_tolerance:.0%} of the best measured with P {cert.p:.0%}, "
                        f"short of {s.confidence:.0%}"
                        if measured_noise
                        else f"the noise is assumed ({100 * noise:.2g}% per reading: no config was measured twice), "
                        "so no claim is certified before a repeat measures it"
                    )
                    return Proposal(
                        index,
                        configs[index],
                        (
                            f"re-measure (race): trial {numbers.get(leader)} leads ({a:.4g}, {len(values[leader])} "
                            f"reading(s)) but trial {numbers.get(threat)} ({b:.4g}, {len(values[threat])}) may beat "
                            f"it by more than {s.tie_tolerance:.0%} (P {1 - p:.0%}); {why}"
                        ),
                        remeasure=True,
                        stake=stake,
                    )
        return None

    def unmeasured_claims(self, obs: list[Observation], loo: "LeaveOneOut | None" = None) -> dict[int, float]:
        """For every measured config: P(no config the study has not measured beats its mean reading
        by more than ``tie_tolerance``), by the objective model and P(fits): the part of "within the
        tolerance of the best" the readings cannot speak for (the report takes the one of the config
        it names). The configs not measured (nor run out of memory) share the model's coefficients,
        so their errors move together: the claim is taken over joint draws of the model
        (:class:`_ObjectiveBelief`), and in each draw every config that beats the reading counts
        with its P(fits): P = E_draws[prod_j (1 - P(fits)_j 1{beats_j})]. (A product of each
        config's own chance, as before, multiplied many small doubts that share one cause into a
        small P: at 5 % noise, studies that said P below 0.5 were right 11 times in 19, benchmarks/README.md.)
        Configs whose own chance is below ``CLAIM_NEGLIGIBLE`` enter by that chance, outside the
        draws. The ``CLAIMED_CONFIGS`` best mean readings only (the report names one of them); {}
        with nothing measured."""
        values = readings_of(obs)
        if not values:
            return {}
        s = self.settings
        rest = self.valid.copy()
        # a config whose memory profile predicted an OOM was not run: it stays, at its P(fits)
        rest[[o.index for o in obs if o.status != "oom_predicted"]] = False
        if not rest.any():
            return {i: 1.0 for i in values}
        model = self._objective_belief(obs)
        # the model's spread narrowed as far as its misses of this study's own readings bear it out,
        # never widened: misses beyond its sd came with noisy readings (5 % noise, a heavy tail), and
        # widening by them made claims that held 97 % of the time say P 0.54 on average
        scale = min(1.0, loo.scale) if loo is not None else 1.0
        belief = self._memory_belief(obs)
        p_fit = self.fit_probability(obs, belief.mean, belief.sd, belief)
        where = np.flatnonzero(rest)
        m, d, f = model.mean[where], np.maximum(scale * model.sd[where], 1e-12), np.clip(p_fit[where], 0.0, 1.0)
        maximize = self.direction == "maximize"
        sign = 1.0 if maximize else -1.0
        top = self._best_first(values)[:CLAIMED_CONFIGS]
        thresholds = {}
        chances = {}
        for i in top:
            lead = float(np.mean(values[i]))
            bar = lead / (1.0 - s.tie_tolerance) if maximize else lead / (1.0 + s.tie_tolerance)
            z = sign * (m - bar) / d  # P(beats) = P(mu_j beyond the bar)
            beats = np.nan_to_num(0.5 * _erfc_array(-z / math.sqrt(2.0)))
            thresholds[i], chances[i] = bar, np.clip(f * beats, 0.0, 1.0 - 1e-15)
        # the configs any claim may hinge on: drawn jointly (at most CLAIM_DRAWN, the likeliest)
        likeliest = np.max(np.stack(list(chances.values())), axis=0)
        drawn = np.flatnonzero(likeliest >= CLAIM_NEGLIGIBLE)
        drawn = drawn[np.argsort(-likeliest[drawn], kind="stable")[:CLAIM_DRAWN]]
        draws = (
            model.draws(where[drawn], CLAIM_DRAWS, np.random.default_rng(CLAIM_SEED)) if drawn.size else None
        )  # (configs, draws); a fixed seed: the same study, the same claim
        if draws is not None and scale != 1.0:
            centre = m[drawn][:, None]
            draws = centre + scale * (draws - centre)
        outside = np.ones(len(where), dtype=bool)
        outside[drawn] = False
        log_miss = np.log1p(-np.clip(f[drawn], 0.0, 1.0 - 1e-15))  # a beating config that does not fit
        out = {}
        for i in top:
            p = float(np.exp(np.sum(np.log1p(-chances[i][outside]))))
            if draws is not None:
                beat = (sign * (draws - thresholds[i]) > 0).astype(float)
                p *= float(np.mean(np.exp(log_miss @ beat)))
            out[i] = p
        return out

    def _predicted_without(self, obs: list[Observation], index: int) -> tuple[float, float]:
        """(mean, sd) of the objective model's prediction of config ``index`` from every other
        measurement: refitted with none of that config's observations (leave one out)."""
        belief = self._objective_belief([o for o in obs if o.index != index], at=np.array([index]))
        return float(belief.mean[0]), float(belief.sd[0])

    def leave_one_out(self, obs: list[Observation]) -> "LeaveOneOut | None":
        """How well the objective model predicted this study's own readings: each of the
        ``PRIOR_CONFIGS`` best measured configs (those a claim can hinge on: a fit each, and the race
        asks at every trial of its held-back budget) predicted from every *other* measurement, and
        the factor on the model's sd that makes those misses as large as it says
        (:class:`LeaveOneOut`). The certificate's claims read the model through it
        (:meth:`measured_priors`, :meth:`unmeasured_claims`). None below
        ``PRIOR_MIN_MEASURED`` measured configs: too few to check the model by."""
        values = readings_of(obs)
        if len(values) < PRIOR_MIN_MEASURED:
            return None
        control = self._control(obs)
        noise, _ = noise_belief((v for i, v in values.items() if i != control), self.noise_floor(obs))
        top = self._best_first(values)[:PRIOR_CONFIGS]
        rows: dict[int, tuple[float, float, float, float]] = {}
        for i in top:
            v = values[i]
            mean, sd = self._predicted_without(obs, i)
            reading = float(np.mean(v))
            if math.isfinite(mean) and math.isfinite(sd) and mean > 0 and sd > 0 and reading:
                rows[i] = (mean, sd, reading, (noise * abs(reading)) ** 2 / len(v))
        if len(rows) < PRIOR_MIN_MEASURED:
            return None
        return LeaveOneOut(rows, _sd_scale(list(rows.values())))

    def measured_priors(
        self, obs: list[Observation], loo: "LeaveOneOut | None" = None
    ) -> dict[int, tuple[float, float]]:
        """For the best measured configs: (mean, sd) of what the objective model predicts of its true
        mean from every *other* measurement (:meth:`leave_one_out`, its sd scaled as the study's own
        misses say), the certificate's second measurement of it
        (:func:`autotune.objectives.race.certificate`'s ``priors``). Without it, ten configs read
        once a few percent below a leader multiplied into a claim the leader never earned, though it
        was right: at 2 % noise, studies that said P 0.50-0.80 were right 14 times in 16. {} where
        the model cannot be checked (``leave_one_out`` None)."""
        loo = loo if loo is not None else self.leave_one_out(obs)
        if loo is None:
            return {}
        return {i: (m, loo.scale * sd) for i, (m, sd, _, _) in loo.rows.items()}

    def with_interference(self, obs: list[Observation]) -> list[Observation]:
        """``obs`` with the readings a slowdown spoiled marked (``Observation.interference``,
        :mod:`autotune.objectives.interference`): of a config measured more than once, a reading
        worse than its best by more than its interference gap (judged against the noise the other
        configs' repeats show, never below :meth:`noise_floor`). An objective a slowdown does not make worse (a peak of
        memory) is read as measured; so is the control config (the first measured: its readings span
        the study on purpose, and a slowdown of it is the drift check's to read). The report reads
        the same (``autotune.study.records.interference_readings``)."""
        if not slowed_by_interference(self.metric):
            return obs
        control = self._control(obs)
        groups: dict[int, list[int]] = {}
        for k, o in enumerate(obs):
            if o.status == "ok" and o.objective is not None and math.isfinite(o.objective) and o.index != control:
                groups.setdefault(o.index, []).append(k)
        rows = list(groups.values())
        verdicts = interference_flags(
            [[obs[k].objective for k in ks] for ks in rows], self.noise_floor(obs), self.direction == "maximize"
        )
        out = list(obs)
        for ks, flags in zip(rows, verdicts):
            for k, flag in zip(ks, flags):
                if flag != obs[k].interference:
                    out[k] = replace(obs[k], interference=flag)
        return out

    def suspect_reading(
        self, obs: list[Observation], exclude: Iterable[int] = (), allowed: np.ndarray | None = None
    ) -> Proposal | None:
        """A config read once, far worse than the model predicts of it from every other measurement,
        where that prediction would make it lead: measured again (issue 44, the heavy tail; None when
        there is none). A slowdown of the machine spoils one reading and the model cannot tell it
        from the config: on the search benchmark's heavy-tailed family 5 of 11 misses had read the
        optimum slow once and never again. Its second reading settles it: far better than the
        first, and the first is set aside as interference (:meth:`with_interference`); close to it,
        and the model was wrong, at the price of one probe.

        The config qualifies when (the model refitted without its reading: leave one out) the
        prediction is at least within ``tie_tolerance`` of the best mean reading, its reading is
        worse than the prediction by more than the interference gap (a second reading could set it
        aside) and by ``SUSPECT_Z`` sd of the reading and the prediction together, and that gap is
        no larger than ``SUSPECT_MAX_SLOWDOWN``. The likeliest leader goes first. It spends the
        race's re-measurements (``confirm_readings``)."""
        s = self.settings
        values = readings_of(obs)
        if len(values) < SUSPECT_MIN_MEASURED or self.race_spent(obs) >= s.confirm_readings:
            return None
        if not slowed_by_interference(self.metric):
            return None
        maximize = self.direction == "maximize"
        sign = 1.0 if maximize else -1.0
        means = {i: float(np.mean(v)) for i, v in values.items()}
        best = max(means.values()) if maximize else min(means.values())
        if not best:
            return None
        bar = best * (1.0 - s.tie_tolerance) if maximize else best * (1.0 + s.tie_tolerance)
        busy, control = set(exclude), self._control(obs)
        # the gap a second reading would be judged by: the other configs' repeats, the control's apart
        floor = self.noise_floor(obs)
        repeated = [v for i, v in values.items() if len(v) > 1 and i != control]
        gap = interference_gap(repeated, floor)
        # a reading's own sd: the floor, the default while no repeat has shown what runs add (_noise)
        reading_sd = floor if repeated else max(floor, s.noise)
        taken = readings_taken(obs)

        def worse_by(reading: float, than: float) -> float:  # how much worse ``reading`` is, as a share
            return (than / reading - 1.0) if maximize else (reading / than - 1.0)

        suspects = [
            i
            for i, v in values.items()
            if taken.get(i) == 1
            and i != control
            and i not in busy
            and (allowed is None or allowed[i])
            and v[0] > 0
            and sign * (v[0] - bar) < 0  # not already within the tolerance of the best
            and worse_by(v[0], bar) <= SUSPECT_MAX_SLOWDOWN
        ]
        found = []
        for i in suspects:
            mean, sd = self._predicted_without(obs, i)
            reading = values[i][0]
            if not (math.isfinite(mean) and math.isfinite(sd)) or mean <= 0 or sign * (mean - bar) < 0:
                continue
            shortfall = worse_by(reading, mean)
            z = sign * (mean - reading) / math.hypot(reading_sd * abs(reading), sd)
            if gap < shortfall <= SUSPECT_MAX_SLOWDOWN and z >= SUSPECT_Z:
                found.append((sign * mean, i, reading, mean, sd))
        if not found:
            return None
        _, i, reading, mean, sd = max(found)
        number = next(o.number for o in obs if o.index == i and o.status == "ok")
        return Proposal(
            i,
            self.ranking.enumeration.configs[i],
            f"re-measure (a suspect reading): trial {number} read {reading:.4g}, {worse_by(reading, mean):.0%} "
            f"worse than the model predicts of it from every other measurement ({mean:.4g} +/- {sd:.2g}), which "
            f"would put it within {s.tie_tolerance:.0%} of the best measured ({best:.4g}): a slowdown of the "
            f"machine spoils a reading, never improves one; a second reading better by more than "
            f"{gap:.0%} sets the first aside as interference",
            remeasure=True,
        )

    def _best_first(self, values: dict[int, list[float]]) -> list[int]:
        """The measured configs (``values``: index -> readings), the best mean reading first."""
        sign = 1.0 if self.direction == "maximize" else -1.0
        return sorted(values, key=lambda i: -sign * float(np.mean(values[i])))

    def race_leader(self, values: dict[int, list[float]], noise: float, estimate: np.ndarray | None) -> int:
        """The config the study reports among the measured ones (``values``: index -> readings):
        of those whose mean reading is within the noise of the best mean, the best estimate."""
        sign = 1.0 if self.direction == "maximize" else -1.0
        means = {i: float(np.mean(v)) for i, v in values.items()}
        top = max(means, key=lambda i: sign * means[i])
        near = [
            i
            for i in means
            if i == top or not (means[top] and separated(means[top], len(values[top]), means[i], len(values[i]), noise))
        ]
        if estimate is None:
            return top
        return max(near, key=lambda i: (sign * float(estimate[i]), sign * means[i]))

    def race_spent(self, obs: list[Observation]) -> int:
        """Re-measurements the race has spent: every reading of a config past its first, less the
        drift checks' readings of the control (:meth:`drift_check`)."""
        seen = readings_taken(obs)
        control = self._control(obs) if self.settings.drift_every > 0 else None
        return sum(n - 1 for i, n in seen.items() if i != control)

    @staticmethod
    def _control(obs: list[Observation]) -> int | None:
        """The drift checks' control: the first config measured (the baseline, where the spec has one:
        it is the study's first trial)."""
        ok = [o for o in obs if o.status == "ok" and o.objective is not None]
        return min(ok, key=lambda o: o.number).index if ok else None

    def drift_check(
        self, obs: list[Observation], exclude: Iterable[int] = (), allowed: np.ndarray | None = None
    ) -> Proposal | None:
        """The control config measured again once ``drift_every`` probes have run since its last
        reading (issue 44, "drift"): a machine that slows down (thermal, a neighbour's job, a driver
        reset) moves every later reading, and only a config measured before and after shows it. The
        report compares its readings (:func:`autotune.objectives.race.control_drift`)."""
        every = self.settings.drift_every
        control = self._control(obs) if every > 0 else None
        if control is None or control in set(exclude) or (allowed is not None and not allowed[control]):
            return None
        readings = [o.number for o in obs if o.index == control and o.status == "ok"]
        since = sum(1 for o in obs if o.number > max(readings))
        if since < every:
            return None
        first = min(readings)
        return Proposal(
            control,
            self.ranking.enumeration.configs[control],
            f"drift check: the control config (trial {first}, the first measured) again after {since} probes: "
            "a change beyond the noise means the machine drifted",
            remeasure=True,
        )

    def _noise(self, values: dict[int, list[float]], floor: float) -> float:
        """The relative noise of one reading: the pooled spread of the configs measured more than
        once (each reading over its config's mean), never below ``floor`` (:meth:`noise_floor`),
        nor below ``settings.noise`` while no config was measured twice."""
        return repeat_noise(values.values(), floor, self.settings.noise)

    def noise_floor(self, obs: list[Observation]) -> float:
        """The floor under the study's noise between runs: its readings' own within-run standard
        error where their probes gave steps (``Observation.reading_noise``,
        :func:`autotune.objectives.intervals.noise_floor`), else ``settings.noise``. The report reads
        the same (``autotune.study.records.study_noise_floor``). A device is not the CPU the default
        was set on: on one H200 readings repeat to 0.25 % and the 3 % default kept twins apart."""
        return noise_floor(
            (o.reading_noise for o in obs if o.status == "ok" and not o.interference), self.settings.noise
        )

    def scout_value(
        self,
        obs: list[Observation],
        belief: "_MemoryBelief",
        sure: np.ndarray,
        unsure: np.ndarray,
        gain: np.ndarray,
        p_fit: np.ndarray,
        top: int = 64,
    ) -> tuple[np.ndarray, np.ndarray]:
        """What probing each sure config is worth for the configs it would make sure.

        A promising config near the limit whose memory is uncertain only because nothing like it
        was measured (a ZeRO stage, a micro-batch size no probe used) should not be risked, nor
        left alone: a config that surely fits and shares what is uncertain about it (the same
        stage with a smaller micro-batch, more recompute) is probed first, as an engineer would.
        From the memory posterior's covariance, measuring config j's peak leaves config i with
        variance ``sd_i² − r_ij`` (``r_ij = cov_ij² / (var_j + noise_j²)``) and moves its mean
        by N(0, r_ij); the chance that i is then ``fit_confidence`` sure follows in closed form.
        The value of j is the best expected improvement of an unsure config times that chance
        (the ``top`` unsure configs by expected improvement are considered); returned with that
        config's row (-1 where there is none)."""
        out = np.zeros(self.n)
        target = np.full(self.n, -1)
        if not sure.any() or not unsure.any():
            return out, target
        usable, usable_sd = self.usable_limit(obs, belief)
        # a config whose P(fits) an OOM's rule capped (fit_probability) is not made sure by any
        # measurement of another config: only those the Gaussian belief alone leaves unsure
        total_sd = np.sqrt(belief.sd**2 + usable_sd**2)
        gaussian = _norm_cdf((usable - belief.mean) / np.maximum(total_sd, 1e-9))
        unsure_idx = np.flatnonzero(unsure & (gain > 0) & (p_fit >= gaussian - 1e-3))
        if not len(unsure_idx):
            return out, target
        unsure_idx = unsure_idx[np.argsort(-gain[unsure_idx])[:top]]
        sure_idx = np.flatnonzero(sure)
        cov = belief.post.cov
        # what a probe of j would measure: its peak as the probes of this study count it
        kinds = [o.peak_counts for o in obs if o.peak_memory_gib and o.status in ("ok", "pruned")]
        zi = belief.design[unsure_idx]
        zj = self._mem_design(sure_idx, [kinds[-1]] * len(sure_idx)) if kinds else belief.design[sure_idx]
        c = (zi @ cov) @ zj.T
        var_j = np.einsum("ij,jk,ik->i", zj, cov, zj)
        noise_j = (self.settings.peak_noise**2 + belief.discrepancy**2) * (zj @ belief.post.mean) ** 2
        r = c**2 / np.maximum(var_j + noise_j, 1e-12)[None, :]
        total = (belief.sd[unsure_idx] ** 2 + np.broadcast_to(usable_sd, belief.sd.shape)[unsure_idx] ** 2)[:, None]
        sd_after = np.sqrt(np.maximum(total - r, 1e-12))
        margin = (
            usable[unsure_idx][:, None]
            - _norm_ppf(self.settings.fit_confidence) * sd_after
            - belief.mean[unsure_idx][:, None]
        )
        made_sure = _norm_cdf(margin / np.sqrt(np.maximum(r, 1e-12)))
        worth = gain[unsure_idx][:, None] * made_sure
        out[sure_idx] = worth.max(axis=0)
        target[sure_idx] = unsure_idx[np.argmax(worth, axis=0)]
        return out, target

    def fit_after_profile(
        self,
        obs: list[Observation],
        index: int,
        peak_gib: float,
        sd_gib: float,
        counts: str = "device",
        usable_gib: float | None = None,
    ) -> tuple[float, float, float]:
        """(P(fits), the device's peak, the usable memory) of config ``index`` from its memory
        profile: the profile's peak (what the probe counts, ``counts``) plus what that count leaves
        out as the memory model now prices it for this config, against the usable memory the
        study has learnt. Not the model's belief about the config: the profile measured this very
        config, so the model's error on other configs (its discrepancy) does not apply. ``usable_gib``:
        what the profile reported its allocator could use, if it did."""
        belief = self._memory_belief(obs)
        if usable_gib:
            obs = [*obs, Observation(index=index, status="profile", usable_gib=float(usable_gib))]
        usable, usable_sd = self.usable_limit(obs, belief)
        full = self._mem_design(np.array([index]))
        counted = self._mem_design(np.array([index]), [counts])
        left_out = max(0.0, float((full - counted)[0] @ belief.post.mean))
        device = float(peak_gib) + left_out
        u = float(usable[index])
        u_sd = float(np.broadcast_to(usable_sd, usable.shape)[index])
        z = (u - device) / max(math.hypot(float(sd_gib), u_sd), 1e-9)
        return float(_norm_cdf(np.array([z]))[0]), device, u

    def oom_allowance_spent(self, ooms: int, probes: int, budget_left: int | None) -> bool:
        """Whether the study has had the OOM probes it may risk: ``max_oom_share`` of its whole
        budget (the probes so far plus those left), rounded up, at least one; never without the
        setting. On a cluster where a failed launch costs minutes or wedges a device, a team caps
        them; past the cap a config must be ``fit_confidence`` likely to fit (benchmarks/README.md:
        the cap trades OOM probes for a near-limit optimum found later). Rounded up: a 25-probe
        study at 5 % may risk 2, not the 1 of a 20-probe one (rounded down, the first OOM closed
        every config near the wall to a study whose optimum sat there: 7B 8x32 world 5 of the
        search benchmark ended at 0.938 of it, its profile of the optimum at P(fits) 0.84)."""
        share = self.settings.max_oom_share
        if not share:
            return False
        total = probes + (budget_left if budget_left is not None else max(probes, 20))
        return ooms >= max(1, math.ceil(share * total - 1e-9))

    def model_doubt(self, obs: list[Observation]) -> tuple[float, str]:
        """How far the simulator has been shown wrong in one direction for one family
        (tp/pp/cp/zero/recompute) against the rest: over each measured family with two
        measurements or more that all sit above, or all below, the other families' median ratio
        of measured to raw prediction (the raw prediction itself while no other family is
        measured), the smallest of those log ratios (consistently off by at least that much); the
        largest such figure over the families, if it reaches ``doubt_threshold``, and its words.
        A simulator off by the same factor everywhere is a scale the refit learns, not a reason
        to doubt the families not measured: in a world 13 % slower than predicted throughout, an
        absolute test kept every unmeasured family widened for the whole study, which then spent
        its probes on new families instead of the best ones (benchmarks/README.md, issue #35)."""
        by_family: dict[tuple, list[float]] = {}
        for o in obs:
            raw = self.objective_raw[o.index]
            if (
                o.status == "ok"
                and o.objective
                and o.objective > 0
                and raw > 0
                and math.isfinite(raw)
                and not o.interference
            ):
                by_family.setdefault(self.families[o.index], []).append(math.log(o.objective / raw))
        worst, why = 0.0, ""
        for fam, logs in by_family.items():
            others = [v for f, vs in by_family.items() if f != fam for v in vs]
            ref = statistics.median(others) if others else 0.0
            off = [v - ref for v in logs]
            if len(off) < 2 or not (all(v > 0 for v in off) or all(v < 0 for v in off)):
                continue
            least = min(abs(v) for v in off)
            if least >= self.settings.doubt_threshold and least > worst:
                ratio = math.exp(sum(logs) / len(logs))
                where = "above" if off[0] > 0 else "below"
                worst = least
                against = f"the other families' x{math.exp(ref):.2f}" if others else "no other family measured"
                why = (
                    f"measured {_family_words(fam)} configs ran x{ratio:.2f} of their predictions "
                    f"({len(logs)} of {len(logs)} {where}; {against})"
                )
        return worst, why

    def _doubt_probes(self, obs: list[Observation]) -> int:
        """Probes already spent on a family not measured before, while the model was in doubt
        (derived from the trials in order: nothing stored)."""
        ordered = sorted(obs, key=lambda o: o.number)
        spent = 0
        for k, o in enumerate(ordered):
            before = ordered[:k]
            if self.families[o.index] not in {self.families[b.index] for b in before} and self.model_doubt(before)[0]:
                spent += 1
        return spent

    def propose(
        self,
        obs: Iterable[Observation],
        exclude: Iterable[int] = (),
        best: float | None = None,
        budget_left: int | None = None,
        allowed: np.ndarray | None = None,
    ) -> tuple[Proposal | None, str]:
        """The next config to probe, or None with the reason to stop. In the budget held back for
        the race (``confirm_readings``) and before stopping early, the contenders are raced.
        ``allowed`` (a mask over the ranking) narrows the choice, e.g. to configs matching
        parameters a user fixed for this trial.

        In the order a decision is made: what the models say now (:meth:`_picture`); the race in the
        budget held back for it; whether to stop, or to stretch to a riskier config with budget left
        (:meth:`_stop_or_stretch`); which configs may be probed (:meth:`_pool`); the best of them
        by the acquisition (:meth:`_choose`); and the words of why (:meth:`_reason`)."""
        view = self._picture(list(obs), set(exclude), best, budget_left, allowed)
        if budget_left is None or budget_left > 1:
            check = self.drift_check(view.obs, view.exclude, allowed)
            if check is not None:
                return view.with_prediction(check, widened=False), ""
        suspect = self.suspect_reading(view.obs, view.exclude, allowed)
        if suspect is not None:
            return view.with_prediction(suspect, widened=False), ""
        if budget_left is not None and budget_left <= max(
            1, self.settings.confirm_readings - self.race_spent(view.obs)
        ):
            # the budget held back for the race: the contenders are raced before anything new is probed
            # a repeat only to measure the noise does not compete with a new config (the golden
            # profiled study: it cost a config 1.8x faster than the one it re-measured)
            again = self.close_call(view.obs, view.exclude, allowed, view.mean, measure_noise=False)
            if again is not None and again.stake >= self._exploration_value(view):
                return view.with_prediction(again, widened=False), ""
        if not view.candidates.any():
            again = self.close_call(view.obs, view.exclude, allowed, view.mean)  # nothing new: the race may go on
            if again is not None:
                return view.with_prediction(again, widened=False), ""
            return None, (
                "every valid config of the space has been probed"
                if allowed is None
                else "every valid config with the fixed parameters has been probed"
            )
        floor, stretch, stop = self._stop_or_stretch(view, allowed)
        if stop is not None:
            return stop
        pool, safest, why_not = self._pool(view, floor)
        if why_not:
            return None, why_not
        index, doubted, scout_for = self._choose(view, pool, safest)
        reason = self._reason(view, index, pool, doubted, scout_for, safest, stretch)
        config = self.ranking.enumeration.configs[index]
        return view.with_prediction(Proposal(index, config, reason, scout_for=scout_for)), ""

    def _exploration_value(self, view: "_Picture") -> float:
        """What probing a new config is worth, in the race's units: the largest expected improvement
        over the best measured, relative to it, times P(fits), among the configs that may fit
        (``min_fit_probability``). A race re-measurement whose stake (the expected loss of reporting
        its leader over its threat) is below it gives way to exploration: re-measuring a leader the
        readings already favour was worth less than one probe of a config the model put within its
        noise of the best (7B 8x32 worlds 3 and 6 of benchmarks/search_efficiency.py)."""
        if view.best is None or not view.best or not view.candidates.any():
            return 0.0
        pool = view.candidates & (view.p_fit >= self.settings.min_fit_probability)
        if not pool.any():
            return 0.0
        gain = _expected_improvement(view.sign * view.mean, view.sd, view.sign * view.best) / abs(view.best)
        return float(np.max(np.where(pool, gain * view.p_fit, 0.0)))

    def _picture(
        self,
        obs: list[Observation],
        exclude: set[int],
        best: float | None,
        budget_left: int | None,
        allowed: np.ndarray | None,
    ) -> "_Picture":
        """What the models say of every config now: the objective's mean and sd (widened for the
        families not measured while the model is in doubt), the memory belief and P(fits), which
        configs are left, and the study's OOM count against its allowance."""
        s = self.settings
        mean, sd = self._objective_model(obs)
        belief = self._memory_belief(obs)
        p_fit = self.fit_probability(obs, belief.mean, belief.sd, belief)
        candidates = self.valid.copy() if allowed is None else self.valid & allowed
        probed = {o.index for o in obs} | exclude
        if probed:
            candidates[list(probed)] = False
        seen = {self.families[o.index] for o in obs}
        doubt, doubt_why = self.model_doubt(obs) if best is not None else (0.0, "")
        if doubt and self._doubt_probes(obs) >= s.max_doubt_probes:
            # the doubt probes are spent: exploit. Kept widened, the families not measured outbid the
            # best ones and the race to the end of the budget: in the search benchmark's 13B world 11
            # (2 % noise) the last 8 probes went to new families all 9-16 % slower, the optimum
            # (measured, 0.984) was never raced, and a config 4 % slower was reported
            doubt, doubt_why = 0.0, ""
        unmeasured = np.array([f not in seen for f in self.families]) if doubt else None
        model_sd = sd
        if doubt:
            # the families not measured may be as wrong as the one shown wrong: widen them
            sd = np.where(unmeasured, np.hypot(sd, math.expm1(doubt) * np.abs(mean)), sd)
        ooms = sum(1 for o in obs if o.status == "oom")
        # with memory profiles an unsure config is profiled, not risked: the allowance is spent where
        # a profile's verdict sends a config to its full probe (autotune.study.profiling), not here
        spent = not s.memory_profiles and self.oom_allowance_spent(ooms, len(obs) + len(exclude), budget_left)
        return _Picture(
            obs=obs,
            exclude=exclude,
            best=best,
            budget_left=budget_left,
            metric=self.metric,
            sign=1.0 if self.direction == "maximize" else -1.0,
            mean=mean,
            sd=sd,
            model_sd=model_sd,
            belief=belief,
            p_fit=p_fit,
            candidates=candidates,
            seen_families=seen,
            doubt=doubt,
            doubt_why=doubt_why,
            unmeasured=unmeasured,
            n_measured=sum(1 for o in obs if o.objective is not None),
            ooms=ooms,
            spent=spent,
        )

    def _stop_or_stretch(
        self, view: "_Picture", allowed: np.ndarray | None
    ) -> tuple[float, str, tuple[Proposal | None, str] | None]:
        """(the least P(fits) a config needs to be probed, why it was stretched, or what to return
        instead of a new config: a close call's re-measurement, or None and the reason to stop).

        The floor is ``min_fit_probability``; with memory profiles ``give_up_probability`` (an unlikely
        fit costs its profile, not an OOM; the score weighs it). The stopping rule: every config that
        may fit (the floor) has its optimistic bound (``stop_kappa`` sd) below the best measured. Then
        the configs that could still win but are less likely to fit than the floor: while the study
        has budget left and may still risk an OOM, one of them is worth its risk (7B 32 GB world 17 of
        benchmarks/search_efficiency.py stopped after 11 of 20 probes at 0.937 of the optimum, a
        config at 98.7 % of the memory it gave P(fits) 0.3)."""
        s = self.settings
        floor = s.give_up_probability if s.memory_profiles else s.min_fit_probability
        best = view.best
        if not (s.stop_early and best is not None and view.n_measured >= s.min_probes_before_stop):
            return floor, "", None
        bound = view.sign * view.mean + s.stop_kappa * view.sd
        maybe = view.candidates & (view.p_fit >= floor)
        top = float(np.max(np.where(maybe, bound, -np.inf))) if maybe.any() else -np.inf
        target = view.sign * best + abs(best) * s.stop_margin
        if top >= target:
            return floor, "", None
        risky = view.candidates & (view.p_fit >= s.give_up_probability) & (view.p_fit < floor) & (bound > target)
        if risky.any() and not view.spent and (view.budget_left is None or view.budget_left > 1):
            stretch = (
                f"every config at least {floor:.0%} likely to fit is below the best measured by the model's "
                f"bound; with budget left and the OOM allowance unspent, one that may fit and could win"
            )
            return s.give_up_probability, stretch, None
        again = self.close_call(view.obs, view.exclude, allowed, view.mean)
        if again is not None:
            return floor, "", (view.with_prediction(again), "")
        return (
            floor,
            "",
            (
                None,
                f"the model's optimistic bound ({s.stop_kappa:g} sd) of every remaining config that may "
                f"fit is {abs(top):.4g}, below the best measured {best:.4g}: no probe left can win",
            ),
        )

    def _pool(self, view: "_Picture", floor: float) -> tuple[np.ndarray, str, str]:
        """(the configs that may be probed, the words when only the safest are left, the reason to
        stop when none may). Nothing measured yet: the configs that surely fit, to learn from (an
        OOM teaches less than a measured peak, and a study that fails its first probes has nothing
        to go on); the OOM allowance spent: from now on, configs that surely fit; else those at
        least ``floor`` likely to fit. Where none qualifies, the likeliest to fit, to learn where the
        limit is (a study that stops after its first OOM finds nothing)."""
        s = self.settings
        candidates, p_fit = view.candidates, view.p_fit
        safest = ""
        if view.best is None or view.spent:
            pool = candidates & (p_fit >= s.fit_confidence)
            if not pool.any() and view.spent and view.best is not None:
                top = float(np.max(np.where(candidates, p_fit, 0.0)))
                if top < s.min_fit_probability:
                    ooms = view.ooms
                    return (
                        pool,
                        "",
                        (
                            f"the study's OOM allowance is spent ({ooms} OOM probe{'s' if ooms != 1 else ''}, "
                            f"search.max_oom_share {s.max_oom_share:g}) and no remaining config is even "
                            f"{s.min_fit_probability:.0%} likely to fit (the likeliest: {top:.2f})"
                        ),
                    )
                pool = candidates & (p_fit >= 0.9 * top)
                safest = f"the safest left (OOM allowance spent; none is {s.fit_confidence:.0%} likely to fit)"
        else:
            pool = candidates & (p_fit >= floor)
        if not pool.any():
            top = float(np.max(np.where(candidates, p_fit, 0.0)))
            if top < s.give_up_probability:
                return (
                    pool,
                    "",
                    (
                        f"no remaining config is likely to fit in memory (the likeliest: P(fits) {top:.2f}, "
                        "learned from the OOMs so far)"
                    ),
                )
            pool = candidates & (p_fit >= 0.9 * top)
            safest = f"the safest left (none is {s.min_fit_probability:.0%} likely to fit)"
        return pool, safest, ""

    def _choose(self, view: "_Picture", pool: np.ndarray, safest: str) -> tuple[int, int | None, int | None]:
        """(the config to probe, the same where it is a doubt probe, the promising config it scouts
        for). While the model is in doubt and has probes of doubt left: the best of a family not
        measured, if its widened bound could beat the best measured and it surely fits. Nothing
        measured yet, or only the safest left: the highest optimistic bound. Else the expected
        improvement over the best, weighted by the probability of fitting (a config near the memory
        limit is tried when what it could gain is worth the risk), plus what a sure config's
        measurement would make sure of the unsure ones (scouting)."""
        s = self.settings
        sign, mean, sd, p_fit, best = view.sign, view.mean, view.sd, view.p_fit, view.best
        ucb = sign * mean + s.explore_kappa * sd
        scouted = scouting = None
        doubted = None
        if view.doubt and not safest:  # a doubt in view has probes left (_picture ends it when they are spent)
            others = pool & view.unmeasured & (p_fit >= s.fit_confidence) & (ucb > sign * best)
            if others.any():
                doubted = int(np.argmax(np.where(others, ucb, -np.inf)))
        if doubted is not None:
            return doubted, doubted, None
        if best is None or safest:
            score = np.where(pool, ucb, -np.inf)
        else:
            gain = _expected_improvement(sign * mean, sd, sign * best)
            if s.memory_profiles:
                # a config not sure to fit is profiled first: it costs the profile, and its full probe
                # only when the profile says it fits (about P(fits) of the time): the gain per
                # full-probe equivalent spent, not the gain discounted by the risk of an OOM
                cost = np.where(p_fit >= s.fit_confidence, 1.0, s.profile_cost + p_fit)
                score = np.where(pool, gain * p_fit / cost, -np.inf)
            else:
                score = np.where(pool, gain * p_fit**s.fit_power, -np.inf)
            if s.scout and not s.memory_profiles:
                sure = pool & (p_fit >= s.fit_confidence)
                unsure = view.candidates & (p_fit < s.fit_confidence) & (p_fit >= s.give_up_probability)
                scouting, scouted = self.scout_value(view.obs, view.belief, sure, unsure, gain, p_fit)
                score = np.where(sure, score + scouting, score)
        index = int(np.argmax(score))
        scout_for = None
        if scouted is not None and scouted[index] >= 0 and scouting[index] > score[index] - scouting[index]:
            scout_for = int(scouted[index])
        return index, None, scout_for

    def _reason(
        self,
        view: "_Picture",
        index: int,
        pool: np.ndarray,
        doubted: int | None,
        scout_for: int | None,
        safest: str,
        stretch: str,
    ) -> str:
        """Why this config: doubt, a new family, the safest left, a stretch, a scout, a sibling of
        a config that ran out of memory, a profile first; its rank by the model's mean among the
        configs that may be probed, and its prediction."""
        s = self.settings
        mean, sd, p_fit = view.mean, view.sd, view.p_fit
        mem_mean, mem_sd = view.belief.mean, view.belief.sd
        by_mean = np.where(pool, view.sign * mean, -np.inf)
        rank = int(np.sum(by_mean > by_mean[index])) + 1
        parts = []
        if doubted is not None:
            parts.append(
                f"doubt: {view.doubt_why}; the model's uncertainty is widened by ±{math.expm1(view.doubt):.0%} for "
                "the families not measured, so the best of one is probed before exploiting further"
            )
        elif view.doubt:
            parts.append(f"doubt: {view.doubt_why} (unmeasured families widened by ±{math.expm1(view.doubt):.0%})")
        if view.obs and self.families[index] not in view.seen_families:
            parts.append(f"exploration: new tp/pp/zero/recompute family ({_family_words(self.families[index])})")
        if safest:
            parts.append(safest)
        if stretch:
            parts.append(stretch)
        if scout_for is not None:
            parts.append(
                f"scout for {_short(self.ranking.enumeration.configs[scout_for])} (peak "
                f"{mem_mean[scout_for]:.1f} ± {mem_sd[scout_for]:.1f} GiB, P(fits) {p_fit[scout_for]:.2f}): "
                "this one surely fits and tells its memory, so it need not be risked"
            )
        wall = self._after_wall(view.obs, index, mem_mean, view.belief)
        if wall:
            parts.append(wall)
        if s.memory_profiles and p_fit[index] < s.fit_confidence:
            parts.append(
                f"not sure to fit (P(fits) {p_fit[index]:.2f}): memory profile first, full probe only if it fits"
            )
        n = view.n_measured
        parts.append(f"rank {rank} by model" + (f" refit after {n} measured" if n else ""))
        parts.append(f"predicted {mean[index]:.4g} ± {sd[index]:.2g}, P(fits) {p_fit[index]:.2f}")
        return "; ".join(parts)


@dataclass
class _Picture:
    """What one proposal is decided from (``Guide._picture``): the models' view of every config."""

    obs: list[Observation]
    exclude: set[int]
    best: float | None
    budget_left: int | None
    metric: str
    sign: float  # +1 to maximise, -1 to minimise
    mean: np.ndarray  # the objective's mean ...
    sd: np.ndarray  # ... and sd, widened for unmeasured families while in doubt
    model_sd: np.ndarray  # the sd before that widening
    belief: _MemoryBelief
    p_fit: np.ndarray
    candidates: np.ndarray  # valid, allowed, not probed nor in flight
    seen_families: set[tuple]
    doubt: float
    doubt_why: str
    unmeasured: np.ndarray | None  # the configs of families not measured (while in doubt)
    n_measured: int
    ooms: int
    spent: bool  # the OOM allowance

    def with_prediction(self, proposal: Proposal, widened: bool = True) -> Proposal:
        """The proposal with what the guide predicts of it (trial attributes, the report's band);
        ``widened``: its sd as the doubt widened it (a close call near the end is decided before)."""
        i = proposal.index
        sd = self.sd if widened else self.model_sd
        proposal.predicted = {
            f"guided_{self.metric}": float(self.mean[i]),
            f"guided_{self.metric}_sd": float(sd[i]),
            "guided_peak_memory_gib": float(self.belief.mean[i]),
            "guided_p_fit": float(self.p_fit[i]),
        }
        return proposal


def _wall_of(config: dict[str, Any]) -> tuple:
    """A config less the knobs that cannot save memory (:data:`SAME_WALL_FLAGS`, a half precision,
    the HCCL settings): two configs of one wall hold the same tensors."""
    out = []
    for k, v in sorted(config.items()):
        if k in SAME_WALL_FLAGS or k.startswith("env.HCCL_"):
            continue
        out.append((k, "half" if k == "precision" and v in SAME_WALL_PRECISIONS else v))
    return tuple(out)


def _buffer_of(config: dict[str, Any]) -> float | None:
    """The config's ``HCCL_BUFFSIZE`` (MB), where it sets a number."""
    try:
        return float(config[HCCL_BUFFER])
    except (KeyError, TypeError, ValueError):
        return None


SUSPECT_Z = 2.0  # a single reading this many sd below the model's prediction without it may be interference ...
SUSPECT_MIN_MEASURED = 4  # ... once this many configs were measured, its own included (the others predict it)
SUSPECT_MAX_SLOWDOWN = 0.5  # ... and a slowdown larger than this share is not read as interference
PRIOR_MIN_MEASURED = 5  # measured configs before the model's leave-one-out predictions inform the certificate
PRIOR_CONFIGS = 12  # the best measured configs the model predicts for the certificate (a leave-one-out fit each)
LOO_SCALE_QUANTILE = 0.1  # the model's sd scaled as its leave-one-out misses bear out, at this confidence ...
LOO_SCALE_MIN, LOO_SCALE_MAX = 0.5, 10.0  # ... within these factors
CLAIMED_CONFIGS = 8  # measured configs the model's claim over the unmeasured is kept for (the best readings)
CLAIM_DRAWS = 1000  # joint draws of the objective model behind a claim over the unmeasured (MC error <= 0.016)
CLAIM_DRAWN = 2000  # at most this many unmeasured configs drawn jointly (the likeliest to beat the leader)
CLAIM_NEGLIGIBLE = 1e-4  # a config less likely than this to beat the leader (and fit) enters by its own chance
CLAIM_SEED = 0


def _erfc_array(x: np.ndarray) -> np.ndarray:
    """The complementary error function elementwise (scipy's, a declared dependency)."""
    from scipy.special import erfc

    return erfc(x)


def _family_words(family: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(FAMILY_PARAMS, family) if v is not None)


def _short(config: dict[str, Any]) -> str:
    """A config's family and micro-batch in a few words, for a proposal's reason."""
    keys = (*FAMILY_PARAMS, "micro_batch_size")
    return ", ".join(f"{k}={config[k]}" for k in keys if config.get(k) is not None)


def _expected_improvement(mean: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """E[max(0, Y - best)] for Y ~ N(mean, sd²) (all to be maximised)."""
    sd = np.maximum(sd, 1e-12 * np.abs(mean) + 1e-300)
    z = (mean - best) / sd
    pdf = np.exp(-0.5 * np.clip(z, -30, 30) ** 2) / np.sqrt(2 * np.pi)
    return sd * pdf + (mean - best) * _norm_cdf(z)


def _truncated_normal(mean: float, sd: float, lower: float, upper: float) -> tuple[float, float]:
    """The mean and sd of N(mean, sd²) truncated to [lower, upper] (lower < upper)."""
    a, b = (lower - mean) / sd, (upper - mean) / sd
    mass = float(_norm_cdf(np.array([b]))[0] - _norm_cdf(np.array([a]))[0])
    if mass < 1e-12:  # the whole prior beyond one end: the interval's end nearest to it
        end = upper if b < 0 else lower
        return end, min(sd, (upper - lower) / math.sqrt(12.0))
    pdf_a, pdf_b = (math.exp(-0.5 * min(z * z, 900.0)) / math.sqrt(2 * math.pi) for z in (a, b))
    shift = (pdf_a - pdf_b) / mass
    var = 1.0 + (a * pdf_a - b * pdf_b) / mass - shift * shift
    return min(upper, max(lower, mean + sd * shift)), sd * math.sqrt(max(var, 0.0))


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z) by Abramowitz and Stegun 7.1.26 (absolute error below 1e-7), vectorised: the
    scouting values are a matrix of tens of thousands of entries at every proposal."""
    # beyond 40 the tail is 0 in float64; capped there, x * x cannot overflow (a z of 1e200, from a
    # difference over a vanishing spread, printed "overflow encountered in multiply" in a real study)
    x = np.minimum(np.abs(np.asarray(z, dtype=float)) / math.sqrt(2.0), 40.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)


def _norm_ppf(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)
