"""How sure a study is of its best: the certificate of a leader among measured configs, and the
race that earns it (issue 44, "racing the contenders").

Installed as ``autotune.objectives.race``. Pure definitions over readings, like the rest of
:mod:`autotune.objectives`.

A config's readings (one figure per probe: tokens/s, goodput) carry between-run noise of
``noise`` relative per reading (:func:`~autotune.objectives.intervals.repeat_noise`). The claim a
study makes of its leader ``L`` is "L is within ``tolerance`` of the true best among the measured
configs". Against one other config ``j`` that fails when ``(1 - tolerance) * mu_j > mu_L``
(maximise) or ``mu_L > (1 + tolerance) * mu_j`` (minimise); with the means' normal sampling
distributions the chance it holds is ``P_j = Phi(margin / se)``. The events share ``mu_L``:
given ``mu_L`` they are independent, so the claim over every other config is the product of the
conditional chances averaged over ``mu_L``'s distribution (Gauss-Hermite quadrature; exact under
the normal model). The product of the marginal ``P_j`` is a lower bound that counts the leader's
own uncertainty once per contender (``tests/test_race.py`` checks the claim against simulated
truth). A study's noise is itself estimated, from the few configs it measured more than once
and the floor (:func:`~autotune.objectives.intervals.noise_belief`): with ``noise_dof`` degrees of
freedom the claim averages over the noise's own uncertainty (the scaled inverse chi-square of the
variance, ``noise_dof`` + 1 degrees of freedom; Student's t for one comparison), so that one pair
of readings that happened to agree does not certify a leader at a noise the study never saw.

The race measures the config whose readings most threaten the claim, against the leader,
interleaved (the less-measured of the two goes next: A, B, A, B, so a drift of the machine hits
both), until the claim is held at ``confidence``, or nothing left can be measured again.

Another config is **tied** with a certified leader when the readings cannot order the two (the
difference within :data:`~autotune.objectives.intervals.SEPARATED_Z` standard errors) and it is
certified too: either is within the tolerance of the best at the confidence, and the
recommendation may choose between them by what the readings cannot see (memory headroom).

What a model adds (``priors``): a config's readings alone treat its true mean as free to sit
anywhere, so a config read once 3 % below a leader at 2 % noise keeps a few percent chance of being
5 % above it, and ten such configs multiply into a leader that is never certified, though it is
right: on the search benchmark at 2 % noise, studies that said P 0.50-0.80 were right 14 times in
16 (benchmarks/README.md). Where the guide's model predicts a config from every *other*
measurement (leave one out; its sd widened by how far such predictions missed in this study),
that prediction is a second, independent measurement of the config's mean: the two combine by
their precisions. The leader's own prediction pulls a lucky reading back, the contenders' pull
theirs toward what the rest of the study says of them.

What this does not cover: configs never measured. The guide's model says none of them can win
(its stopping rule); the certificate speaks of the measured ones and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Hashable, Mapping, Sequence

from .intervals import SEPARATED_Z, separated

__all__ = ["Certificate", "p_within", "certificate", "readings_to_tell", "control_drift"]


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


QUADRATURE_NODES = 40  # Gauss-Hermite nodes over the leader's mean (the integrand is smooth: 40 is plenty)
NOISE_SCALES = 24  # midpoint quantiles of the estimated noise's distribution the claim averages over


@lru_cache(maxsize=64)
def _noise_scales(dof: int | None) -> tuple[float, ...]:
    """Factors on the estimated noise, equally likely: sigma / s = sqrt(nu / X), X ~ chi-square(nu),
    at the midpoints of NOISE_SCALES equal-probability bins, with nu = ``dof`` + 1: the repeats'
    degrees of freedom and the floor's one (:func:`~autotune.objectives.intervals.noise_belief`).
    ``None`` (a known noise): (1.0,)."""
    if dof is None:
        return (1.0,)
    from scipy.stats import chi2

    nu = max(0, dof) + 1
    u = [(i + 0.5) / NOISE_SCALES for i in range(NOISE_SCALES)]
    return tuple(math.sqrt(nu / float(x)) for x in chi2.ppf(u, nu))


@lru_cache(maxsize=1)
def _standard_normal_nodes() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Nodes and weights of E[g(Z)], Z ~ N(0, 1): probabilists' Gauss-Hermite, weights summing to 1."""
    from numpy.polynomial.hermite_e import hermegauss

    x, w = hermegauss(QUADRATURE_NODES)
    return tuple(float(v) for v in x), tuple(float(v) for v in w / w.sum())


