"""Fit the serving model's engine steps to an engine measured on this host (issue 46).

    autotune calibrate --serving SPEC --out my_host.yaml

The serving model prices an engine step from the profile's roofline (GEMMs, attention, host
launches); on a real engine it was 2.05x optimistic on one CPU study and 4.2x on another, because
what a step costs there (vLLM's scheduler and sampler in Python, a CPU's attention kernels) is
not in the roofline. So the engine itself is measured: short probes per prompt length (the
spec's mean, half and twice it, within the engine's context; three rounds, each figure the median
of its rounds, :func:`pooled_repeats`), each sending closed-loop batches of 1 to 16 requests at
once (the probe's ``batch_sweep``: the batch's TTFT is its prefill, its time for 100 tokens its
decode steps). The model's step is

    step(B, c) = decode_scale * model(B, 0) + prefill_scale * (model(B, c) - model(B, 0))
                 + step_overhead + B * (sequence_overhead + context * context_overhead)
                 + c * prompt_token_overhead
    TTFT       = request_latency + the steps until the first token

(B decoding sequences of ``context`` tokens on average, c prompt tokens; the request latency is
what a request waits outside the engine's steps, which takes no engine time), seven numbers
(:data:`TERMS`) fitted by least squares on the relative error of every reading (bounded: both
factors > 0, the costs >= 0). A batch whose tokens mostly reached the client piled up is
left out (:data:`MIN_TOKENS_APART_SHARE`): its figures are the API server's lag, not the
engine's. The costs per sequence and per token of its context are what the roofline misses most
on a CPU: vLLM's CPU engine decoded sixteen sequences in 40 ms a step at
prompts of 64 tokens and 99 ms at 192, a slope in the context the model's step does not have.
The cost a prompt token is the prompt's on a CPU: the roofline's GEMMs grow more efficient with the
tokens of a step, and vLLM's CPU engine's prefill does not (about 35 us a token at 192-512-token
prompts on the 2-core machine).
The request latency is what the batch sizes tell apart from the prompt's steps (a TTFT at batch 1
that batch 16 does not multiply): counted as engine time, it halves the capacity of an engine
whose API server answers from another core. Every figure the model gives of a closed-loop batch is
affine in the seven, so the fit reads the model's own figures at eight settings (the uncorrected
model, and once off each term) rather than re-deriving its formulas here. The profile keeps the seven
numbers and the readings (``serving_steps``); the study's guide then refits from its own trials as
for training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "BATCHES",
    "TERMS",
    "ServingRun",
    "affine_in_steps",
    "calibration_batches",
    "calibration_prompts",
    "describe_steps",
    "fit_serving_steps",
    "modelled_figures",
    "pooled_repeats",
    "solve_steps",
]

BATCHES = (1, 2, 4, 8, 16)
# the numbers fitted, as the profile's serving_steps names them: (key, its value where nothing is
# measured, how far the model is read off it). Every figure of a closed-loop batch is affine in
# them, so reading the model at the defaults and once off each gives its constant and slopes exactly.
TERMS = (
    ("decode_scale", 1.0, 1.0),
    ("prefill_scale", 1.0, 1.0),
    ("step_overhead_us", 0.0, 1e3),
    ("sequence_overhead_us", 0.0, 1e3),
    ("context_overhead_ns", 0.0, 1e3),
    ("prompt_token_overhead_ns", 0.0, 1e4),
    ("request_latency_us", 0.0, 1e3),
)
_DEFAULTS = np.array([default for _, default, _ in TERMS])  # the uncorrected model
_UNITS = np.array([step for _, _, step in TERMS])
_MIN_SCALE = 1e-3
_PULL = 1e-6  # the pull toward the uncorrected model, against the readings' squared relative errors


@dataclass(frozen=True)
class ServingRun:
    """One calibration probe: the workload it ran (one prompt length) and what it measured
    (``batch{b}_ttft_ms`` and ``batch{b}_time_for_100_tokens_s`` per batch size b)."""

    prompt_len: int
    workload: Mapping[str, Any]
    measured: Mapping[str, float]


def calibration_batches(max_num_seqs: int, batches: Sequence[int] = BATCHES) -> list[int]:
    """The batch sizes a config admits at once (at most its ``max_num_seqs``): a larger batch would
    queue behind it and measure the queue, not a step."""
    kept = [b for b in batches if b <= max_num_seqs]
    return kept or [1]


def calibration_prompts(prompt_mean: float, output_len: int, max_model_len: int | None) -> list[int]:
    """Half, once and twice the traffic's mean prompt, each within the engine's context less the
    output (distinct, ascending)."""
    room = (int(max_model_len) - int(output_len)) if max_model_len else None
    out: list[int] = []
    for factor in (0.5, 1.0, 2.0):
        n = max(int(round(prompt_mean * factor)), 8)
        if room is not None:
            n = min(n, room)
        if n >= 1 and n not in out:
            out.append(n)
    return sorted(out)


def describe_steps(steps: Mapping[str, Any]) -> str:
    """The fitted terms in words, as the calibration command and the published-rows benchmark print them."""
    return (
        f"decode x{steps['decode_scale']:.3g}, prompt x{steps['prefill_scale']:.3g}, "
        f"+{steps['step_overhead_us']:.0f} us a step, +{steps['sequence_overhead_us']:.0f} us a decoding sequence, "
        f"+{steps['context_overhead_ns']:.0f} ns a token of its context, "
        f"+{steps['prompt_token_overhead_ns'] / 1e3:.1f} us a prompt token, "
        f"+{steps['request_latency_us'] / 1e3:.1f} ms to a TTFT (outside the steps)"
    )


def _with_steps(hardware: Mapping[str, Any], theta: Sequence[float]) -> dict[str, Any]:
    return {**hardware, "serving_steps": {"engine": "fit", **{key: float(v) for (key, _, _), v in zip(TERMS, theta)}}}


# a batch whose tokens mostly arrived piled up (objectives.serving.tokens_apart_share)
# timed the API server's lag, not the engine's steps: it is left out of the fit
MIN_TOKENS_APART_SHARE = 0.5
_FIGURES = ("ttft_ms", "time_for_100_tokens_s")  # a closed-loop batch's figures the fit reads


def _usable(value: Any) -> bool:
    """A figure the fit can read: a finite number above zero."""
    try:
        return value is not None and np.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        return False


def _piled_up(measured: Mapping[str, float], batch: int) -> float | None:
    """The batch's ``tokens_apart_share`` when it is under :data:`MIN_TOKENS_APART_SHARE`, else None."""
    share = measured.get(f"batch{batch}_tokens_apart_share")
    return None if share is None or float(share) >= MIN_TOKENS_APART_SHARE else float(share)


