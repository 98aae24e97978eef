"""Profile, then probe: the runner's memory-profile stage of a trial (issue #35).

A config the guide is not sure fits (its P(fits) below ``search.fit_confidence``) is not risked
blind: its own layout runs first with 1 and a few layers per pipeline stage
(:func:`autotune.guide.memory_profile.profile_request`, one warm-up and one measured step each), the
peaks give the full model's peak by a line per stage (:func:`~autotune.guide.memory_profile.extrapolate_peak`),
and the guide decides with that (:meth:`autotune.guide.sampler.GuidedSampler.fit_after_profile`):

- P(fits) at least ``search.fit_confidence``, or at least ``search.profile_go_probability`` where no
  third profile can run or one has: the full probe runs, its ``chosen_because`` says what the
  profile predicted;
- from ``REFINE_FROM`` up to ``search.fit_confidence``, on a stage long enough: undecided; a third
  profile at half the stage (:func:`~autotune.guide.memory_profile.refine_layers`) reads the line up
  to there, its band about 1.3 % of the full model's peak where two near profiles leave about 3 %,
  and the verdict is taken again against the go threshold;
- below: the trial ends as ``oom_predicted`` (no full probe; the guide learns the peak from the
  profile); a profile that itself ran out of memory ends it as ``oom`` (fewer layers than the
  full model already did not fit);
- a profile that failed otherwise (a crash, a timeout, a probe that printed no peak) is no
  verdict: the full probe runs, as it would have without profiles, and the trial says why.

Everything the stage measured is kept on the trial (``autotune.guide.memory_profile``): the layers per
stage run, the peaks per stage, the walls, the fitted peak and sd, P(fits), the verdict, so the
budget can count each trial's cost in full-probe equivalents
(:func:`~autotune.guide.memory_profile.cost_of_trials`) and a resumed study continues with the same fit.
The stage owns no loop: the runner submits what :meth:`MemoryProfiler.next_request` gives and
hands each result to :meth:`MemoryProfiler.take`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Any

from autotune.workers.protocol import PEAK_COUNTS_KEY, USABLE_KEY, ProbeResult, TrialRequest

from ..guide.memory_profile import (
    calibrate_estimate,
    profile_residuals,
    extrapolate_peak,
    layers_per_stage,
    plan_profile,
    profile_noise,
    refine_layers,
    profile_points,
    profile_request,
    why_no_profile,
)
from ..trial_attrs import A

__all__ = ["MemoryProfiler", "ProfileRun"]

BAND_SD = 3.0  # a profile's predicted band for the full probe's peak: mean ± this many sd
# a verdict from two profiles below the go threshold but at least this likely to fit is undecided: a
# third profile, far closer to the full model, reads the peak again (``refine_layers``); below it
# even a peak read to 0.7 % would hardly change the verdict
REFINE_FROM = 0.05


@dataclass
class ProfileRun:
    """One trial's memory profile in progress."""

    trial: Any  # the optuna trial
    config: dict[str, Any]
    request: TrialRequest  # the full probe's request
    why: str  # why the guide chose the config
    layers: tuple[int, ...]  # layers per (virtual) stage of each profile run
    done: int = 0  # runs finished
    peaks: dict[int, dict[float, float]] = field(default_factory=dict)  # stage -> layers -> GiB
    walls_s: list[float] = field(default_factory=list)
    counts: str = "device"
    usable_gib: float | None = None  # the least any run reported its allocator could use (USABLE_KEY)
    reserved: dict[float, float] = field(default_factory=dict)  # layers -> the allocator's reserved peak, GiB
    steps: dict[float, float] = field(default_factory=dict)  # layers -> the measured step time, s
    undecided_p_fit: float | None = None  # P(fits) from the first profiles, where a third was run

    def record(self, **extra: Any) -> dict[str, Any]:
        """What the trial keeps (``autotune.guide.memory_profile``)."""
        return {
            "layers_per_stage": list(self.layers[: self.done]),
            "full_layers_per_stage": layers_per_stage(self.request.model, self.config),
            "peaks_gib": {str(s): {f"{k:g}": round(v, 4) for k, v in p.items()} for s, p in self.peaks.items()},
            "walls_s": [round(w, 3) for w in self.walls_s],
            "counts": self.counts,
            **({"usable_reported_gib": round(self.usable_gib, 4)} if self.usable_gib else {}),
            **({"reserved_gib": {f"{k:g}": round(v, 4) for k, v in self.reserved.items()}} if self.reserved else {}),
            **({"undecided_p_fit": round(self.undecided_p_fit, 4)} if self.undecided_p_fit is not None else {}),
            **({"step_times_s": {f"{k:g}": round(v, 6) for k, v in self.steps.items()}} if self.steps else {}),
            **extra,
        }