def p_within(
    lead: float, n_lead: int, other: float, n_other: int, noise: float, tolerance: float, maximize: bool
) -> float:
    """P(the leader's true mean is within ``tolerance`` of the other's, or better), from two means
    of ``n_lead`` and ``n_other`` readings at ``noise`` relative sd per reading."""
    factor = (1.0 - tolerance) if maximize else (1.0 + tolerance)
    return _p_beyond(
        (lead, noise * abs(lead) / math.sqrt(n_lead)),
        (other, noise * abs(other) / math.sqrt(n_other)),
        factor,
        maximize,
    )


def readings_to_tell(noise: float, tolerance: float, confidence: float) -> int:
    """Readings of each of two equally fast configs after which either is within ``tolerance`` of the
    other at ``confidence`` (one-sided normal): ``2 (z noise / tolerance)^2``. What a study at this
    noise must spend per contender to certify a leader against an equal (the certificate's words)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(confidence)
    return max(1, math.ceil(2.0 * (z * noise / tolerance) ** 2))


@dataclass
class Certificate:
    """What the readings say of the leader: ``p`` (P(within ``tolerance`` of the best measured)),
    the configs that threaten it most first, and the ties."""

    leader: Hashable
    p: float
    tolerance: float
    confidence: float
    noise: float
    configs: int  # measured configs the claim covers (the leader included)
    readings: int  # readings it rests on
    threats: list[tuple[Hashable, float]] = field(default_factory=list)  # (config, P_j) by P_j ascending
    ties: list[Hashable] = field(default_factory=list)  # not ordered from the leader by the readings
    # P(no config not measured beats the leader by more than the tolerance), where a model can say
    # (the guide's, ``Guide.unmeasured_claim``); None: the claim is about the measured configs only
    p_unmeasured: float | None = None
    # the degrees of freedom of the repeats behind ``noise`` (readings past the first of the configs
    # read more than once, the drift control apart; the floor adds one,
    # ``intervals.noise_belief``); 0: assumed (the floor alone), and a claim on an assumed noise is
    # never certified; None: the noise is known (a simulation)
    noise_dof: int | None = None
    # measured configs whose true mean the model's leave-one-out prediction informed besides their
    # readings (``certificate``'s ``priors``); 0: the readings alone
    model_informed: int = 0

    @property
    def noise_measured(self) -> bool:
        return self.noise_dof is None or self.noise_dof > 0

    @property
    def p_overall(self) -> float:
        """P(within the tolerance of the best config of the space): the readings' claim times the
        model's for the configs not measured (where known)."""
        return self.p * (self.p_unmeasured if self.p_unmeasured is not None else 1.0)

    @property
    def certified(self) -> bool:
        """P at the confidence, on a noise the study measured. On the search benchmark at 5 % noise
        all ten certificates had rested on the assumed 3 % floor, the two wrong ones among them: a
        leader that read 11 % high once was certified at 0.97 (benchmarks/README.md)."""
        return self.noise_measured and self.p_overall >= self.confidence

    def with_unmeasured(self, p: float) -> "Certificate":
        """This certificate with the model's claim over the configs not measured; ties stand only
        while the whole claim is certified."""
        self.p_unmeasured = float(p)
        if not self.certified:
            self.ties = []
        return self

    def to_json(self) -> dict:
        return {
            "p_within_tolerance": round(self.p_overall, 4),
            "p_measured": round(self.p, 4),
            "p_unmeasured": None if self.p_unmeasured is None else round(self.p_unmeasured, 4),
            "tolerance": self.tolerance,
            "confidence": self.confidence,
            "certified": self.certified,
            "noise": round(self.noise, 4),
            "noise_measured": self.noise_measured,
            "configs": self.configs,
            "readings": self.readings,
            "model_informed": self.model_informed,
        }


