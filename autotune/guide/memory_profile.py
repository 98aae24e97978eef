"""Memory probes on a scaled-down model: learn a layout's memory before risking a full probe.

MindSpeed's auto-settings and DeepSpeed's autotuner profile before they search: a run of one or
two steps of the trial's own layout, with fewer layers per pipeline stage, costs a fraction of a
full probe and measures what decides fit. A layout's peak is, per stage, a static part (the
runtime and its context, embeddings and head, communication buffers, the allocator's floor) plus
a part that grows with the layers the stage holds (their weights, gradients, optimizer states
and the activations kept for the backward). Two profiles of the same layout at ``k1`` and ``k2``
layers per stage pin both parts, and the full model's peak is the line's value at its own layers
per stage; every other setting of the trial (micro-batch, recompute, ZeRO, precision, allocator)
is the full probe's, so the profile measures exactly the memory the full probe would use.

Measured on this CPU (tiny Llama, hidden 512, peak RSS): 0.542 / 0.677 / 0.933 GiB at 2 / 4 / 8
layers (pp 1), 0.481 / 0.548 / 0.687 GiB at 1 / 2 / 4 layers per stage (pp 2): the per-layer slope
from the first two points predicts the third within 2 % on an idle machine; in one CI run
under load a profile read 3 % high and the prediction at 4 layers per stage missed by 6.5 %: the
fit's band carries each profile's noise, amplified by how far the line is read (:class:`StageMemoryFit`).

The scaled-down trial is an ordinary :class:`TrialRequest` whose ``model.num_hidden_layers`` is
``pp * vpp * k`` and whose workload runs one warm-up and one measured step, so every probe that
builds its model from the request runs it as it is: the torch and MindSpore probes and the stack
presets (which render ``--num-layers`` / torchtitan's ``n_layers`` / DeepSpeed's model from the
request). A ``command`` backend's own launcher is told through ``{num_layers}`` in its argv and the
``AUTOTUNE_NUM_LAYERS`` variable; one whose argv has no placeholder cannot be trusted to honour it,
so :func:`why_no_profile` says so and the guide keeps today's behaviour (no memory probes).
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..trial_attrs import A
from ..workers.protocol import TrialRequest

__all__ = [
    "NUM_LAYERS_ENV",
    "NUM_LAYERS_PLACEHOLDER",
    "PROFILE_MARK",
    "PROFILE_LAYERS",
    "layers_per_stage",
    "profile_request",
    "why_no_profile",
    "StageMemoryFit",
    "fit_stage_memory",
    "plan_profile",
    "refine_layers",
    "profile_noise",
    "ProfileEstimate",
    "extrapolate_peak",
    "profile_points",
    "profile_cost_fpe",
    "trial_cost_fpe",
    "cost_of_trials",
    "median_full_wall",
    "profile_residuals",
    "calibrate_estimate",
    "ENDED_EARLY",
    "full_probe_cost_fpe",
    "ran_full_probe",
    "num_layers_of",
    "fill_num_layers",
]

NUM_LAYERS_ENV = "AUTOTUNE_NUM_LAYERS"  # every probe's environment: the layers of the model it runs
NUM_LAYERS_PLACEHOLDER = "{num_layers}"  # a command backend's argv: replaced by the same number
PROFILE_MARK = "memory_profile_layers_per_stage"  # in a profile trial's workload: what it is
PROFILE_LAYERS = (1, 2)  # layers per (virtual) stage of the two profiles of a layout (the fewest)
MIN_LAYERS_PER_STAGE = 4  # a layout with fewer gains little from a profile: probe it in full
MIN_SECOND_PROFILE_LAYERS = 4  # the second profile's layers per stage on a stage of 16 or fewer (half at most)
SECOND_PROFILE_SHARE = 0.25  # ... and on a longer stage, this share of it (plan_profile: the fit's leverage)
# a profile's peak measurement noise, relative: a device allocator's counter repeats to well under
# 0.5 % (the same allocations every run); the CPU's peak RSS to ~1 % idle, 3 % under load (measured)
PROFILE_NOISE = {"cpu": 0.02}
DEVICE_PROFILE_NOISE = 0.005
# before any full probe has run, a profile run's cost in full-probe equivalents is estimated as the
# share of the layers it runs plus this much start-up (process, runtime, communicators)
STARTUP_SHARE = 0.1
# the statuses of a full probe that ends before its last step: at the step that ran out of memory,
# or where the pruner stopped a probe that could not win (autotune.study.pruning)
ENDED_EARLY = ("oom", "pruned")
# such a full probe whose wall is below this share of a full probe's stopped clearly early, and costs
# the budget that share (full_probe_cost_fpe); above it, a whole full probe
EARLY_END_SHARE = 0.6


def _stages(params: Mapping[str, Any]) -> int:
    """Model chunks the layers are split over: pipeline stages times virtual stages."""
    return max(1, int(params.get("pp") or 1)) * max(1, int(params.get("vpp") or 1))


def layers_per_stage(model: Mapping[str, Any], params: Mapping[str, Any]) -> float:
    """The full model's layers per (virtual) stage of a layout (a fraction where they do not
    split evenly: the fit is a line, the largest stage is what the full probe's peak sees)."""
    return int(model.get("num_hidden_layers") or 0) / _stages(params)


