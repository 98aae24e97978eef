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
  probe can win: the study stops and says so; with budget left it first races the contenders, risks
  an unprobed config less likely to fit than the floor, or (memory profiles on) runs in full one config
  a profile turned away near the wall (:meth:`Guide._last_gamble`).

Everything is derived from the study's trials each time it is asked (nothing to store, and a
resumed study continues with the same ranking and the same fit).

Where each part lives: this module builds the matrices from the ranking and holds the objective
model and the acquisition (:meth:`Guide.propose`); the memory belief, P(fits) and the walls are
:mod:`.memory_belief`, the race of the contenders and its certificate's inputs :mod:`.contenders`
(both mixins of :class:`Guide`, reading the matrices built here), the linear algebra and the normal
distribution :mod:`.bayes`, the settings, observations and proposal :mod:`.interface`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .bayes import _Posterior, _expected_improvement, _fitted_sigma, _norm_cdf, _norm_ppf, _predict, _solve
from .contenders import GuideRace
from .interface import FAMILY_PARAMS, GuideSettings, Observation, Proposal, family_of, readings_of
from .memory_belief import GuideMemory, _MemoryBelief, _wall_of
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
# how the framework executes (graph vs eager, compiler level, fusion): can change a step several
# fold, and the simulator does not price it; environment variables get the narrow prior
EXECUTION_PARAMS = ("mode", "jit_level", "graph_kernel_flags", "compile")
_MAX_ONE_HOT_VALUES = 16
# the fewest OOM full probes a study with memory profiles may have (Guide.oom_allowance_spent)
PROFILED_OOM_ALLOWANCE = 2
# a config its memory profile turned away is run in full after all, once, where the study would stop with
# budget left and its OOM allowance unspent, if the profile gave it at least this P(fits) and the model
# says it could still win (Guide._last_gamble)
GAMBLE_FROM = 0.2


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