def certificate(
    groups: Mapping[Hashable, Sequence[float]],
    leader: Hashable,
    noise: float,
    tolerance: float,
    confidence: float,
    maximize: bool,
    noise_dof: int | None = None,
    priors: Mapping[Hashable, tuple[float, float]] | None = None,
) -> Certificate:
    """The certificate of ``leader`` among ``groups`` (config -> its readings; configs without a
    reading are skipped). ``noise_dof``: the degrees of freedom ``noise`` was estimated with (the
    claim averages over its uncertainty); 0: assumed, and the certificate is not certified whatever
    its P; None: known. ``priors``: config -> (mean, sd) of what a model predicts of its true mean
    from every *other* measurement (leave one out), combined with its readings (the module's
    docstring, "what a model adds"); a config without one rests on its readings alone."""
    groups = {k: [float(v) for v in vs if v is not None and math.isfinite(float(v))] for k, vs in groups.items()}
    groups = {k: vs for k, vs in groups.items() if vs}
    if leader not in groups:
        raise ValueError(f"the leader {leader!r} has no reading")
    priors = {k: v for k, v in (priors or {}).items() if k in groups and _usable_prior(v)}
    p, threats = _claim(groups, leader, noise, tolerance, maximize, noise_dof, priors)
    cert = Certificate(
        leader=leader,
        p=p,
        tolerance=tolerance,
        confidence=confidence,
        noise=noise,
        configs=len(groups),
        readings=sum(len(v) for v in groups.values()),
        threats=threats,
        noise_dof=noise_dof,
        model_informed=len(priors),
    )
    if cert.certified:  # ties only beside a certified leader (not on an assumed noise)
        m_lead, n_lead = _mean(groups[leader]), len(groups[leader])
        cert.ties = [
            key
            for key, values in groups.items()
            if key != leader
            and not separated(m_lead, n_lead, _mean(values), len(values), noise)
            and _claim(groups, key, noise, tolerance, maximize, noise_dof, priors)[0] >= confidence
        ]
    return cert


def _usable_prior(prior: tuple[float, float]) -> bool:
    mean, sd = prior
    return math.isfinite(mean) and math.isfinite(sd) and sd > 0


def _posterior(values: Sequence[float], noise: float, prior: tuple[float, float] | None) -> tuple[float, float]:
    """(mean, sd) of a config's true mean: its readings' mean at ``noise`` relative sd per reading,
    combined, where a model predicts it from the other measurements (``prior``), with that
    prediction by their precisions (normal-normal)."""
    m, n = _mean(values), len(values)
    se = noise * abs(m) / math.sqrt(n)
    if prior is None or se <= 0:
        return m, se
    pm, psd = prior
    w_read, w_prior = 1.0 / se**2, 1.0 / psd**2
    var = 1.0 / (w_read + w_prior)
    return var * (w_read * m + w_prior * pm), math.sqrt(var)


def _p_beyond(lead: tuple[float, float], other: tuple[float, float], factor: float, maximize: bool) -> float:
    """P(the leader's true mean is within the tolerance of the other's, or better), from the two
    posteriors (mean, sd); ``factor``: 1 - tolerance (maximise) or 1 + tolerance (minimise)."""
    margin = (lead[0] - factor * other[0]) if maximize else (factor * other[0] - lead[0])
    var = lead[1] ** 2 + (factor * other[1]) ** 2
    if var <= 0:
        return 1.0 if margin >= 0 else 0.0
    return _phi(margin / math.sqrt(var))