def num_layers_of(model: Mapping[str, Any]) -> int:
    """The layers of the model a trial runs (fewer than the spec's in a memory profile)."""
    return int(model.get("num_hidden_layers") or 0)


def fill_num_layers(args: Iterable[Any], model: Mapping[str, Any]) -> list[str]:
    """A launcher's arguments with ``{num_layers}`` replaced by the layers of the model the trial
    runs: how a command backend's or a preset's own script is told a memory profile's size."""
    layers = str(num_layers_of(model))
    return [str(a).replace(NUM_LAYERS_PLACEHOLDER, layers) for a in args]


def profile_request(request: TrialRequest, per_stage: int) -> TrialRequest:
    """The trial's layout with ``per_stage`` layers in each (virtual) pipeline stage, one
    warm-up and one measured step: what decides its memory, at a fraction of its cost."""
    if per_stage < 1:
        raise ValueError(f"a memory profile needs at least one layer per stage, got {per_stage}")
    scaled = copy.deepcopy(request)
    scaled.model["num_hidden_layers"] = _stages(request.params) * per_stage
    workload = scaled.workload
    workload["warmup_steps"] = min(1, int(workload.get("warmup_steps", 1) or 0))
    workload["measured_steps"] = 1
    workload["profile_step"] = False
    workload[PROFILE_MARK] = per_stage
    return scaled


def why_no_profile(backend_kind: str, argv: Iterable[Any] | None = None) -> str | None:
    """None when the backend runs a scaled-down model as asked, else the reason it cannot (and
    the guide falls back to full probes only). ``argv``: a command backend's argv, a preset's
    ``args``."""
    if backend_kind == "simulate":
        return "the simulator predicts memory; there is nothing to profile"
    if backend_kind in ("command", "deepspeed"):
        # a launcher of the user's own (DeepSpeed's config has no model: the script builds it)
        if any(NUM_LAYERS_PLACEHOLDER in str(a) for a in (argv or [])):
            return None
        where = "argv" if backend_kind == "command" else "args"
        return (
            f"the {backend_kind} backend's {where} has no {NUM_LAYERS_PLACEHOLDER} placeholder, so its script may "
            f"run the full model whatever the trial asks (add {NUM_LAYERS_PLACEHOLDER} where it "
            "takes its layer count, e.g. --num-layers {num_layers})"
        )
    if backend_kind in ("vllm", "mindie"):
        return "a serving engine loads the whole model; memory profiles are for training"
    return None  # torch, mindspore, Megatron/MindSpeed and torchtitan render the model the request describes


