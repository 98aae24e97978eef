"""The race of the contenders (issue 44): which measured config the study reports, whether the
readings certify it, which config to measure again, the drift checks, readings set aside as
interference, and the model's leave-one-out predictions the certificate reads.

A mixin of :class:`~.guided.Guide` (its half on measured configs; memory is
:mod:`.memory_belief`): what it reads of the guide, :class:`GuideRace` declares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from autotune.objectives.interference import interference_flags, interference_gap, slowed_by_interference
from autotune.objectives.intervals import noise_belief, noise_floor, repeat_noise, separated
from autotune.objectives.race import certificate

from .bayes import _erfc_array, _expected_improvement, _sd_scale
from .interface import GuideSettings, Observation, Proposal, readings_of, readings_taken
from .ranking import Ranking


@dataclass
class LeaveOneOut:
    """The objective model checked against this study's readings (:meth:`Guide.leave_one_out`):
    ``rows``: measured config -> (its prediction from every other measurement, that prediction's
    sd, the config's mean reading, the variance of that mean at the study's noise); ``scale``: the
    factor on the model's sd that those misses bear out (:func:`_sd_scale`)."""

    rows: dict[int, tuple[float, float, float, float]]
    scale: float


SUSPECT_Z = 2.0  # a single reading this many sd below the model's prediction without it may be interference ...
SUSPECT_MIN_MEASURED = 4  # ... once this many configs were measured, its own included (the others predict it)
SUSPECT_MAX_SLOWDOWN = 0.5  # ... and a slowdown larger than this share is not read as interference
PRIOR_MIN_MEASURED = 5  # measured configs before the model's leave-one-out predictions inform the certificate
PRIOR_CONFIGS = 12  # the best measured configs the model predicts for the certificate (a leave-one-out fit each)
CLAIMED_CONFIGS = 8  # measured configs the model's claim over the unmeasured is kept for (the best readings)
CLAIM_DRAWS = 1000  # joint draws of the objective model behind a claim over the unmeasured (MC error <= 0.016)
CLAIM_DRAWN = 2000  # at most this many unmeasured configs drawn jointly (the likeliest to beat the leader)
CLAIM_NEGLIGIBLE = 1e-4  # a config less likely than this to beat the leader (and fit) enters by its own chance
CLAIM_SEED = 0


class GuideRace:
    """The race of the contenders of :class:`~.guided.Guide` (this module's docstring). What it reads
    of the guide: the attributes below, built by ``Guide.__init__``; the objective model
    (``Guide._objective_belief``); the memory belief (:class:`~.memory_belief.GuideMemory`'s
    ``_memory_belief`` and ``fit_probability``), for the configs a claim over the unmeasured counts."""

    ranking: Ranking
    settings: GuideSettings
    metric: str  # the first objective ...
    direction: str  # ... "maximize" or "minimize"
    valid: np.ndarray  # the configs the ranking calls valid

    def close_call(
        self,
        obs: list[Observation],
        exclude: Iterable[int] = (),
        allowed: np.ndarray | None = None,
        estimate: np.ndarray | None = None,
        measure_noise: bool = True,
        past_held_back: bool = False,
    ) -> Proposal | None:
        """Another measurement in the race of the contenders (issue 44), or None when the race is
        settled or may not go on. ``measure_noise``: whether a noise no repeat has measured is
        reason enough to race (before the study stops, where nothing else would use the budget;
        not where a re-measurement competes with a new config). ``past_held_back``: the study would
        stop with budget left (no new config can win, or none is left), so the race is not held to
        ``confirm_readings``: the budget left goes to the leader's certificate rather than back
        (``max_readings`` and the budget still bound it).

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
        The race spends at most ``confirm_readings`` re-measurements in the study, more only
        ``past_held_back``. The noise is the
        study's: the spread of the configs it measured more than once, never below ``noise``; while
        no config but the first
        measured (the drift control) was read twice it is assumed, nothing is certified, and the
        closest threat is raced whatever its P."""
        s = self.settings
        maximize = self.direction == "maximize"
        values = readings_of(obs)
        spent = self.race_spent(obs)
        if len(values) < 2 or (not past_held_back and spent >= s.confirm_readings):
            return None
        first = self._control(obs)  # the report's control, drift checks or not (records.best_certificate)
        control = first if s.drift_every > 0 else None
        floor = self.noise_floor(obs)
        noise = self._noise({i: v for i, v in values.items() if i != control}, floor)  # the control spans any drift
        leader = self.race_leader(values, noise, estimate)
        believed, dof = noise_belief((v for i, v in values.items() if i != first), floor, self.prior_dof(floor))
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
                    if spent >= s.confirm_readings:
                        why += (
                            "; past the re-measurements held back for the race (search.confirm_budget): the "
                            "search would stop with budget left"
                        )
                    return Proposal(
                        index,
                        configs[index],
                        (
                            f"re-measure (race): trial {numbers.get(leader)} leads ({a:.4g}, {len(values[leader])} "
                            f"reading(s)) but trial {numbers.get(threat)} ({b:.4g}, {len(values[threat])}) may beat "
                            f"it by more than {s.tie_tolerance:.0%} (P {1 - p:.0%}); {why}"
                            + (
                                "; the control config (the first measured): not charged to search.confirm_budget, "
                                "its readings span the study for the drift check"
                                if index == control
                                else ""
                            )
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
        floor = self.noise_floor(obs)
        noise, _ = noise_belief((v for i, v in values.items() if i != control), floor, self.prior_dof(floor))
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

    def _held_back(self, obs: list[Observation]) -> int:
        """Full probes of the budget held back at its end for the race: the re-measurements it has
        left (``confirm_readings`` less those spent), each at what one costs (``remeasure_cost``),
        rounded up."""
        left = self.settings.confirm_readings - self.race_spent(obs)
        return math.ceil(left * self.settings.remeasure_cost - 1e-9) if left > 0 else 0

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

    def prior_dof(self, floor: float) -> int:
        """The degrees of freedom behind ``floor`` where it is the host's measured noise
        (``settings.noise_dof``: ``autotune calibrate --serving``'s probes); 0 where it is assumed or
        the readings' own steps gave it. The report reads the same (``records.noise_prior_dof``)."""
        return self.settings.noise_dof if floor == self.settings.noise else 0

    def noise_floor(self, obs: list[Observation]) -> float:
        """The floor under the study's noise between runs: its readings' own within-run standard
        error where their probes gave steps (``Observation.reading_noise``,
        :func:`autotune.objectives.intervals.noise_floor`), else ``settings.noise``. The report reads
        the same (``autotune.study.records.study_noise_floor``). A device is not the CPU the default
        was set on: on one H200 readings repeat to 0.25 % and the 3 % default kept twins apart."""
        return noise_floor(
            (o.reading_noise for o in obs if o.status == "ok" and not o.interference), self.settings.noise
        )