class Guide(GuideMemory, GuideRace):
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
        self.time_component_names = comp_names
        self._profile_priced: dict[tuple[int, int], tuple[np.ndarray, np.ndarray] | None] = {}
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

    # ---- models --------------------------------------------------------------------------------------
    def _objective_model(
        self, obs: list[Observation], profile_rows: list[tuple[np.ndarray, np.ndarray, float]] | tuple = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the objective for every config (in the objective's units);
        ``profile_rows``: the memory profiles' steps read too (:meth:`_profile_rows`)."""
        belief = self._objective_belief(obs, profile_rows=profile_rows)
        return belief.mean, belief.sd

    def _objective_belief(
        self,
        obs: list[Observation],
        at: np.ndarray | None = None,
        profile_rows: list[tuple[np.ndarray, np.ndarray, float]] | tuple = (),
    ) -> _ObjectiveBelief:
        """The objective model's posterior (:class:`_ObjectiveBelief`): the step-time model for
        step-derived objectives, else a multiplicative correction of the raw prediction by
        parameter values. ``at``: what it says of these rows only (its arrays indexed as ``at``;
        a leave-one-out prediction needs one row, not the whole space). ``profile_rows``: the memory
        profiles' steps (:meth:`_profile_rows`) read as well (what to probe, when to stop); without,
        only full probes speak (what a measured config is reported and raced by)."""
        s = self.settings
        sel = slice(None) if at is None else np.asarray(at, dtype=int)
        k = self.one_hot.shape[1]
        if self.step_derived and self.time_components is not None:
            rows = [
                (o.index, o.step_time_s)
                for o in obs
                if o.step_time_s and o.step_time_s > 0 and math.isfinite(o.step_time_s) and not o.interference
            ]
            design, post, execution, exec_post = self._step_posteriors(rows, profile_rows)
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
            self._step_design_cache = self._step_design_of(self.time_components, self.one_hot)
        return self._step_design_cache

    def _step_design_of(self, components: np.ndarray, one_hot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step-time model's design rows (the components, and the priced parameter values times
        their sum) and execution rows of configs with these predicted ``components`` (n, parts) and
        parameter values (``one_hot``'s rows): the space's (:meth:`_step_design`) or a memory
        profile's, priced at its layers (:meth:`_price_profile`)."""
        lin_cols = ~self.unpriced
        design = np.concatenate([components, one_hot[:, lin_cols] * components.sum(axis=1, keepdims=True)], axis=1)
        return design, one_hot[:, self.unpriced]

    def _profile_rows(self, obs: list[Observation]) -> list[tuple[np.ndarray, np.ndarray, float]]:
        """(design row, execution row, measured step) of every memory profile's step time
        (``settings.profile_steps``): the trial's layout on the model cut to the profile's layers,
        priced by the simulator at those layers (:meth:`Ranking.time_components_at`), so its step
        is one more reading of the layout's speed, of every priced part but the layers' share. A
        study profiles the layouts at the memory edge, where optima sit and few full probes go;
        their steps cost nothing more. Measured on this CPU (a 16-layer tiny Llama, the torch probe):
        measured over priced at 1, 4 and 16 layers per stage 19.1, 15.5, 19.3 (pp 2) and 19.3, 18.8,
        20.3 (pp 1): a factor common to the cut and the full model, which the step model fits.

        Read only while the profiles' steps grow with their layers as the model prices them: the
        median, over the layouts profiled at two sizes or more, of the measured step ratio between
        the largest and the smallest over the priced one within ``profile_scaling_tolerance``
        either way (this CPU: 0.82 and 0.96). A launcher whose step does not follow the layers it
        runs (a fixed overhead that dwarfs a layer, a step time it prints but does not measure)
        says nothing of a layout's speed through its profiles; none is read."""
        s = self.settings
        if not (s.profile_steps and self.step_derived and self.time_components is not None):
            return []
        ncomp = len(self.time_component_names)
        out, scaling = [], []
        for o in obs:
            if o.interference:
                continue
            read = []
            for per_stage, step in sorted(o.profile_steps):
                key = (o.index, int(per_stage))
                if key not in self._profile_priced:
                    self._profile_priced[key] = self._price_profile(o.index, int(per_stage))
                priced = self._profile_priced[key]
                if priced is not None and step > 0 and math.isfinite(step):
                    read.append((priced, float(step)))
            if len(read) >= 2:
                (low, low_step), (high, high_step) = read[0], read[-1]
                priced_ratio = float(high[0][:ncomp].sum() / low[0][:ncomp].sum())
                scaling.append(math.log(high_step / low_step / priced_ratio))
            out.extend((priced[0], priced[1], step) for priced, step in read)
        if not scaling or abs(float(np.median(scaling))) > math.log(s.profile_scaling_tolerance):
            return []
        return out

    def _price_profile(self, index: int, per_stage: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The step model's design row and execution row of config ``index`` cut to ``per_stage``
        layers per (virtual) stage; None where the simulator cannot price it."""
        config = self.ranking.enumeration.configs[index]
        stages = max(1, int(config.get("pp") or 1)) * max(1, int(config.get("vpp") or 1))
        parts = self.ranking.time_components_at(index, stages * per_stage)
        if parts is None:
            return None
        comp = np.array([parts.get(f"time_{k}", 0.0) for k in self.time_component_names], dtype=float)
        if not np.isfinite(comp).all() or comp.sum() <= 0:
            return None
        design, execution = self._step_design_of(comp[None, :], self.one_hot[index : index + 1])
        return design[0], execution[0]

    def _step_posteriors(
        self, rows: list[tuple[int, float]], extra: list[tuple[np.ndarray, np.ndarray, float]] | tuple = ()
    ) -> tuple[np.ndarray, _Posterior, np.ndarray, _Posterior]:
        """The step-time model's posteriors: the linear model over the predicted components
        and the priced parameter values, times ``exp(Σ e_j φ_j)`` for the execution parameters
        the simulator does not price (graph vs pynative can be 20x apart: a factor, not a term).
        The two parts are fitted alternately (three rounds are plenty: each is a small solve).
        ``extra``: memory profiles' steps (:meth:`_profile_rows`), at ``profile_step_noise`` times
        the noise and with a log-factor of their own (prior sd ``profile_factor_sigma``), fitted
        with the execution factors and left out of what is returned. Returns (design, its
        posterior, the execution one-hot, its posterior)."""
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
        d_rows, e_rows = design[idx], execution[idx]
        exec_sd = np.full(n_exec, s.unpriced_sigma)
        if extra:  # the profiles' steps: one more execution column, 1 on their rows
            d_rows = np.vstack([d_rows, np.array([e[0] for e in extra])])
            e_extra = np.array([e[1] for e in extra], dtype=float).reshape(len(extra), n_exec)
            e_rows = np.hstack(
                [np.vstack([e_rows, e_extra]), np.concatenate([np.zeros(len(rows)), np.ones(len(extra))])[:, None]]
            )
            measured = np.concatenate([measured, [e[2] for e in extra]])
            noise = np.concatenate([noise, np.full(len(extra), s.profile_step_noise * s.noise)])
            exec_sd = np.concatenate([exec_sd, [s.profile_factor_sigma]])
        n_fit = len(exec_sd)
        exec_post = _Posterior(np.zeros(n_fit), np.diag(exec_sd**2))
        values = np.arange(len(prior_sd)) >= ncomp  # the value effects' columns
        rounds = 3 if n_fit else 1
        ones = np.ones(len(measured))
        for round_ in range(rounds):
            adjusted = measured / np.exp(e_rows @ exec_post.mean)
            z = d_rows / adjusted[:, None]
            if s.fit_value_sigma and round_ == rounds - 1:  # on the last round's execution factors
                prior_sd = _fitted_sigma(z, ones, prior_mean, prior_sd, values, noise)
            post = _solve(z, ones, prior_mean, prior_sd, noise)
            if not n_fit:
                break
            linear = np.maximum(d_rows @ post.mean, 1e-12)
            exec_post = _solve(e_rows, np.log(measured / linear), np.zeros(n_fit), exec_sd, noise)
        if n_fit > n_exec:  # the profiles' own factor is theirs alone
            exec_post = _Posterior(exec_post.mean[:n_exec], exec_post.cov[:n_exec, :n_exec])
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

    # ---- decisions -----------------------------------------------------------------------------------
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
        search benchmark ended at 0.938 of it, its profile of the optimum at P(fits) 0.84).
        With memory profiles, at least ``PROFILED_OOM_ALLOWANCE``: a full probe runs only after its
        profile said go, so its OOM is a near miss at the wall that also tells the guide where the
        wall is; with one allowed (5 % of 20), that first near miss closed every config near the wall
        for the rest of the study, optima included (13B world 154 of the search benchmark: the
        optimum's profile at P(fits) 0.65, not run; benchmarks/README.md, "Two OOMs before the wall
        closes"). Without profiles, launches are blind and the share's count stands."""
        share = self.settings.max_oom_share
        if not share:
            return False
        total = probes + (budget_left if budget_left is not None else max(probes, 20))
        least = PROFILED_OOM_ALLOWANCE if self.settings.memory_profiles else 1
        return ooms >= max(least, math.ceil(share * total - 1e-9))

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
        if budget_left is not None and budget_left <= max(1, self._held_back(view.obs)):
            # the budget held back for the race: the contenders are raced before anything new is probed
            # a repeat only to measure the noise does not compete with a new config (the golden
            # profiled study: it cost a config 1.8x faster than the one it re-measured)
            again = self.close_call(view.obs, view.exclude, allowed, view.mean, measure_noise=False)
            if again is not None and again.stake >= self._exploration_value(view):
                return view.with_prediction(again, widened=False), ""
        if not view.candidates.any():
            # nothing new: the race may go on, with the budget left
            again = self.close_call(view.obs, view.exclude, allowed, view.mean, past_held_back=view.budget_to_spend)
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
        profile_rows = self._profile_rows(obs)
        mean, sd = self._objective_model(obs, profile_rows)
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

        def widened(mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
            # the families not measured may be as wrong as the one shown wrong: widen them
            return np.where(unmeasured, np.hypot(sd, math.expm1(doubt) * np.abs(mean)), sd) if doubt else sd

        model_sd = sd
        sd = widened(mean, sd)
        ooms = sum(1 for o in obs if o.status == "oom")
        # with memory profiles an unsure config is profiled, not risked: the allowance is spent where
        # a profile's verdict sends a config to its full probe (autotune.study.profiling), not here
        spent = not s.memory_profiles and self.oom_allowance_spent(ooms, len(obs) + len(exclude), budget_left)
        sign = 1.0 if self.direction == "maximize" else -1.0
        bound = sign * mean + s.stop_kappa * sd
        if profile_rows:
            # the stopping rule asks both models, with the profiles' steps and without: more readings
            # narrow the band but cannot make the cut model the full one (the search benchmark's 13B
            # studies stopped early 31 times in 90 with the profiles' band alone, 10 without them)
            full_mean, full_sd = self._objective_model(obs)
            bound = np.maximum(bound, sign * full_mean + s.stop_kappa * widened(full_mean, full_sd))
        return _Picture(
            stop_bound=bound,
            obs=obs,
            exclude=exclude,
            best=best,
            budget_left=budget_left,
            metric=self.metric,
            sign=sign,
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
        bound = view.stop_bound
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
        again = self.close_call(view.obs, view.exclude, allowed, view.mean, past_held_back=view.budget_to_spend)
        if again is not None:
            return floor, "", (view.with_prediction(again), "")
        gamble = self._last_gamble(view, allowed, target)
        if gamble is not None:
            return floor, "", (view.with_prediction(gamble), "")
        return (
            floor,
            "",
            (
                None,
                f"the model's optimistic bound ({s.stop_kappa:g} sd) of every remaining config that may "
                f"fit is {abs(top):.4g}, below the best measured {best:.4g}: no probe left can win",
            ),
        )

    def _last_gamble(self, view: "_Picture", allowed: np.ndarray | None, target: float) -> Proposal | None:
        """Where the study would stop with budget left: the full probe of a config its memory profile
        turned away (``oom_predicted``) at a P(fits) of ``GAMBLE_FROM`` or more that the model's
        optimistic bound still puts above the best measured, the one with the largest expected
        improvement times P(fits); None where there is none, the OOM allowance is spent or less
        than two full probes are left. A profile's verdict near the wall is a coin the study may
        toss once with budget it would not spend: in the search benchmark's 70B world 5 the study
        stopped at 21 of 25 full-probe equivalents at 0.962 of the optimum, which its profile had
        turned away at P(fits) 0.30; run in full, it fitted and was reported. Below ``GAMBLE_FROM``
        the coin is poor (a profile's verdict under 0.1 fitted 5 % of the time where each launch
        draws its own noise; benchmarks/README.md). Run without another profile (``gamble``): its
        profile already read what a profile can."""
        if not self.settings.memory_profiles or view.best is None:
            return None
        if view.budget_left is not None and view.budget_left <= 1:
            return None
        if self.oom_allowance_spent(view.ooms, len(view.obs) + len(view.exclude), view.budget_left):
            return None
        tried = {o.index for o in view.obs if o.status != "oom_predicted"} | set(view.exclude)
        turned = {o.index for o in view.obs if o.status == "oom_predicted"} - tried
        if allowed is not None:
            turned = {i for i in turned if allowed[i]}
        rows = [i for i in sorted(turned) if view.p_fit[i] >= GAMBLE_FROM and view.stop_bound[i] > target]
        if not rows:
            return None
        where = np.asarray(rows)
        gain = _expected_improvement(view.sign * view.mean[where], view.sd[where], view.sign * view.best)
        k = int(np.argmax(gain * view.p_fit[where]))
        i = rows[k]
        profiled = next(o.number for o in view.obs if o.index == i and o.status == "oom_predicted")
        reason = (
            f"a last gamble: no config left that may fit could win, with {view.budget_left} full probe(s) "
            f"left and the OOM allowance unspent; trial {profiled}'s memory profile turned this config away "
            f"at P(fits) {view.p_fit[i]:.2f}, and the model's bound puts it above the best measured "
            f"(predicted {abs(float(view.mean[i])):.4g} against {abs(view.best):.4g}): run in full, without "
            f"another profile"
        )
        return Proposal(i, self.ranking.enumeration.configs[i], reason, gamble=True)

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
            pool, threshold = candidates & (p_fit >= s.fit_confidence), s.fit_confidence
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
            pool, threshold = candidates & (p_fit >= floor), floor
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
            # the threshold the pool was held to: sure to fit before anything was measured, else the floor
            first = "nothing measured yet and " if view.best is None else ""
            safest = f"the safest left ({first}none is {threshold:.0%} likely to fit)"
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
    stop_bound: np.ndarray  # the stopping rule's optimistic bound (``stop_kappa`` sd), signed to maximise

    @property
    def budget_to_spend(self) -> bool:
        """Whether a budget was given and a full probe of it is left: what a study that would stop
        early may spend on the race of the contenders past the re-measurements held back for it."""
        return self.budget_left is not None and self.budget_left >= 1

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


def _family_words(family: tuple) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(FAMILY_PARAMS, family) if v is not None)


def _short(config: dict[str, Any]) -> str:
    """A config's family and micro-batch in a few words, for a proposal's reason."""
    keys = (*FAMILY_PARAMS, "micro_batch_size")
    return ", ".join(f"{k}={config[k]}" for k in keys if config.get(k) is not None)
