"""The checks of a spec across its sections, which field types cannot express: the hardware
profile against the accelerator, objectives against the workload, searched names against the
workload, parallel sizes against the world, constraint expressions against the names they use, the
baseline against the space and the target's rules, a sequence against the model's positions.
Above the space (the baseline is resolved by it), so the spec's schema never imports the space.
"""

from __future__ import annotations

from typing import Any

from .models import MODEL_ALIASES
from .safe_expr import ExpressionError, compile_expression
from .schema import (
    CANONICAL_PARAMS,
    DERIVED_PARAMS,
    SERVE_PARAMS,
    Spec,
    env_value,
    env_value_problem,
    setting_value_problem,
    short_value,
)
from .errors import SpecProblem

__all__ = ["semantic_problems"]


def _sample_env(choices: dict[str, list[Any]], names: frozenset[str]) -> dict[str, Any]:
    """One value of the right type for each name a constraint reads (the first searched value,
    else the default, else 1): evaluating on it finds type errors at validation, not in ``plan``."""
    from .space import INFER_DEFAULTS, TRAIN_DEFAULTS

    defaults = {**INFER_DEFAULTS, **TRAIN_DEFAULTS}
    return {n: choices[n][0] if choices.get(n) else defaults.get(n, 1) for n in names}


def semantic_problems(spec: Spec) -> list[SpecProblem]:
    """Checks across sections that field types cannot express."""
    from autotune.objectives import METRICS, batch_point
    from autotune.workers.hardware import available_profiles, is_profile_file, load_profile

    problems: list[SpecProblem] = []
    cluster = spec.cluster
    if not is_profile_file(cluster.profile_name) and cluster.profile_name not in available_profiles():
        problems.append(
            SpecProblem(
                ("cluster", "profile"),
                f"unknown hardware profile {cluster.profile_name!r}; available: {', '.join(available_profiles())}",
            )
        )
    else:
        try:
            profile = load_profile(cluster.profile_name, cluster.overrides)
            if profile.get("accelerator") != cluster.accelerator:
                problems.append(
                    SpecProblem(
                        ("cluster", "profile"),
                        f"profile {cluster.profile_name!r} is for "
                        f"{profile.get('accelerator')}, but cluster.accelerator is {cluster.accelerator}",
                    )
                )
        except ValueError as exc:
            problems.append(SpecProblem(("cluster", "overrides"), str(exc)))

    kind = spec.workload.kind
    for i, obj in enumerate(spec.objectives):
        point = batch_point(obj.metric)
        metric = METRICS.get(point[0] if point else obj.metric)
        sizes = getattr(spec.workload, "batch_sizes", None) or []
        if point is not None and metric is not None and point[1] not in sizes:
            problems.append(
                SpecProblem(
                    ("objectives", i, "metric"),
                    f"{obj.metric} is measured at batch size {point[1]}, which is not one of the workload's "
                    f"batch_sizes {sizes}: add it there or name another",
                )
            )
        if metric is None:
            problems.append(
                SpecProblem(
                    ("objectives", i, "metric"), f"unknown metric {obj.metric!r}; known: {', '.join(sorted(METRICS))}"
                )
            )
        elif metric.workload != kind:
            problems.append(
                SpecProblem(
                    ("objectives", i, "metric"),
                    f"{obj.metric} is a {metric.workload} metric but the workload is {kind}",
                )
            )

    choices = spec.space.choices()
    train_only = {
        "tp": False,
        "pp": True,
        "cp": True,
        "vpp": True,
        "first_stage_layers": True,
        "micro_batch_size": True,
        "sequence_parallel": True,
        "recompute": True,
        "recompute_layers": True,
        "zero_stage": True,
    }
    infer_only = {"batch_size", "kv_cache_dtype", "quantization"}
    serve_only = set(SERVE_PARAMS) | {n for n in choices if n.startswith("engine.")}
    serve_allows = {"tp", "pp", "precision", "kv_cache_dtype", "quantization", *serve_only}
    for name in choices:
        if kind == "infer" and name == "batch_size":
            problems.append(
                SpecProblem(
                    ("space", name),
                    "batch_size is not a knob of an inference study: every config is measured at each of the "
                    "workload's batch sizes (workload.batch_sizes); remove space.batch_size and list the batch sizes "
                    "there",
                )
            )
        if kind == "infer" and train_only.get(name):
            problems.append(SpecProblem(("space", name), f"{name} is a training parameter; the workload is infer"))
        if kind == "train" and name in infer_only:
            problems.append(SpecProblem(("space", name), f"{name} is an inference parameter; the workload is train"))
        if kind != "serve" and name in serve_only:
            problems.append(
                SpecProblem(("space", *name.split(".", 1)), f"{name} is a serving parameter; the workload is {kind}")
            )
        if kind == "serve" and not name.startswith("env.") and name not in serve_allows:
            problems.append(
                SpecProblem(
                    ("space", name),
                    f"{name} is not a serving parameter; a serve workload searches "
                    f"{', '.join(sorted(serve_allows - serve_only | set(SERVE_PARAMS)))}, env.VAR and engine.NAME",
                )
            )
    problems += _serving_stack_problems(spec)
    if cluster.probe_slice and kind != "train":
        problems.append(
            SpecProblem(
                ("cluster", "probe_nodes"),
                f"a probe slice projects training steps to the target size; the workload is {kind} "
                "(remove probe_nodes)",
            )
        )
    world = cluster.world_size  # a serving instance may span whole nodes (INSTANCE_NODES_RULE)
    for name in ("tp", "pp", "cp"):
        values = choices.get(name, [])
        if values and not any(world % v == 0 for v in values):
            problems.append(
                SpecProblem(
                    ("space", name),
                    f"no value of {values} divides the world size {world} "
                    f"({cluster.nodes} nodes x {cluster.devices_per_node} devices)",
                )
            )

    constants = {"seq_len", "global_batch_size", "prompt_len", "gen_len", "nodes", "devices_per_node"}
    constants |= {"output_len", "max_model_len"}
    names = set(CANONICAL_PARAMS) | set(DERIVED_PARAMS) | set(MODEL_ALIASES) | set(choices) | constants
    from .space import outcome_names

    outcome = outcome_names(spec.workload.kind)
    for i, source in enumerate(spec.constraints):
        try:
            expression = compile_expression(source, names | outcome)
            config_names = expression.names - outcome - constants
            if expression.names & outcome and config_names:
                raise ExpressionError(
                    f"{source!r} names metrics ({', '.join(sorted(expression.names & outcome))}) and config "
                    f"parameters ({', '.join(sorted(config_names))}): a constraint judges either the config before "
                    "its probe or the result after it; split it in two"
                )
            sample = {n: 1.0 for n in expression.names & outcome}
            expression.evaluate({**_sample_env(choices, expression.names - outcome), **sample})  # types
        except ExpressionError as exc:
            problems.append(SpecProblem(("constraints", i), str(exc)))

    for var, values in spec.space.env.items():  # the values the simulator reads: found here, not in plan
        for i, value in enumerate(values):
            problem = env_value_problem(var, value)
            if problem:
                problems.append(SpecProblem(("space", "env", var, i), problem))

    if spec.baseline is not None:
        unknown = [key for key in spec.baseline if key not in CANONICAL_PARAMS and not key.startswith("env.")]
        for key in unknown:
            problems.append(
                SpecProblem(
                    ("baseline", key),
                    f"unknown parameter {short_value(key)}; use canonical names "
                    f"({', '.join(CANONICAL_PARAMS)}) or env.VAR",
                )
            )
        for key, value in spec.baseline.items():
            if not key.startswith("env."):
                continue
            if isinstance(value, (dict, list)) or value is None:
                problem = f"an environment variable's value is a string, number or boolean (got {short_value(value)})"
            else:
                problem = setting_value_problem(value) or env_value_problem(key[4:], env_value(value))
            if problem:
                unknown.append(key)
                problems.append(SpecProblem(("baseline", key), problem))
        for key, value in spec.baseline.items():  # the baseline is a trial of the study: its values are searched ones
            values = choices.get(key)
            if values is None:
                continue
            shown = env_value(value) if key.startswith("env.") else value
            if not any(shown == v and type(shown) is type(v) for v in values):
                listed = values if len(values) <= 12 else [*values[:5], "...", *values[-5:]]
                problems.append(
                    SpecProblem(
                        ("baseline", key),
                        f"{value!r} is not a value of space.{key} {listed}; "
                        "add it to the space (the baseline is measured as a trial of the study)",
                    )
                )
        if not unknown and not problems:  # the baseline is probed first: it must be a config the rules allow
            from .space import Space

            try:
                violations = Space(spec).resolve(dict(spec.baseline)).violations
            except (TypeError, ValueError) as exc:
                violations = [f"cannot be resolved ({exc})"]
            for reason in violations:
                problems.append(SpecProblem(("baseline",), f"the baseline breaks a rule: {reason}"))
    if spec.backend.kind == "mindspore" and spec.cluster.accelerator == "cuda":
        problems.append(SpecProblem(("backend", "kind"), "the mindspore backend runs on npu or cpu, not cuda"))
    seq_len, positions = getattr(spec.workload, "seq_len", None), spec.model.max_position_embeddings
    from ..stacks import target_of

    if kind == "train" and seq_len and seq_len > positions and target_of(spec) in ("megatron", "mindspeed"):
        problems.append(
            SpecProblem(
                ("workload", "seq_len"),
                (
                    f"{seq_len} is above the model's max_position_embeddings {positions}: Megatron's "
                    f"validate_args refuses --seq-length {seq_len} with --max-position-embeddings {positions} "
                    f"(target {target_of(spec)}); train at most {positions}, or give the model "
                    f"`max_position_embeddings: {seq_len}` (a model mapping, for a context extension)"
                ),
            )
        )
    return problems