@dataclass(frozen=True)
class StageMemoryFit:
    """A layout's peak as ``static + per_layer * layers_per_stage`` (GiB), from its profiles.

    ``sd`` is the fit's uncertainty at the full model, two parts in quadrature:
    - the line's own error: a share (``rel_sd``) of the layer part the line is read for, and where
      there are more than two profiles at least their residual times how far past them it is read.
      With two profiles (1 layer and a quarter of the stage, :func:`plan_profile`) the share is
      of the whole layer part: calibrated on the benchmark worlds
      (``benchmarks/profile_extrapolation.py``: with the second at 4 layers, a peak under-predicted
      by more than 1.645 sd in 4.3 % of 2,298 layouts, 5 % nominal; at a quarter of the stage, each
      launch drawing its own noise, 5.1 % of 2,235, an error of 2.05 % rms in a band of 2.55 %),
      though wide on long stages. With a third, far profile (``refine_layers``: half the
      stage) the line is measured up to it and the share is of the part past it: on those long
      stages an error of 0.67 % rms in a band of 1.3 %, 0.7 % under by more than 1.645 sd;
    - each profile's measurement noise (``noise_rel`` of its peak) carried to the full model by
      the least-squares leverage ``1/n + (K - mean k)^2 / sum (k - mean k)^2``: read at 4 layers
      from profiles at 1 and 2, a profile's noise counts sqrt(13) = 3.6 times;
    never below ``floor_gib``. Measured on this CPU (peak RSS, 4 runs each): a profile repeats to
    about 1 % idle; under a CI run's load one read 3 % off, so ``noise_rel`` is 2 %."""

    static_gib: float
    per_layer_gib: float
    profiled: tuple[tuple[float, float], ...]
    rel_sd: float = 0.03  # extrapolation error per unit of the layer part (measured: <= 2 % at 4x)
    noise_rel: float = 0.02  # a profile's peak measurement noise, relative
    floor_gib: float = 0.01

    def predict(self, per_stage: float) -> tuple[float, float]:
        """(peak GiB, sd GiB) at ``per_stage`` layers per (virtual) stage."""
        mean = self.static_gib + self.per_layer_gib * per_stage
        ks = [k for k, _ in self.profiled]
        residual = 0.0
        if len(self.profiled) > 2:
            errs = [peak - (self.static_gib + self.per_layer_gib * k) for k, peak in self.profiled]
            residual = math.sqrt(sum(e * e for e in errs) / (len(errs) - 2))
        reach = max(1.0, per_stage / max(ks))  # how far past the profiles the line is read
        layers_read = per_stage if len(ks) <= 2 else max(per_stage - max(ks), 0.0)
        line = max(residual * reach, self.rel_sd * abs(self.per_layer_gib) * layers_read)
        mk = sum(ks) / len(ks)
        leverage = 1.0 / len(ks) + (per_stage - mk) ** 2 / sum((k - mk) ** 2 for k in ks)
        noise = self.noise_rel * (sum(v for _, v in self.profiled) / len(ks)) * math.sqrt(leverage)
        return mean, max(self.floor_gib, math.hypot(line, noise))


