"""The guide's belief about memory: every config's peak (mean and sd), the memory it may use,
P(fits), and the walls a config that ran out of memory shares with its siblings.

A mixin of :class:`~.guided.Guide` (its half on memory; the race of the contenders is
:mod:`.contenders`): it reads the matrices ``Guide.__init__`` builds from the ranking (the
attributes :class:`GuideMemory` declares) and is fitted afresh from the observations at every
call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .bayes import _Posterior, _fitted_sigma, _norm_cdf, _predict, _solve, _truncated_normal
from .interface import GuideSettings, Observation
from .ranking import Ranking
from ..workers.protocol import PEAK_LEAVES_OUT

# knobs that cannot make a config that ran out of memory fit (issue 41): the half precisions hold the
# same bytes, a graph or fusion flag moves no tensor out of memory, an HCCL setting other than a
# smaller buffer allocates as much; a layout that ran out of memory is not probed again with only these
# changed ("the same wall")
SAME_WALL_PRECISIONS = ("bf16", "fp16")
SAME_WALL_FLAGS = ("graph_kernel_flags", "jit_level", "compile", "mode")
HCCL_BUFFER = "env.HCCL_BUFFSIZE"


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


class GuideMemory:
    """The memory model of :class:`~.guided.Guide` (this module's docstring). What it reads of the
    guide, built once by ``Guide.__init__`` from the ranking:"""

    ranking: Ranking
    settings: GuideSettings
    n: int  # configs in the ranking
    limit: np.ndarray  # the simulator's memory limit of each config (GiB)
    peak: np.ndarray  # the simulator's peak of each config (GiB)
    one_hot: np.ndarray  # the parameter values' indicator columns
    mem_components: np.ndarray | None  # the simulator's memory components, one column each ...
    mem_names: list[str]  # ... and their names
    walls: dict[tuple, list[int]]  # a wall (_wall_of) -> the configs that share it
    wall_of: list[tuple]  # each config's wall

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
        """The memory model's posterior given these peaks (relative form: each row over its target).

        Without memory profiles the value effects' prior scale is fitted to the peaks, as the speed
        model's is (empirical Bayes, :func:`~.bayes._fitted_sigma`). How far a parameter value moves
        the peak beyond what the simulator prices differs by world and stack; a fixed 8 % of the
        peak for a value no measured config has (tp 1 in a study that measured tp 2-8) put a 70B
        optimum whose mean the components had right (58.6 GiB, true 59.2, of 60.0) at P(fits) 0.6,
        and a blind full probe there was not risked. Fitted, 70B without profiles reported a config
        within 2 % of the optimum in 164 of 180 benchmark worlds instead of 156, with 3.1 % of its
        full probes out of memory instead of 2.5 % (on worlds with memory terms the simulator lacks,
        7B's rose from 5.3 to 6.9 %: peaks that look explained narrow it before such a term shows).
        With profiles a config near the wall is read by its own profile before its full probe, and
        the fitted scale lost 10 worlds and turned 5 of 360 there (p 0.30), so it keeps the fixed
        prior (benchmarks/README.md, "The memory model's value effects fitted to the peaks where no
        profile runs")."""
        prior = self._memory_prior()
        z = self._mem_design(idx, counts) / targets[:, None]
        ones = np.ones(len(idx))
        prior_sd = np.sqrt(np.diag(prior.cov))
        if self.settings.fit_value_sigma and not self.settings.memory_profiles:
            values = np.arange(len(prior_sd)) >= len(prior_sd) - self.one_hot.shape[1]
            prior_sd = _fitted_sigma(z, ones, prior.mean, prior_sd, values, noise)
        return _solve(z, ones, prior.mean, prior_sd, noise)

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
        # a profile's "over" that its full probe then disproved (the guide's last gamble fitted) caps nothing
        fitted = {o.index for o in obs if o.status == "ok"}
        for o in obs:
            if o.status == "oom_predicted" and o.index in fitted:
                continue
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
