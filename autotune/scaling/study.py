"""A scaling study of a finished study's best configs (``autotune scale RUN_DIR``, issue 45).

Takes the configs a study found (its recommendation first, then its next best measured configs),
plans each at every size and mode (:mod:`.sizes`), probes what is not measured yet (:mod:`.measure`),
prices each point with the calibrated model and projects from the smallest size (:mod:`.projection`),
and summarises (:mod:`.summary`). The files, the plot and MLflow are :mod:`autotune.finish.scaling_output`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..spec.schema import Spec
from .measure import ReadingLog, measure
from .projection import ModelPoint, model_point
from .sizes import ScalingInputError, Size, SizedConfig, config_at
from .summary import ScalingSummary, summarise

__all__ = ["ScalingPlan", "chosen_configs", "plan_points", "run_scaling"]

SCALING_DIR = "scaling"


@dataclass
class ScalingPlan:
    """What a scaling study measures: ``configs`` as (trial number, config), at ``sizes`` in ``modes``."""

    configs: list[tuple[int, dict[str, Any]]]
    sizes: list[Size]
    modes: list[str]
    repeats: int


def chosen_configs(spec: Spec, study: Any, top: int) -> list[tuple[int, dict[str, Any]]]:
    """The study's recommended config, then its next best successful ones by the first objective,
    ``top`` in all. A study with no successful trial is bad input for a scaling study."""
    from ..spec.resolve import objectives_of
    from ..study.result import StudyResult

    if not spec.is_training:
        raise ScalingInputError(
            "workload.kind", f"a scaling study measures training configs, not {spec.workload.kind!r}"
        )
    objectives = objectives_of(spec)
    result = StudyResult.load(spec, study, objectives)
    ok = [r for r in result.records if r.status == "ok" and r.metrics]
    if not ok:
        raise ScalingInputError(
            "run directory", "the study has no successful trial to scale; run `autotune run` until one succeeds"
        )
    metric, direction = objectives[0]
    sign = -1.0 if direction == "maximize" else 1.0
    ranked = sorted(
        (r for r in ok if isinstance(r.metrics.get(metric), (int, float))),
        key=lambda r: sign * float(r.metrics[metric]),
    )
    first = result.chosen
    out: list[tuple[int, dict[str, Any]]] = []
    seen: set[str] = set()
    for record in ([first] if first is not None else []) + ranked:
        key = repr(sorted(record.config.items(), key=lambda kv: kv[0]))
        if key in seen or record.status != "ok":
            continue
        seen.add(key)
        out.append((record.number, dict(record.config)))
        if len(out) >= top:
            break
    return out


def plan_points(spec: Spec, plan: ScalingPlan, profile_step: bool) -> list[tuple[int, SizedConfig]]:
    """Every (trial, config at a size in a mode) of ``plan``; a config that runs at fewer than two
    of the sizes is refused (no curve)."""
    points: list[tuple[int, SizedConfig]] = []
    for trial, config in plan.configs:
        for mode in plan.modes:
            sized = [config_at(spec, config, size, mode, profile_step) for size in plan.sizes]
            if sum(1 for s in sized if s.spec is not None) < 2:
                why = "; ".join(f"{s.size.label}: {s.why_not}" for s in sized if s.why_not)
                raise ScalingInputError(
                    "--nodes/--devices",
                    f"trial {trial}'s config (tp {config.get('tp', 1)}, pp {config.get('pp', 1)}, cp "
                    f"{config.get('cp', 1)}) runs at fewer than two of the sizes in {mode} scaling ({why}); "
                    "give sizes that are multiples of its tp*pp*cp",
                )
            points.extend((trial, s) for s in sized)
    return points


def run_scaling(
    spec: Spec,
    run_dir: Path,
    plan: ScalingPlan,
    choice: Any,
    dispatcher: Any,
    progress: Callable[[str], None] = lambda _: None,
) -> ScalingSummary:
    """Measure what ``plan`` asks that the run directory does not hold yet, then summarise."""
    profile_step = choice.kind == "torch"  # the backend that profiles a step for the communication share
    points = plan_points(spec, plan, profile_step)
    log = ReadingLog(run_dir / SCALING_DIR)
    runnable = [(t, s) for t, s in points if s.spec is not None]
    readings = measure(runnable, plan.repeats, choice, dispatcher, log, progress)
    models: dict[tuple[int, str, str], ModelPoint | None] = {
        (t, s.mode, s.size.label): model_point(s) for t, s in runnable
    }
    planned: Sequence[tuple[int, str, Size, str]] = [(t, s.mode, s.size, s.why_not) for t, s in points]
    return summarise(planned, readings, models)