def _serving_stack_problems(spec: Spec) -> list[SpecProblem]:
    """A target or a stack preset of the other workload (a serving engine for a training study, a
    training stack for a serving one), and ``backend.args`` of the vLLM preset that would override
    what the trial decides (vLLM keeps an option's last value)."""
    from ..stacks import STACKS, targets_of

    kind = spec.workload.kind
    problems = []
    if spec.target not in (None, "none") and spec.target not in targets_of(kind):
        problems.append(
            SpecProblem(
                ("target",),
                f"target {spec.target} runs a {'/'.join(STACKS[spec.target].workloads)} workload, not {kind}; "
                f"for {kind}: {', '.join(targets_of(kind)) or 'none'}",
            )
        )
    stack = STACKS.get(spec.backend.kind)
    if stack is not None and kind not in stack.workloads:
        problems.append(
            SpecProblem(
                ("backend", "kind"),
                f"backend {spec.backend.kind} runs a {'/'.join(stack.workloads)} workload, not {kind}",
            )
        )
    choices = spec.space.choices()
    prefill = choices.get("prefill_replicas", [])
    if spec.backend.kind == "mindie" and any(int(v) > 0 for v in prefill):
        problems.append(
            SpecProblem(
                ("space", "prefill_replicas"),
                "the mindie probe starts mindieservice_daemon replicas, not MindIE-Motor's controller and "
                "coordinator that run MindIE's PD separation: list only 0 here, or rank PD layouts with backend "
                "simulate (target: mindie) or measure them through backend command",
            )
        )
    wide = [int(v) for v in choices.get("tp", []) if int(v) > spec.cluster.devices_per_node]
    if spec.backend.kind == "mindie" and wide:
        problems.append(
            SpecProblem(
                ("space", "tp"),
                f"the mindie probe starts its daemons on one node, and tp {wide} is wider than a node "
                f"({spec.cluster.devices_per_node} NPUs): MindIE's multi-node inference needs the rank table of the "
                "instance's nodes, which the probe does not write: list tp up to the node's NPUs, or rank wider "
                "instances with backend simulate (target: mindie) or measure them through backend command",
            )
        )
    if spec.backend.kind == "vllm" and spec.backend.args:
        from ..stacks.vllm import user_arg_conflicts

        clash = user_arg_conflicts([str(a) for a in spec.backend.args], accelerator=spec.cluster.accelerator)
        if clash:
            problems.append(
                SpecProblem(
                    ("backend", "args"),
                    f"{', '.join(clash)}: set by the trial (search it in space:, e.g. graph_mode: [eager] for "
                    "--enforce-eager); a value here would override what is measured",
                )
            )
    return problems
