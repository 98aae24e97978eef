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
    if maximize:
        margin = lead - (1.0 - tolerance) * other
        var = noise**2 * (lead**2 / n_lead + ((1.0 - tolerance) * other) ** 2 / n_other)
    else:
        margin = (1.0 + tolerance) * other - lead
        var = noise**2 * (lead**2 / n_lead + ((1.0 + tolerance) * other) ** 2 / n_other)
    if var <= 0:
        return 1.0 if margin >= 0 else 0.0
    return _phi(margin / math.sqrt(var))


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
        }


def certificate(
    groups: Mapping[Hashable, Sequence[float]],
    leader: Hashable,
    noise: float,
    tolerance: float,
    confidence: float,
    maximize: bool,
    noise_dof: int | None = None,
) -> Certificate:
    """The certificate of ``leader`` among ``groups`` (config -> its readings; configs without a
    reading are skipped). ``noise_dof``: the degrees of freedom ``noise`` was estimated with (the
    claim averages over its uncertainty); 0: assumed, and the certificate is not certified whatever
    its P; None: known."""
    groups = {k: [float(v) for v in vs if v is not None and math.isfinite(float(v))] for k, vs in groups.items()}
    groups = {k: vs for k, vs in groups.items() if vs}
    if leader not in groups:
        raise ValueError(f"the leader {leader!r} has no reading")
    p, threats = _claim(groups, leader, noise, tolerance, maximize, noise_dof)
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
    )
    if cert.certified:  # ties only beside a certified leader (not on an assumed noise)
        m_lead, n_lead = _mean(groups[leader]), len(groups[leader])
        cert.ties = [
            key
            for key, values in groups.items()
            if key != leader
            and not separated(m_lead, n_lead, _mean(values), len(values), noise)
            and _claim(groups, key, noise, tolerance, maximize, noise_dof)[0] >= confidence
        ]
    return cert


def _claim(
    groups: Mapping[Hashable, Sequence[float]],
    leader: Hashable,
    noise: float,
    tolerance: float,
    maximize: bool,
    noise_dof: int | None = None,
) -> tuple[float, list[tuple[Hashable, float]]]:
    """(P(``leader`` within ``tolerance`` of the best of ``groups``); the other configs with their
    marginal P_j, least first). The claim integrates over the leader's true mean, given which the
    other configs' events are independent, and over the noise's own uncertainty where it was
    estimated (the module's docstring)."""
    scales = _noise_scales(noise_dof)
    lead = groups[leader]
    m_lead, n_lead = _mean(lead), len(lead)
    threats, others = [], []
    factor = (1.0 - tolerance) if maximize else (1.0 + tolerance)
    for key, values in groups.items():
        if key == leader:
            continue
        m, n = _mean(values), len(values)
        pj = math.fsum(p_within(m_lead, n_lead, m, n, noise * c, tolerance, maximize) for c in scales) / len(scales)
        threats.append((key, pj))
        others.append((factor * m, factor * noise * abs(m) / math.sqrt(n)))
    threats.sort(key=lambda kv: kv[1])
    se_lead = noise * abs(m_lead) / math.sqrt(n_lead)
    if not others or se_lead <= 0:
        return math.prod(pj for _, pj in threats), threats

    def given(mu: float, c: float) -> float:  # P(every other config's event | the leader's mean, the noise x c)
        out = 1.0
        for scaled, se in others:
            margin = (mu - scaled) if maximize else (scaled - mu)
            out *= (1.0 if margin >= 0 else 0.0) if se <= 0 else _phi(margin / (se * c))
        return out

    nodes, weights = _standard_normal_nodes()
    p = math.fsum(w * given(m_lead + se_lead * c * z, c) / len(scales) for c in scales for z, w in zip(nodes, weights))
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