def _claim(
    groups: Mapping[Hashable, Sequence[float]],
    leader: Hashable,
    noise: float,
    tolerance: float,
    maximize: bool,
    noise_dof: int | None = None,
    priors: Mapping[Hashable, tuple[float, float]] | None = None,
) -> tuple[float, list[tuple[Hashable, float]]]:
    """(P(``leader`` within ``tolerance`` of the best of ``groups``); the other configs with their
    marginal P_j, least first). The claim integrates over the leader's true mean, given which the
    other configs' events are independent, and over the noise's own uncertainty where it was
    estimated (the module's docstring); each config's true mean is its readings', combined with
    the model's leave-one-out prediction where ``priors`` has one."""
    import numpy as np
    from scipy.special import ndtr

    priors = priors or {}
    scales = _noise_scales(noise_dof)
    factor = (1.0 - tolerance) if maximize else (1.0 + tolerance)
    sign = 1.0 if maximize else -1.0
    others = [k for k in groups if k != leader]
    # per noise scale: the leader's posterior (mean, sd), and every other config's
    lead = np.array([_posterior(groups[leader], noise * c, priors.get(leader)) for c in scales])  # (S, 2)
    rest = np.array(
        [[_posterior(groups[k], noise * c, priors.get(k)) for k in others] for c in scales], dtype=float
    ).reshape(len(scales), len(others), 2)  # (S, K, 2)

    def chance(margin: np.ndarray, sd: np.ndarray) -> np.ndarray:  # P(normal margin >= 0); a point where sd is 0
        safe = np.where(sd > 0, sd, 1.0)
        return np.where(sd > 0, ndtr(margin / safe), (margin >= 0).astype(float))

    # the marginal P_j: the leader's and the other's uncertainty together, averaged over the noise scales
    marginal = chance(
        sign * (lead[:, None, 0] - factor * rest[:, :, 0]),
        np.sqrt(lead[:, None, 1] ** 2 + (factor * rest[:, :, 1]) ** 2),
    ).mean(axis=0)
    threats = sorted(zip(others, (float(v) for v in marginal)), key=lambda kv: kv[1])
    if not others or lead[0, 1] <= 0:
        return math.prod(pj for _, pj in threats), threats
    # the claim: given the leader's mean (quadrature nodes), the others' events are independent
    nodes, weights = _standard_normal_nodes()
    mu = lead[:, 0, None] + lead[:, 1, None] * np.asarray(nodes)[None, :]  # (S, N)
    given = chance(
        sign * (mu[:, :, None] - factor * rest[:, None, :, 0]),
        np.broadcast_to(factor * rest[:, None, :, 1], (len(scales), len(nodes), len(others))),
    ).prod(axis=2)  # (S, N)
    p = float((given * np.asarray(weights)[None, :]).sum() / len(scales))
    return min(1.0, max(0.0, p)), threats


def control_drift(readings: Sequence[tuple[int, float]], noise: float) -> dict | None:
    """Whether the machine drifted over a study (issue 44, "drift"): the readings of one control
    config, re-measured at intervals, as (trial number, value) in trial order. The largest change of
    a later reading from the first, relative; ``beyond_noise`` when it exceeds
    :data:`~autotune.objectives.intervals.SEPARATED_Z` standard errors of the difference of two
    readings (``noise`` relative each): the same config no longer measures the same, so comparing
    configs measured before and after that trial is unsafe. None with fewer than two readings."""
    readings = [(int(n), float(v)) for n, v in readings if v is not None and math.isfinite(float(v))]
    if len(readings) < 2 or not readings[0][1]:
        return None
    first_trial, first = readings[0]
    at, value = max(readings[1:], key=lambda nv: abs(nv[1] / first - 1.0))
    change = value / first - 1.0
    limit = SEPARATED_Z * noise * math.sqrt(2.0)
    return {
        "control_trial": first_trial,
        "first": first,
        "at_trial": at,
        "value": value,
        "change": change,
        "limit": limit,
        "readings": len(readings),
        "beyond_noise": abs(change) > limit,
    }
