"""How sure a measured figure is: the interval of a mean, of a percentile, and of a throughput
derived from step times (issue 44, "every figure with its interval and its count").

Installed as ``autotune.objectives.intervals``. Pure definitions over plain numbers, like the rest
of :mod:`autotune.objectives`:

- a mean of ``n`` readings: Student's t interval (the readings' own spread; ``n >= 2``);
- a percentile of ``n`` samples (a serving p99): the distribution-free order-statistic interval,
  the ranks the binomial distribution of "samples below the true percentile" allows at the
  confidence; with too few samples its upper end is beyond the largest sample and is reported as
  unbounded (``inf``): 50 requests cannot bound a p99 from above;
- a throughput ``k / step_time`` (tokens/s, samples/s, MFU): the mean step time's interval,
  mapped through ``1 / x`` (a monotone map keeps the coverage);
- a share ``k`` of ``n`` (requests within the SLO, benchmark worlds within 2 %): Clopper-Pearson.

A probe's few measured steps give the spread *within* one run; repeats of a config give the noise
*between* runs, which is usually larger: a figure says which it rests on (``n_steps``,
``measurements``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "CONFIDENCE",
    "NoisePrior",
    "SEPARATED_Z",
    "between_runs_interval",
    "between_runs_words",
    "mean_interval",
    "noise_belief",
    "noise_floor",
    "noise_of_repeats",
    "reading_noise",
    "step_reading_noise",
    "quantile_interval",
    "share_interval",
    "throughput_interval",
    "ci_keys",
    "verdict",
    "repeat_noise",
    "relative_gap",
    "relative_groups",
    "separated",
]

CONFIDENCE = 0.95  # the confidence of every interval autotune reports unless the spec says otherwise
SEPARATED_Z = 2.0  # two means further apart than this many standard errors of their difference are ordered
# no reading is surer than this between runs, whatever its steps say: clocks, timers, the machine's own drift
NOISE_FLOOR_MIN = 0.001


@dataclass(frozen=True)
class NoisePrior:
    """What a study believes of one reading's relative noise between runs before its own repeats
    say: ``dof`` 0, an assumption (the guide's default); more, a measurement of this host with that
    many degrees of freedom, named by ``source`` (``autotune calibrate --serving``'s rounds: each
    closed-loop figure measured by three probes of the engine, :func:`noise_of_repeats`). Why a
    measured prior: on a shared 2-core VM one serving config read 32.0, 25.8 and 28.0 req/s in three
    runs; a study that measured no config twice reported the rate search's bracket of one run
    (4 % wide) as its only interval, which held the mean of the three in none of two studies."""

    noise: float
    dof: int = 0
    source: str = ""

    @property
    def measured(self) -> bool:
        return self.dof > 0

    def to_json(self) -> dict[str, Any]:
        return {"noise": round(self.noise, 4), "dof": self.dof, "source": self.source}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, default: "NoisePrior") -> "NoisePrior":
        """The prior a study recorded (:meth:`to_json`), else ``default``: a record without one (an
        older study, or none measured) reads as the assumption it ran on."""
        if not data or not isinstance(data.get("noise"), (int, float)) or not data["noise"] > 0:
            return default
        return cls(float(data["noise"]), max(0, int(data.get("dof") or 0)), str(data.get("source") or ""))


def noise_of_repeats(groups: Iterable[Sequence[float]]) -> tuple[float, int] | None:
    """(the relative noise of one reading, its degrees of freedom) pooled over groups of repeated
    readings of one figure (each reading over its group's mean: :func:`relative_groups`); None
    without a group of two. What ``autotune calibrate --serving`` keeps of its rounds."""
    squares, dof = _repeat_squares(groups)
    return (math.sqrt(squares / dof), dof) if dof else None


def ci_keys(metric: str) -> tuple[str, str]:
    """The names an interval of ``metric`` is kept under (metrics, MLflow, ``--json``)."""
    return f"{metric}_ci_low", f"{metric}_ci_high"


def _finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_interval(values: Iterable[float | None], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student's t interval of the mean of ``values``; None with fewer than two."""
    from scipy import stats

    data = _finite(values)
    n = len(data)
    if n < 2:
        return None
    mean = math.fsum(data) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in data) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2.0, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def quantile_interval(
    values: Iterable[float | None], q: float, confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """The order-statistic interval of the ``q``-th percentile (0-100) of the population ``values``
    were drawn from: sample ranks ``l < u`` with P(X(l) <= true percentile <= X(u)) >= ``confidence``
    (the count of samples below it is Binomial(n, q/100)). An end the samples cannot reach is
    ``-inf`` / ``inf``. None without samples."""
    from scipy import stats

    data = sorted(_finite(values))
    n = len(data)
    if n == 0:
        return None
    p = q / 100.0
    tail = (1.0 - confidence) / 2.0
    # the number of samples below the true percentile is Binomial(n, p): the lower bound is the
    # l-th smallest sample with P(B < l) <= tail, the upper the u-th with P(B >= u) <= tail
    lower = int(stats.binom.ppf(tail, n, p))  # rank (1-based) of the lower bound; 0: none
    upper = int(stats.binom.isf(tail, n, p)) + 1  # rank of the upper bound; > n: none
    low = data[lower - 1] if lower >= 1 else -math.inf
    high = data[upper - 1] if upper <= n else math.inf
    return low, high


def throughput_interval(
    value: float, step_time_s: float, step_times: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """The interval of a figure inversely proportional to the step time (``value`` measured at the
    probe's ``step_time_s``), from the interval of the mean of the measured ``step_times``. None
    with fewer than two steps or an interval reaching zero."""
    interval = mean_interval(step_times, confidence)
    if interval is None or not step_time_s or not math.isfinite(value):
        return None
    low, high = interval
    if low <= 0:
        return None
    return value * step_time_s / high, value * step_time_s / low


def reading_noise(
    low: float | None, high: float | None, n: float | None, confidence: float = CONFIDENCE
) -> float | None:
    """The relative standard error of one reading's mean from its within-run interval (``low``,
    ``high``: :func:`mean_interval` of ``n`` steps at ``confidence``, Student's t at ``n`` - 1), as a
    share of the interval's middle; None without a usable interval."""
    from scipy import stats

    data = _finite((low, high, n))
    if len(data) < 3 or data[2] < 2 or data[1] < data[0] or data[0] + data[1] <= 0:
        return None
    t = float(stats.t.ppf(0.5 + confidence / 2.0, int(data[2]) - 1))
    return (data[1] - data[0]) / (t * (data[0] + data[1]))


# the figures a training probe derives from its step times (their within-run interval is the step
# time's, mapped through 1 / x: ``autotune.study.interpret.step_intervals``)
PER_STEP_TIME = ("tokens_per_s_per_device", "tokens_per_s", "samples_per_s", "mfu")


def step_reading_noise(metrics: Mapping[str, Any], metric: str) -> float | None:
    """:func:`reading_noise` of a training probe's reading of ``metric`` (the step time or a figure
    derived from it): its mean step time's within-run interval and step count (``step_time_s_ci_low``
    / ``_high``, ``n_steps``); None for any other figure, or a reading that gave no steps."""
    if metric != "step_time_s" and metric not in PER_STEP_TIME:
        return None
    low, high = ci_keys("step_time_s")
    return reading_noise(metrics.get(low), metrics.get(high), metrics.get("n_steps"))


def noise_floor(within: Iterable[float | None], default: float) -> float:
    """The floor a study's between-run noise starts from (:func:`repeat_noise`, :func:`noise_belief`):
    the pooled within-run standard error of its readings (:func:`reading_noise`, root mean square),
    never below :data:`NOISE_FLOOR_MIN`; ``default`` where no reading gave its steps (a launcher's one
    figure, a simulated world). Why the readings' own steps: between runs a reading cannot be
    surer than within its run, and the noise a device shows is the device's. On one H200 a 3B
    probe's 3 steps gave 0.45 % and repeats of a config 0.25 % (benchmarks/README.md), where the
    CPU default (3 %) called two readings 0.3 % apart 2.1 % noisy: twins never tied and a clear
    winner was never certified."""
    data = [x for x in _finite(within) if x > 0]
    if not data:
        return default
    return max(NOISE_FLOOR_MIN, math.sqrt(math.fsum(x * x for x in data) / len(data)))


def share_interval(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Clopper-Pearson interval of a share ``k`` of ``n`` (exact binomial, never outside [0, 1]);
    None for ``n`` = 0."""
    from scipy import stats

    if n <= 0:
        return None
    tail = (1.0 - confidence) / 2.0
    low = 0.0 if k <= 0 else float(stats.beta.ppf(tail, k, n - k + 1))
    high = 1.0 if k >= n else float(stats.beta.ppf(1.0 - tail, k + 1, n - k))
    return low, high


def verdict(interval: tuple[float, float] | None, target: float) -> str:
    """Whether a latency percentile meets ``target`` at the interval's confidence: ``met`` (its
    upper end is within the target), ``missed`` (its lower end is beyond it) or ``undecided`` (the
    target lies inside the interval: more requests would decide)."""
    if interval is None:
        return "undecided"
    low, high = interval
    if high <= target:
        return "met"
    if low > target:
        return "missed"
    return "undecided"


def relative_groups(groups: Iterable[Sequence[float | None]]) -> Iterator[list[float]]:
    """Each group (a config's readings) with more than one finite reading and a mean other than
    0, as its readings over that mean: what a spread between runs is read from."""
    for group in groups:
        values = _finite(group)
        if len(values) < 2:
            continue
        mean = math.fsum(values) / len(values)
        if mean:
            yield [v / mean for v in values]


def _repeat_squares(groups: Iterable[Sequence[float]]) -> tuple[float, int]:
    """(the sum of squared relative deviations of every reading from its group's mean, the degrees
    of freedom: readings past the first) over the groups with more than one reading."""
    squares, dof = 0.0, 0
    for ratios in relative_groups(groups):
        squares += math.fsum((r - 1.0) ** 2 for r in ratios)
        dof += len(ratios) - 1
    return squares, dof


def repeat_noise(groups: Iterable[Sequence[float]], floor: float, unrepeated: float | None = None) -> float:
    """The relative noise of one reading between runs: the pooled spread of the groups (a config's
    readings) with more than one reading, each reading over its group's mean; never below
    ``floor`` (a pair of readings says little), nor below ``unrepeated`` while no group was read
    twice (a floor from the probes' own steps, :func:`noise_floor`, says what a run varies within
    itself, not what placement or the machine's state add between runs: single readings are
    compared at the default until a repeat has shown the study's noise). The report's best
    (``autotune.study.records``) and the guide's race of the two best read the study's noise
    through this one definition; the certificate's claim of how sure the study is reads
    :func:`noise_belief`."""
    squares, dof = _repeat_squares(groups)
    if not dof:
        return max(floor, unrepeated if unrepeated is not None else floor)
    return max(floor, math.sqrt(squares / dof))


def noise_belief(groups: Iterable[Sequence[float]], floor: float, prior_dof: int = 0) -> tuple[float, int]:
    """(the noise a claim of how sure a study is rests on, its degrees of freedom; 0: none was
    measured). The floor enters as one pair of readings would (a conjugate prior worth one
    degree of freedom): sqrt((floor^2 + sum of squares) / (dof + 1)). With no repeat that is the
    floor; with many, the measured spread; a measured spread below the floor is believed as far
    as its readings go (where :func:`repeat_noise`'s hard floor would overstate a 2 % noise by
    half, and a claim averaged over the noise's own uncertainty, ``autotune.objectives.race``,
    would count the floor's caution twice). ``prior_dof``: the floor is a measurement of the host
    with that many degrees of freedom (a :class:`NoisePrior` measured): it weighs as much as that
    many repeats and counts among the degrees of freedom returned."""
    squares, dof = _repeat_squares(groups)
    weight = max(1, prior_dof)
    return math.sqrt((floor**2 * weight + squares) / (dof + weight)), dof + max(0, prior_dof)


def between_runs_interval(
    readings: Sequence[float], noise: float, dof: int | None, confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """The interval of a config's true mean between runs (issue 44: a figure's interval within one
    run says nothing of how the next run reads): the mean of its ``readings`` +/- t x ``noise`` x
    mean / sqrt(n), ``noise`` the study's relative noise per reading with ``dof`` degrees of freedom
    (:func:`noise_belief`: Student's t at dof + 1, the floor's pair included; None: the noise is
    known, a normal quantile). None without a reading, or on an assumed noise (``dof`` 0): an
    interval on a noise no repeat measured would read as a measurement."""
    from scipy import stats

    data = _finite(readings)
    if not data or dof == 0:
        return None
    mean = math.fsum(data) / len(data)
    q = 0.5 + confidence / 2.0
    z = float(stats.norm.ppf(q)) if dof is None else float(stats.t.ppf(q, dof + 1))
    half = z * noise * abs(mean) / math.sqrt(len(data))
    return mean - half, mean + half


def between_runs_words(between: Mapping[str, Any] | None) -> str | None:
    """A best's figure between runs in words (``StudyResult.certificate["between_runs"]``: metric,
    low, high, readings, noise, confidence), for the run's output and the exports' headers; None
    without one."""
    if not between:
        return None
    readings = int(between["readings"])
    by = between.get("noise_from") or "its repeats"
    return (
        f"between runs: {between['metric']} {between['low']:,.4g}-{between['high']:,.4g} "
        f"({between['confidence']:.0%}; {'one reading' if readings == 1 else f'the mean of {readings} readings'} "
        f"at the study's noise {between['noise']:.1%} per reading, measured by {by})"
    )


def relative_gap(a: float, na: int, b: float, nb: int, noise: float) -> tuple[float, float] | None:
    """(the gap between two means of ``na`` and ``nb`` readings, as a share of ``a``; the standard
    error of that gap at ``noise`` relative per reading); None when ``a`` is 0 (no share of it)."""
    if not a:
        return None
    return abs(a - b) / abs(a), noise * math.sqrt(1.0 / na + 1.0 / nb)


def separated(a: float, na: int, b: float, nb: int, noise: float) -> bool:
    """Whether two means of ``na`` and ``nb`` readings are further apart than :data:`SEPARATED_Z`
    standard errors of their difference (:func:`relative_gap`); a mean ``a`` of 0 is apart from any."""
    gap = relative_gap(a, na, b, nb, noise)
    return gap is None or gap[0] > SEPARATED_Z * gap[1]