class MemoryProfiler:
    """Decides which trials are profiled and what their profiles say (see the module docstring).

    ``guided``: the study's :class:`~autotune.guide.sampler.GuidedSampler` (None: no profiles);
    ``why_not`` says why profiles are off (the backend cannot shrink the model, the spec turned
    them off, no guide), said once to the user by the runner."""

    def __init__(self, spec: Any, guided: Any) -> None:
        self.spec = spec
        self.guided = guided
        sp = spec.search
        self.fit_confidence = float(sp.fit_confidence)
        self.go = float(sp.profile_go_probability)
        self.noise_rel = profile_noise(spec.cluster.accelerator)
        # the least a calibrated band may be: this profile's noise and the full probe's, together
        self.floor_rel = math.sqrt(2.0) * self.noise_rel
        if guided is None:
            self.why_not: str | None = "memory profiles need the guided search (sampler auto on real probes)"
        elif not sp.memory_profiles:
            self.why_not = "search.memory_profiles is off"
        else:
            backend = spec.backend
            self.why_not = why_no_profile(
                backend.kind, getattr(backend, "argv", None) or getattr(backend, "args", None)
            )
        if guided is not None:
            guided.guide.settings = replace(guided.guide.settings, memory_profiles=self.why_not is None)

    @property
    def available(self) -> bool:
        return self.why_not is None

    def plan(self, trial: Any, config: dict[str, Any], request: TrialRequest, why: str) -> ProfileRun | None:
        """A profile for this trial, or None when it goes straight to its full probe: profiles
        are off, the guide is sure enough it fits, it is a deliberate re-measurement or the full
        probe of a config a profile turned away (the guide's last gamble), or its stages hold too
        few layers for a profile to save anything."""
        if not self.available or A.REMEASURE_OF in trial.user_attrs or A.GAMBLE_ON in trial.user_attrs:
            return None
        p_fit = (trial.user_attrs.get(A.PREDICTED) or {}).get("guided_p_fit")
        if not isinstance(p_fit, (int, float)) or p_fit >= self.fit_confidence:
            return None
        layers = plan_profile(request.model, config)
        if layers is None:
            return None
        return ProfileRun(trial, config, request, why, layers)

    def next_request(self, run: ProfileRun) -> TrialRequest:
        return profile_request(run.request, run.layers[run.done])

    def take(self, study: Any, run: ProfileRun, result: ProbeResult) -> tuple[str, ProbeResult | None]:
        """One profile run's result: ``("again", None)`` (the next layer count), ``("probe",
        None)`` (run the full probe; the trial's attributes say why), or ``("stop", result)``:
        the trial's own result, without a full probe."""
        k = run.layers[run.done]
        run.done += 1
        run.walls_s.append(float(result.wall_s or 0.0))
        counts = (result.info or {}).get(PEAK_COUNTS_KEY)
        if counts:
            run.counts = str(counts)
        usable = (result.info or {}).get(USABLE_KEY)
        if result.ok and isinstance(usable, (int, float)) and usable > 0:
            run.usable_gib = float(usable) if run.usable_gib is None else min(run.usable_gib, float(usable))
        if result.status == "oom":
            reason = (
                f"memory profile: out of memory already with {k} layer(s) per stage, so the full model "
                f"({layers_per_stage(run.request.model, run.config):g} per stage) cannot fit: {result.reason[-300:]}"
            )
            return "stop", self._end(run, "oom", reason, result, verdict="oom")
        points = profile_points(result.metrics, result.info) if result.ok else {}
        if not points:
            why = result.reason or "it reported no peak memory"
            return self._no_verdict(run, f"at {k} layer(s) per stage gave no peak ({result.status}: {why[:200]})", why)
        for stage, gib in points.items():
            run.peaks.setdefault(stage, {})[float(k)] = gib
        step = (result.metrics or {}).get("step_time_s")
        if isinstance(step, (int, float)) and math.isfinite(step) and step > 0:
            run.steps[float(k)] = float(step)
        reserved = (result.metrics or {}).get("peak_reserved_gib")
        if isinstance(reserved, (int, float)) and math.isfinite(reserved) and reserved > 0:
            run.reserved[float(k)] = float(reserved)
        if run.done < len(run.layers):
            return "again", None
        per_stage = layers_per_stage(run.request.model, run.config)
        try:
            raw = extrapolate_peak(run.peaks, per_stage, self.noise_rel)
        except ValueError as exc:  # the runs reported different stages: no line to read, no verdict
            return self._no_verdict(run, f"gave no line to read ({exc})", str(exc))
        residuals = profile_residuals(t.user_attrs for t in study.get_trials(deepcopy=False))
        estimate = calibrate_estimate(raw, residuals, self.floor_rel)
        p_fit, device, usable = self.guided.fit_after_profile(
            study, run.trial.number, estimate.peak_gib, estimate.sd_gib, run.counts, run.usable_gib
        )
        layers = ", ".join(str(x) for x in run.layers)
        words = (
            f"memory profile ({layers} layers per stage): peak {device:.3g} ± {estimate.sd_gib:.2g} GiB at "
            f"{per_stage:g} per stage (stage {estimate.stage})"
        )
        direct = self._allocator_check(run, per_stage, residuals)
        if direct is None:
            words += f", usable {usable:.3g} GiB, P(fits) {p_fit:.2f}"
        else:
            # the profile measured both sides itself: what its allocator reserved and what it could
            # have used; no model of the runtime's or the communicators' share comes into it
            p_fit, reserved_gib, reserved_sd = direct
            usable = float(run.usable_gib)
            words += (
                f"; its allocator's reserved peak {reserved_gib:.3g} ± {reserved_sd:.2g} GiB against the "
                f"{usable:.3g} GiB it could use, P(fits) {p_fit:.2f}"
            )
        record = run.record(
            peak_gib=round(estimate.peak_gib, 4),
            sd_gib=round(estimate.sd_gib, 4),
            device_peak_gib=round(device, 4),
            usable_gib=round(usable, 4),
            stage=estimate.stage,
            p_fit=round(p_fit, 4),
            # the band the full probe's measured peak (counted as ``counts``) is predicted to fall in:
            # 3 sd, so a calibrated guide misses it about 3 times in 1,000 (BAND_SD)
            band_gib=[
                round(estimate.peak_gib - BAND_SD * estimate.sd_gib, 4),
                round(estimate.peak_gib + BAND_SD * estimate.sd_gib, 4),
            ],
            fit_peak_gib=round(raw.peak_gib, 4),
            fit_sd_gib=round(raw.sd_gib, 4),
            calibrated_by=len(residuals),
        )
        go = self.go
        if self.guided.oom_allowance_spent(study):  # the OOMs it may risk are spent: only sure fits now
            go = max(go, self.fit_confidence)
        # undecided up to fit_confidence, not only below go: two near profiles read a long stage's peak to
        # about 3 %, and where each launch reads its own noise a config they put at 0.4-0.9 fitted 70-80 %
        # of the time (benchmarks/README.md, 2026-12-05); the third profile decides it for about 0.3 of a probe
        sure = max(go, self.fit_confidence)
        undecided = run.undecided_p_fit is None and REFINE_FROM <= p_fit < sure
        third = refine_layers(run.request.model, run.config, run.layers) if undecided else None
        if third is not None:
            # undecided: a far profile narrows the band from about 3 % to 1.3 % (StageMemoryFit)
            run.undecided_p_fit = p_fit
            run.layers = (*run.layers, third)
            self._note(run, f"{words}, undecided below {sure:g}: a third profile at {third} layers per stage")
            return "again", None
        if run.undecided_p_fit is not None:
            words += f" (P(fits) {run.undecided_p_fit:.2f} from the first {run.done - 1} profiles)"
        if p_fit >= go:
            run.trial.set_user_attr(A.MEMORY_PROFILE, {**record, "verdict": "probe"})
            self._note(run, f"{words}: probed in full")
            return "probe", None
        why = "search.profile_go_probability" if go == self.go else "search.fit_confidence (OOM allowance spent)"
        reason = f"{words}, below {why} {go:g}: not run in full"
        return "stop", self._end(run, "oom_predicted", reason, result, record=record)

    def _allocator_check(
        self, run: ProfileRun, per_stage: float, residuals: list[float]
    ) -> tuple[float, float, float] | None:
        """(P(fits), reserved peak, sd) from the profile alone, where its probe reported both the
        allocator's reserved peak and what the allocator could use (a device's torch probe: its
        ``max_memory_reserved`` and ``mem_get_info``): the full model's reserved peak by the line
        through the profiles, corrected by the study's measured profile errors, against the least
        usable memory a profile run saw. None where the probe reports either not."""
        if not run.usable_gib or len(run.reserved) < 2:
            return None
        line = calibrate_estimate(
            extrapolate_peak({0: run.reserved}, per_stage, self.noise_rel), residuals, self.floor_rel
        )
        sd = math.hypot(line.sd_gib, 0.002 * run.usable_gib)
        return NormalDist().cdf((run.usable_gib - line.peak_gib) / max(sd, 1e-9)), line.peak_gib, line.sd_gib

    # ---- helpers -----------------------------------------------------------------------------------
    def _note(self, run: ProfileRun, words: str) -> None:
        run.trial.set_user_attr(A.CHOSEN, f"{run.why}; {words}")

    def _no_verdict(self, run: ProfileRun, words: str, failure: str) -> tuple[str, None]:
        """A profile that decides nothing: the full probe runs, as without profiles, and says why."""
        self._note(run, f"memory profile {words}; probed in full")
        run.trial.set_user_attr(A.MEMORY_PROFILE, run.record(verdict="failed", failure=failure[:500]))
        return "probe", None

    def _end(
        self,
        run: ProfileRun,
        status: str,
        reason: str,
        last: ProbeResult,
        verdict: str | None = None,
        record: dict[str, Any] | None = None,
    ) -> ProbeResult:
        """The trial's result when its profile ends it (its walls summed, the profile's info kept)."""
        run.trial.set_user_attr(A.MEMORY_PROFILE, {**(record or run.record()), "verdict": verdict or status})
        return ProbeResult(
            status, reason=reason, info=dict(last.info or {}), wall_s=sum(run.walls_s), log_tail=last.log_tail
        )
