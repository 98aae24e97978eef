"""A scaling study of a finished study's best configs (``autotune scale RUN_DIR``, issue 45).

Takes the configs a study found (its recommendation first, then its next best measured configs),
plans each at every size and mode (:mod:`.sizes`), probes what is not measured yet (:mod:`.measure`),
prices each point with the calibrated model and projects from the smallest size
(:mod:`autotune.guide.projection`),
and summarises (:mod:`.summary`). The files, the plot and MLflow are :mod:`autotune.finish.scaling_output`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from autotune.workers.parameters import value

from ..spec.schema import Spec
from .measure import ReadingLog, measure
from ..guide.projection import ModelPoint, host_load, point_of_result
from .sizes import ScalingInputError, Size, SizedConfig, config_at
from .summary import ScalingSummary, summarise

__all__ = ["ScalingPlan", "chosen_configs", "model_point", "plan_points", "run_scaling", "shared_host_cores"]

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
                    f"trial {trial}'s config (tp {value(config, 'tp')}, pp {value(config, 'pp')}, cp "
                    f"{value(config, 'cp')}) runs at fewer than two of the sizes in {mode} scaling ({why}); "
                    "give sizes that are multiples of its tp*pp*cp",
                )
            points.extend((trial, s) for s in sized)
    return points


def model_point(sized: SizedConfig, shared_host_cores: int | None = None) -> ModelPoint | None:
    """The analytical model's step for ``sized`` (on its spec's hardware profile: the measured one
    for a real study); None when the model cannot price it (a config it finds invalid). A config
    the model predicts out of memory is still priced: its time is what is projected.
    ``shared_host_cores``: CPU devices only, the cores of the one host every node of the cluster
    runs on (a local test cluster), whose compute the ranks then share (:func:`host_load`)."""
    from autotune.workers.simulate import simulate_trial

    from ..spec.resolve import request_settings

    if sized.spec is None or sized.config is None:
        return None
    result = simulate_trial(request_settings(sized.spec).request(sized.config, -1))
    w = sized.spec.workload
    point = point_of_result(result, float(w.global_batch_size * w.seq_len), sized.size.devices)
    if point is None or not shared_host_cores or sized.spec.cluster.accelerator != "cpu":
        return point
    load = host_load(
        sized.size.devices, sized.spec.cluster.threads_per_rank, sized.size.devices_per_node, shared_host_cores
    )
    return ModelPoint(point.compute_s * load, point.comm_s, point.tokens_per_step, point.devices)


def run_scaling(
    spec: Spec,
    run_dir: Path,
    plan: ScalingPlan,
    choice: Any,
    dispatcher: Any,
    progress: Callable[[str], None] = lambda _: None,
    shared_host_cores: int | None = None,
) -> ScalingSummary:
    """Measure what ``plan`` asks that the run directory does not hold yet, then summarise
    (``shared_host_cores``: the cores of the one host all the cluster's nodes run on, if they do:
    :func:`autotune.guide.projection.host_load`)."""
    profile_step = choice.kind == "torch"  # the backend that profiles a step for the communication share
    points = plan_points(spec, plan, profile_step)
    log = ReadingLog(run_dir / SCALING_DIR)
    runnable = [(t, s) for t, s in points if s.spec is not None]
    readings = measure(runnable, plan.repeats, choice, dispatcher, log, progress)
    models: dict[tuple[int, str, str], ModelPoint | None] = {
        (t, s.mode, s.size.label): model_point(s, shared_host_cores) for t, s in runnable
    }
    planned: Sequence[tuple[int, str, Size, str]] = [(t, s.mode, s.size, s.why_not) for t, s in points]
    return summarise(planned, readings, models)


def shared_host_cores(dispatcher: Any) -> int | None:
    """This host's cores when every node of the dispatcher's Ray cluster runs on it (a local test
    cluster, ``ray.cluster_utils.Cluster``), else None: on a real cluster each node is its own host
    and the calibration measured a node's devices as they share its cores."""
    from ..dispatch.ray_dispatch import RayDispatcher

    if not isinstance(dispatcher, RayDispatcher):
        return None
    try:
        import ray

        addresses = {n.get("NodeManagerAddress") for n in ray.nodes() if n.get("Alive")}
    except Exception:  # Ray gone: no sharing assumed, the projection says what it measured
        return None
    if len(addresses) != 1:
        return None
    from autotune.workers.torch_probe._device import available_cpus

    return available_cpus()