def fit_stage_memory(points: Mapping[float, float]) -> StageMemoryFit:
    """Least-squares line through (layers per stage, peak GiB) of two or more profiles of one
    layout. A slope below zero (noise at tiny layers) is read as zero growth per layer."""
    pts = sorted((float(k), float(v)) for k, v in points.items() if v is not None and math.isfinite(float(v)))
    if len({k for k, _ in pts}) < 2:
        raise ValueError(f"a memory fit needs profiles at two layer counts at least, got {dict(points)}")
    n = len(pts)
    mk = sum(k for k, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    slope = sum((k - mk) * (v - mv) for k, v in pts) / sum((k - mk) ** 2 for k, _ in pts)
    slope = max(0.0, slope)
    return StageMemoryFit(static_gib=mv - slope * mk, per_layer_gib=slope, profiled=tuple(pts))


def plan_profile(model: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[int, int] | None:
    """Layers per (virtual) stage of a layout's two profiles, or None when its stages hold fewer
    than ``MIN_LAYERS_PER_STAGE`` layers (two profiles would cost about a full probe). The second
    profile reads ``SECOND_PROFILE_SHARE`` of the stage, at least ``MIN_SECOND_PROFILE_LAYERS`` and
    at most half of it: a profile's noise reaches the full model by the fit's leverage, about
    ``1.4 * stage / (second - 1)`` for profiles at 1 and ``second`` layers. With the second at 4
    layers whatever the stage, a 70B stage of 80 layers read each profile's noise 36 times (a
    band of about 4.7 GiB where each launch draws its own noise), and its P(fits) rested on how
    the study's other, shorter lines had erred; at a quarter of the stage (20 layers, about 0.06
    more of a full probe's wall) the leverage is about 6 on every stage. On the search benchmark's
    worlds whose launches draw their own noise (benchmarks/README.md, "The second profile at a
    quarter of the stage"), budget 20: within 2 % of the optimum 658 -> 673 of 720 studies, 70B
    151 -> 163 of 180, fewer OOM full probes in three scenarios of four; where a trial's launches
    share one noise, no change beyond chance.
    None too for a first stage of its own size (``first_stage_layers``): its stages hold different
    layers and in-flight micro-batches, which one line of even stages does not read."""
    if params.get("first_stage_layers") is not None:
        return None
    per = layers_per_stage(model, params)
    if per < MIN_LAYERS_PER_STAGE:
        return None
    second = max(MIN_SECOND_PROFILE_LAYERS, int(round(per * SECOND_PROFILE_SHARE)))
    return PROFILE_LAYERS[0], max(PROFILE_LAYERS[1], min(second, int(per // 2)))


def refine_layers(model: Mapping[str, Any], params: Mapping[str, Any], layers: Iterable[int]) -> int | None:
    """Layers per (virtual) stage of a third profile that reads the line far closer to the full
    model: half the stage, where that is more than 1.5 times the farthest profile so far (else the
    third point would add little; twice while the second profile read at most 4 layers); None
    otherwise. It costs about a sixth of a full probe's steps
    plus a start-up, and narrows the band of a long stage's peak from about 3 % to 1.3 % (the
    error from 1.0 % rms to 0.7 %, :class:`StageMemoryFit`): what an undecided verdict needs, near
    the limit, where the optimum often is."""
    per = layers_per_stage(model, params)
    far = max(layers)
    k = int(per // 2)
    return k if k > 1.5 * far else None


def profile_noise(accelerator: str) -> float:
    """A profile's relative peak noise on this accelerator (``PROFILE_NOISE``)."""
    return PROFILE_NOISE.get(str(accelerator), DEVICE_PROFILE_NOISE)


@dataclass(frozen=True)
class ProfileEstimate:
    """The full model's peak from a layout's profiles: the stage whose line reaches highest."""

    peak_gib: float
    sd_gib: float
    stage: int
    per_stage: float  # the full model's layers per (virtual) stage the lines were read at


def profile_points(result_metrics: Mapping[str, Any], result_info: Mapping[str, Any]) -> dict[int, float]:
    """Peak GiB per pipeline stage of one profile run: the probe's ``peak_memory_gib_by_stage``
    where it reports one, else its single peak as stage 0."""
    by_stage = result_info.get("peak_memory_gib_by_stage") if result_info else None
    if isinstance(by_stage, (list, tuple)):  # the torch probe's: one per stage, in order
        by_stage = dict(enumerate(by_stage))
    out: dict[int, float] = {}
    if isinstance(by_stage, Mapping):
        for stage, gib in by_stage.items():
            try:
                value = float(gib)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value) and value > 0:
                out[int(stage)] = value
    if not out:
        peak = result_metrics.get("peak_memory_gib") if result_metrics else None
        if isinstance(peak, (int, float)) and math.isfinite(float(peak)) and float(peak) > 0:
            out[0] = float(peak)
    return out


def extrapolate_peak(
    peaks: Mapping[int, Mapping[float, float]], per_stage: float, noise_rel: float = 0.02
) -> ProfileEstimate:
    """The full model's peak from ``{stage: {layers per stage: peak GiB}}``: a line per stage
    (:func:`fit_stage_memory`), read at ``per_stage``; the stage with the highest mean decides
    (its sd with it). Stages with a single profile are left out."""
    best: ProfileEstimate | None = None
    for stage, points in peaks.items():
        if len(points) < 2:
            continue
        fit = fit_stage_memory(points)
        fit = StageMemoryFit(fit.static_gib, fit.per_layer_gib, fit.profiled, noise_rel=noise_rel)
        mean, sd = fit.predict(per_stage)
        if best is None or mean > best.peak_gib:
            best = ProfileEstimate(mean, sd, int(stage), float(per_stage))
    if best is None:
        raise ValueError(f"no stage has profiles at two layer counts: {dict(peaks)}")
    return best


def profile_cost_fpe(
    walls_s: Iterable[float], runs_layers: Iterable[int], per_stage: float, full_wall_s: float | None
) -> float:
    """What a trial's profile runs cost, in full-probe equivalents: their wall time over a full
    probe's (the study's median) once one has run; before that, estimated from the layers each
    ran (``STARTUP_SHARE`` + layers / the full model's, per run)."""
    walls = [float(w) for w in walls_s]
    if full_wall_s and full_wall_s > 0 and walls and all(w > 0 for w in walls):
        return sum(walls) / full_wall_s
    return sum(STARTUP_SHARE + k / max(per_stage, 1.0) for k in runs_layers)


def full_probe_cost_fpe(status: Any, wall_s: Any, full_wall_s: float | None, short: bool = False) -> float:
    """A full probe's cost in full-probe equivalents: 1, except a probe that ended clearly early
    (``ENDED_EARLY``): at the step that ran out of memory (the command runner stops one that does
    not exit, ``autotune.workers.command.OOM_EXIT_GRACE_S``), or stopped by the pruner as unable to
    win: its wall over the median full probe's, where that is below ``EARLY_END_SHARE``. One near a
    full probe's wall (a late step, a launcher that sat on it) costs a whole one: the few percent a
    wall's spread would give back would only start a full probe the budget cannot pay for. Before
    the first full probe's wall is known, 1. A re-measurement made short on purpose (``short``:
    fewer timed steps, :mod:`autotune.guide.short_remeasure`) costs its wall over that median,
    whatever the share, at most 1."""
    if not (full_wall_s and isinstance(wall_s, (int, float)) and wall_s > 0):
        return 1.0
    share = float(wall_s) / full_wall_s
    if short:
        return min(1.0, share)
    if status in ENDED_EARLY:
        return share if share < EARLY_END_SHARE else 1.0
    return 1.0


def trial_cost_fpe(
    profile: Mapping[str, Any] | None,
    full_probe: bool,
    full_wall_s: float | None,
    status: Any = None,
    wall_s: Any = None,
    short: bool = False,
) -> float:
    """A trial's cost in full-probe equivalents: its full probe (if it ran one: 1, or less where it
    ended early, :func:`full_probe_cost_fpe`; ``status`` and ``wall_s`` are the trial's) plus
    its memory profile's runs (``profile``: the trial's ``autotune.guide.memory_profile`` record)."""
    cost = full_probe_cost_fpe(status, wall_s, full_wall_s, short) if full_probe else 0.0
    if profile:
        cost += profile_cost_fpe(
            profile.get("walls_s") or [],
            profile.get("layers_per_stage") or [],
            float(profile.get("full_layers_per_stage") or 1.0),
            full_wall_s,
        )
    return cost


def ran_full_probe(attrs: Mapping[str, Any]) -> bool:
    """Whether a trial (its user attributes) ran its full probe: every trial but one its memory
    profile stopped (the profile predicted an OOM, or ran out of memory itself)."""
    profile = attrs.get(A.MEMORY_PROFILE) or {}
    return profile.get("verdict", "probe") not in ("oom_predicted", "oom")


def cost_of_trials(trials_attrs: Iterable[Mapping[str, Any]]) -> float:
    """Full-probe equivalents the given trials (their user attributes: the caller passes those
    that count against the budget) spent: each full probe 1, each memory profile its wall time
    over the median full probe's (estimated from its layers before any full probe ran); a full probe
    that ran out of memory or was pruned, or a short re-measurement, its wall over that median
    (:func:`full_probe_cost_fpe`)."""
    attrs = list(trials_attrs)
    median = median_full_wall(attrs)
    return sum(
        trial_cost_fpe(
            a.get(A.MEMORY_PROFILE),
            ran_full_probe(a),
            median,
            a.get(A.STATUS),
            a.get(A.WALL),
            bool(a.get(A.SHORT_STEPS)),
        )
        for a in attrs
    )


def median_full_wall(trials_attrs: Iterable[Mapping[str, Any]]) -> float | None:
    """The median wall time of the full probes that ran to the end (``ok``) among these trials
    (None before the first): what a memory profile's wall is measured against (an OOM or a
    pruned probe stopped early, and would make a profile look dearer than it is; a short
    re-measurement ran fewer steps on purpose)."""
    walls = [
        float(a[A.WALL])
        for a in trials_attrs
        if ran_full_probe(a)
        and a.get(A.STATUS) == "ok"
        and not a.get(A.SHORT_STEPS)
        and isinstance(a.get(A.WALL), (int, float))
        and float(a[A.WALL]) > 0
    ]
    return statistics.median(walls) if walls else None


PRIOR_WEIGHT = 0.5  # the fit's own sd counts as this many observed profile errors (calibrate_estimate)


def profile_residuals(trials_attrs: Iterable[Mapping[str, Any]]) -> list[float]:
    """How far each profiled config's full probe measured from what its profile predicted
    (``measured / predicted - 1``, both counted the same way): the study's evidence of how far
    its profiles extrapolate right on this machine and stack."""
    out = []
    for a in trials_attrs:
        profile = a.get(A.MEMORY_PROFILE) or {}
        predicted = profile.get("fit_peak_gib", profile.get("peak_gib"))  # the line's, before calibration
        measured = (a.get(A.METRICS) or {}).get("peak_memory_gib")
        if (
            a.get(A.STATUS) == "ok"
            and profile.get("verdict") == "probe"
            and isinstance(predicted, (int, float))
            and isinstance(measured, (int, float))
            and predicted > 0
            and math.isfinite(float(measured))
        ):
            out.append(float(measured) / float(predicted) - 1.0)
    return out


def calibrate_estimate(
    estimate: ProfileEstimate, residuals: Iterable[float], floor_rel: float = 0.0
) -> ProfileEstimate:
    """The profile's estimate corrected by the study's measured profile errors: the line's
    assumed extrapolation error (``StageMemoryFit``'s 3 % of the layer part) is a prior worth
    ``PRIOR_WEIGHT`` observations; each full probe of a profiled config is one more. The mean
    error (shrunk to zero by the prior) moves the peak; the spread around it is the new sd. On a
    device whose layers allocate alike it shrinks to the peak's repeatability after a few
    probes; on one whose memory is not linear in the layers (an allocator's rounding, a spike
    that scales with the shard) it stays as wide as the errors seen. Never below ``floor_rel`` of
    the peak: a profile's and a full probe's own measurement noise, which a few agreeing errors
    do not remove (on this CPU three full probes after profiles read +2.1 %, +2.2 %, -2.8 % off)."""
    errs = [float(e) for e in residuals if math.isfinite(float(e))]
    if not errs:
        return estimate
    prior = estimate.sd_gib / max(estimate.peak_gib, 1e-9)
    n = len(errs)
    bias = sum(errs) / (PRIOR_WEIGHT + n)
    var = (PRIOR_WEIGHT * prior**2 + sum((e - bias) ** 2 for e in errs)) / (PRIOR_WEIGHT + n)
    peak = estimate.peak_gib * (1.0 + bias)
    return ProfileEstimate(peak, peak * max(math.sqrt(var), floor_rel), estimate.stage, estimate.per_stage)