def _keys(measured: Mapping[str, float], batches: Sequence[int]) -> list[str]:
    keys = []
    for b in batches:
        if _piled_up(measured, b) is not None:
            continue
        keys += [f"batch{b}_{figure}" for figure in _FIGURES if _usable(measured.get(f"batch{b}_{figure}"))]
    return keys


def modelled_figures(
    model: Mapping[str, Any],
    workload: Mapping[str, Any],
    hardware: Mapping[str, Any],
    cluster: Mapping[str, Any],
    params: Mapping[str, Any],
    keys: Sequence[str],
    theta: Sequence[float] | None = None,
) -> np.ndarray:
    """The model's closed-loop figures ``keys`` for one config, in seconds, its steps set to
    ``theta`` (the values of :data:`TERMS`, in the profile's units; default: uncorrected)."""
    theta = _DEFAULTS if theta is None else theta
    from .simulate import columns_from_params, simulate_configs

    out = simulate_configs(
        dict(model), dict(workload), _with_steps(hardware, theta), dict(cluster), columns_from_params([dict(params)])
    )
    return np.array([float(out[k][0]) / (1e3 if k.endswith("_ms") else 1.0) for k in keys])


def affine_in_steps(figures: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(constant, slopes) of figures that are affine in the values of :data:`TERMS`: ``figures(theta)``
    read at the uncorrected model and once off each term (the model's own figures, not its formulas)."""
    g0 = np.asarray(figures(_DEFAULTS), dtype=float)
    J = np.stack(
        [(np.asarray(figures(_DEFAULTS + off), dtype=float) - g0) / u for off, u in zip(np.diag(_UNITS), _UNITS)], 1
    )
    return g0 - J @ _DEFAULTS, J


def solve_steps(J: np.ndarray, c: np.ndarray, target: np.ndarray, pull: float = _PULL) -> np.ndarray:
    """The values of :data:`TERMS` that bring the affine figures ``c + J theta`` to ``target``: least
    squares on the relative error, each scale above zero and each cost at least zero, each term pulled
    toward the uncorrected model with weight ``pull`` (a squared relative error per squared unit:
    a factor of 1, a millisecond, a microsecond a context token)."""
    from scipy.optimize import lsq_linear

    w = 1.0 / target
    lower = [_MIN_SCALE if key.endswith("_scale") else 0.0 for key, _, _ in TERMS]
    # Where the model's decode step is affine in the batch and its context (a small model's memory-bound
    # step is), its factor is a blend of the three costs and the readings cannot tell them apart; a
    # faint pull toward the uncorrected model (in each term's own unit) picks the one answer closest to
    # it, and leaves every term the readings do determine where they put it.
    weight = np.sqrt(pull) / _UNITS
    A = np.vstack([J * w[:, None], np.diag(weight)])
    b = np.concatenate([(target - c) * w, weight * _DEFAULTS])
    return lsq_linear(A, b, bounds=(lower, [np.inf] * len(TERMS))).x


def pooled_repeats(runs: Sequence[ServingRun]) -> list[ServingRun]:
    """Probes of one prompt length (and batches) as one run: each figure the median of the repeats
    whose batch timed the engine (a repeat whose stream came piled up is not counted), with
    ``{key}_readings`` (how many) and, from two, ``{key}_spread`` ((highest - lowest) / median). Why the
    median: on the shared 2-core VM single rounds of three calibrations put the model 1.31-2.52x off one
    study's goodput, the median of each calibration's three rounds 1.39x, 1.40x and 1.52x; the fastest
    reading of each point (the training calibration's rule) 1.59-1.83x, since the study ran on that busy
    host too (benchmarks/README.md, "The calibration in rounds"). A batch piled
    up in every repeat keeps the lowest share, so the fit leaves it out and says so. Runs in
    first-seen order of their prompt length."""
    groups: dict[tuple[int, tuple[int, ...]], list[ServingRun]] = {}
    for run in runs:
        batches = tuple(int(b) for b in run.workload.get("batch_sweep") or ())
        groups.setdefault((run.prompt_len, batches), []).append(run)
    pooled = []
    for (prompt_len, batches), group in groups.items():
        measured: dict[str, Any] = {}
        for run in group:  # whatever else the probes reported: the first repeat's that has it
            for key, value in run.measured.items():
                measured.setdefault(key, value)
        for b in batches:
            timed = [r for r in group if _piled_up(r.measured, b) is None]
            if not timed:
                measured[f"batch{b}_tokens_apart_share"] = min(_piled_up(r.measured, b) or 0.0 for r in group)
                continue
            shares = [
                float(r.measured[f"batch{b}_tokens_apart_share"])
                for r in timed
                if f"batch{b}_tokens_apart_share" in r.measured
            ]
            if shares:
                measured[f"batch{b}_tokens_apart_share"] = float(np.median(shares))
            else:
                measured.pop(f"batch{b}_tokens_apart_share", None)
            for figure in _FIGURES:
                key = f"batch{b}_{figure}"
                values = [float(r.measured[key]) for r in timed if _usable(r.measured.get(key))]
                if not values:
                    measured.pop(key, None)
                    continue
                middle = float(np.median(values))
                measured[key] = middle
                measured[f"{key}_readings"] = len(values)
                if len(values) > 1:
                    measured[f"{key}_spread"] = (max(values) - min(values)) / middle
        pooled.append(ServingRun(prompt_len, group[0].workload, measured))
    return pooled


def repeat_noise(runs: Sequence[ServingRun]) -> tuple[float, int] | None:
    """(the relative noise of one probe's reading between runs, its degrees of freedom) from the repeats
    of each prompt length: every closed-loop figure the fit reads, each repeat's over the figure's mean
    (:func:`autotune.objectives.intervals.noise_of_repeats`, repeats whose stream piled up left out as
    the fit leaves them); None without a figure measured twice. The degrees of freedom are the probes
    past the first of each prompt length, not the figures: one probe's figures share its spell of the
    host (a slow round slows every batch it sends), so a probe is one draw of the host's state. What a
    serving study takes as its noise before its own repeats measure one (the profile's
    ``serving_steps.repeat_noise``; :func:`autotune.guide.spec_settings.guide_settings`)."""
    from autotune.objectives.intervals import noise_of_repeats

    groups: dict[tuple[int, tuple[int, ...]], list[ServingRun]] = {}
    for run in runs:
        groups.setdefault((run.prompt_len, tuple(int(b) for b in run.workload.get("batch_sweep") or ())), []).append(
            run
        )
    figures: list[list[float]] = []
    probes = 0
    for (_, batches), group in groups.items():
        timing = set()
        for b in batches:
            timed = [r for r in group if _piled_up(r.measured, b) is None]
            for figure in _FIGURES:
                values = [
                    (i, float(r.measured[f"batch{b}_{figure}"]))
                    for i, r in enumerate(timed)
                    if _usable(r.measured.get(f"batch{b}_{figure}"))
                ]
                if len(values) > 1:
                    figures.append([v for _, v in values])
                    timing.update(id(timed[i]) for i, _ in values)
        probes += max(len(timing) - 1, 0)
    pooled = noise_of_repeats(figures)
    return None if pooled is None or not probes else (pooled[0], probes)


def fit_serving_steps(
    runs: Sequence[ServingRun],
    model: Mapping[str, Any],
    hardware: Mapping[str, Any],
    cluster: Mapping[str, Any],
    params: Mapping[str, Any],
    engine: str,
) -> dict[str, Any]:
    """The profile's ``serving_steps``: the numbers of :data:`TERMS` fitted to every reading of
    ``runs`` (repeats of a prompt length pooled first, :func:`pooled_repeats`), the fit's rms relative
    error, the most repeats a point rests on and the median point's spread between them, and the
    readings (measured, the model before, the model after, how many). Raises ``ValueError`` when
    fewer readings than terms came back."""
    base = {k: v for k, v in hardware.items() if k != "serving_steps"}
    between = repeat_noise(runs)
    runs = pooled_repeats(runs)
    rows: list[tuple[ServingRun, str]] = []
    slopes, consts, y = [], [], []
    left_out = []  # batches whose stream timed the API server's lag (MIN_TOKENS_APART_SHARE)
    for run in runs:
        batches = [int(b) for b in run.workload.get("batch_sweep") or ()]
        left_out += [
            {"prompt_len": run.prompt_len, "batch": b, "tokens_apart_share": share}
            for b in batches
            if (share := _piled_up(run.measured, b)) is not None
        ]
        keys = _keys(run.measured, batches)
        if not keys:
            continue
        const, J = affine_in_steps(
            lambda theta, run=run, keys=keys: modelled_figures(model, run.workload, base, cluster, params, keys, theta)
        )
        consts.append(const)
        slopes.append(J)
        y.append(np.array([float(run.measured[k]) / (1e3 if k.endswith("_ms") else 1.0) for k in keys]))
        rows.extend((run, k) for k in keys)
    if len(rows) < len(TERMS):
        raise ValueError(
            f"{len(rows)} closed-loop reading(s) came back from the engine; the fit needs at least {len(TERMS)} "
            "(see the probes' logs for why the batches failed)"
        )
    J, c, target = np.vstack(slopes), np.concatenate(consts), np.concatenate(y)
    theta = solve_steps(J, c, target)
    before = c + J @ _DEFAULTS
    after = c + J @ theta
    points = [
        {
            "prompt_len": run.prompt_len,
            "batch": int(key[5:].split("_", 1)[0]),
            "figure": key.split("_", 1)[1],
            "measured_s": round(float(m), 6),
            "model_s": round(float(b), 6),
            "fitted_s": round(float(a), 6),
            "readings": int(run.measured.get(f"{key}_readings", 1)),
            **({"spread": round(float(run.measured[f"{key}_spread"]), 4)} if f"{key}_spread" in run.measured else {}),
        }
        for (run, key), m, b, a in zip(rows, target, before, after)
    ]
    spreads = [p["spread"] for p in points if p["readings"] > 1]
    return {
        "engine": engine,
        **{key: round(float(v), 6) for (key, _, _), v in zip(TERMS, theta)},
        "rms_error": round(float(np.sqrt(np.mean((after / target - 1.0) ** 2))), 6),
        "repeats": max(p["readings"] for p in points),
        **({"repeat_spread": round(float(np.median(spreads)), 4)} if spreads else {}),
        # one reading's noise between probes on this host, what a serving study assumes until its repeats say
        **({"repeat_noise": round(between[0], 4), "repeat_noise_dof": between[1]} if between else {}),
        "points": points,
        "left_out": left_out,
    }
