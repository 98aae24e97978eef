"""The tuning spec's schema: one YAML file that says what to tune, where, for what, and with what budget.

Like torchtitan's ``config/job_config.py``, this is the schema only: one pydantic section per part
of the spec, every field with its description, ``extra="forbid"`` so a misspelt key is an error,
never silently ignored, and the field-level rules. It holds :class:`Spec` and the sections of its
own (cluster, backend, objectives, baseline); the larger sections are modules of their own, each
re-exported here so ``from autotune.spec.schema import X`` reads every section:

- :mod:`autotune.spec.fields`: the rules every section uses (environment variable names and values,
  paths, engine and env setting values) and the sections' base;
- :mod:`autotune.spec.workload_section`: train, infer and serve workloads, the traffic and the SLO;
- :mod:`autotune.spec.space_section`: the space;
- :mod:`autotune.spec.search_section`: search budget and strategy, recommendation, tracking, Ray.

What is not the schema lives elsewhere: reading the spec file (encodings, YAML locations,
duplicate keys) is :mod:`autotune.spec.load`; reading the files a spec names (a config.json, a
lengths file, a hardware profile file) is :mod:`autotune.spec.files`, run by the loader, which
hands what it read to the validation; rendering errors with the file, line and field is
:mod:`autotune.spec.errors`; the checks across sections (objectives against the workload, the
baseline against the space, the hardware profile, the target) are :mod:`autotune.spec.checks`.

The schema imports no stack, simulator, hardware-profile or objectives module
(tests/test_import_graph.py): the names ``target:`` and ``backend.kind`` accept come from the leaf
:mod:`autotune.spec.stack_names`; an allocator config is parsed by :mod:`autotune.workers.alloc_conf`,
which the simulator reads too. What needs a catalogue above the schema is resolved there: the
target a spec without ``target:`` is tuned for by the stack registry
(:func:`autotune.stacks.target_of`). The objectives with their default directions are resolved once, above
the schema (:func:`autotune.spec.resolve.objectives_of`), and so is the one-line summary of a spec
(:func:`autotune.cli.output.spec_summary`).

``spec`` starts no cluster and logs nothing (docs/ARCHITECTURE.md, data flow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field, field_validator, model_validator

from .models import PRESETS, ModelSpec
from .fields import (
    ENV_NAME_RULE,
    MAX_SPEC_BYTES,
    MAX_SPEC_INT,
    EnvName,
    Strict,
    _env_values_of_backend,
    env_name_problem,
    env_value_problem,
    path_problem,
    read_by_the_loader,
    setting_value_problem,
    short_value,
)
from .search_section import RaySpec, RecommendSpec, SearchSpec, TrackingSpec
from .space_section import CANONICAL_PARAMS, DERIVED_PARAMS, SERVE_PARAMS, IntRange, SpaceSpec, env_value
from .workload_section import InferWorkload, LengthRange, ServeWorkload, SLOSpec, TrafficSpec, TrainWorkload, Workload
from .stack_names import PRESET_ENTRIES, STACK_NAMES, preset_names

__all__ = [
    "Spec",
    "TrainWorkload",
    "InferWorkload",
    "ServeWorkload",
    "TrafficSpec",
    "SLOSpec",
    "LengthRange",
    "ClusterSpec",
    "BackendSpec",
    "BACKEND_KINDS",
    "SpaceSpec",
    "IntRange",
    "ObjectiveSpec",
    "SearchSpec",
    "RecommendSpec",
    "TrackingSpec",
    "RaySpec",
    "CANONICAL_PARAMS",
    "SERVE_PARAMS",
    "DERIVED_PARAMS",
    "ENV_NAME_RULE",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_INT",
    "env_name_problem",
    "env_value",
    "env_value_problem",
    "path_problem",
    "setting_value_problem",
    "short_value",
]


# ---------------------------------------------------------------------------------------- cluster
class ClusterSpec(Strict):
    """Where trials run. ``profile`` names a hardware profile (workers/hardware/*.yaml);
    ``overrides`` replaces fields of it, e.g. ``device_memory_gib: 32`` for 32 GB 910B parts."""

    accelerator: Literal["npu", "cuda", "cpu"] = "npu"
    profile: str | None = Field(
        None,
        description="hardware profile: a bundled name, or the path of a profile file "
        "(relative to the spec), e.g. from `autotune calibrate`; "
        "default per accelerator",
    )
    nodes: int = Field(1, gt=0)
    devices_per_node: int = Field(8, gt=0)
    probe_nodes: int | None = Field(
        None,
        gt=0,
        description="tune on a slice: probes run on this many nodes (the same tp, pp, cp and micro-batch, "
        "a smaller dp, grad-accum kept so each rank does the target's work) and every measurement is "
        "projected to the cluster's `nodes` by the calibrated model; training only. Default: probe at full size",
    )
    confirm_top: int = Field(
        0,
        ge=0,
        description="with probe_nodes: once the budget is spent, measure this many of the best configs "
        "(by their projection) again at the full `nodes`; the recommendation is then the best of those "
        "full-size measurements, not a projection. Each costs a probe at full size. Default 0: none",
    )
    overrides: dict[str, Any] = Field(default_factory=dict)
    threads_per_rank: int | None = Field(
        None, gt=0, description="CPU threads per probe process (default: cores / ranks)"
    )
    calibrate: Literal["auto", "never"] | None = Field(
        None,
        description="auto: a study with a real backend on a data-sheet profile first measures this host "
        "(`autotune calibrate --quick`, cached per host and software) and ranks with that; never: "
        "use the profile as it is. Default: the AUTOTUNE_CALIBRATE environment variable, else auto",
    )

    cost_per_device_hour: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="what one device costs an hour (any currency): serving reports cost per million tokens",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def probe_slice(self) -> int | None:
        """The nodes a probe runs on when smaller than the target (``probe_nodes``), else None."""
        return self.probe_nodes if self.probe_nodes is not None and self.probe_nodes < self.nodes else None

    # field validators, not a model validator: the error then names the field and its line
    # (`cluster.probe_nodes`), not the section; `nodes` and `probe_nodes` are validated before them
    @field_validator("probe_nodes")
    @classmethod
    def _probe_slice_within_the_target(cls, v: int | None, info: Any) -> int | None:
        nodes = info.data.get("nodes")
        if v is not None and nodes is not None and v > nodes:
            raise ValueError(
                f"more than the target's nodes ({nodes}): a probe slice "
                "is a part of the cluster the study tunes for; give probe_nodes <= nodes"
            )
        return v

    @field_validator("confirm_top")
    @classmethod
    def _confirmation_needs_a_slice(cls, v: int, info: Any) -> int:
        if "probe_nodes" not in info.data or "nodes" not in info.data:  # refused already, and said
            return v
        probe, nodes = info.data["probe_nodes"], info.data["nodes"]
        if v and (probe is None or probe >= nodes):
            raise ValueError(
                "a confirmation measures the best configs of a slice study again at full size, and this "
                "cluster has no probe slice: give probe_nodes < nodes, or drop confirm_top"
            )
        return v

    @field_validator("profile")
    @classmethod
    def _profile_file_relative_to_spec(cls, v: str | None, info: Any) -> str | None:
        """A profile file's resolved path, as the loader found it (autotune.spec.files); a bundled name as it is."""
        return v if v is None else read_by_the_loader(info, "profile", v) or v

    @property
    def profile_name(self) -> str:
        return self.profile or {"npu": "ascend-910b", "cuda": "a100-sxm-80gb", "cpu": "cpu"}[self.accelerator]


# ---------------------------------------------------------------------------------------- backend
STACK_PRESETS: tuple[str, ...] = preset_names()  # the stacks autotune runs as the probe (autotune.spec.stack_names)
BackendKind = Literal[("auto", "simulate", "command", "torch", "mindspore", *STACK_PRESETS)]  # type: ignore[valid-type]
BACKEND_KINDS: tuple[str, ...] = get_args(BackendKind)  # what `backend.kind` and `run --backend` accept
TargetName = Literal[(*STACK_NAMES, "none")]  # type: ignore[valid-type]  # the registered stacks, or none


class BackendSpec(Strict):
    """How a trial is measured. ``command`` runs ``argv`` (``{trial_file}`` is replaced by the
    trial file path, ``{num_layers}`` by the layers of the model the trial runs: fewer than the
    model's in a memory profile, see autotune.guide.memory_profile; ``{measured_steps}`` by the timed
    steps it runs: fewer in a re-measurement, see autotune.guide.short_remeasure) and reads the probe
    protocol's JSON lines, or ``metric_patterns`` regexes."""

    kind: BackendKind = "auto"
    argv: list[str] | None = None
    timeout_s: float | None = Field(None, gt=0, description="overrides workload.timeout_s")
    oom_exit_grace_s: float | None = Field(
        30.0,  # autotune.workers.command.OOM_EXIT_GRACE_S (a test holds them equal)
        ge=0,
        description="a probe that prints a device allocator's out-of-memory error (torch, torch_npu, MindSpore) "
        "and neither exits nor reports a step within this many seconds is stopped and recorded as oom: its "
        "other ranks would otherwise wait in a collective until its timeout (NCCL 10 min, HCCL 30) with the "
        "devices held; null: wait for the probe's exit or its timeout",
    )
    env: Annotated[dict[EnvName, str], AfterValidator(_env_values_of_backend)] = Field(
        default_factory=dict,
        description="extra environment for every probe; values of "
        "keys that look secret (TOKEN, PASSWORD, SECRET, KEY, CREDENTIAL, AUTH) or named in "
        "secret_env reach the probe only, and are masked in every copy autotune keeps",
    )
    secret_env: list[EnvName] = Field(default_factory=list, description="more env keys whose values are secret")
    resources: dict[str, Any] | None = Field(
        None, description="Ray resources per trial, replacing the default derived from the cluster"
    )
    metric_patterns: dict[str, str] = Field(default_factory=dict, description="metric -> regex with one group")
    python: str | None = Field(None, description="interpreter for the mindspore/torch probe")
    launcher: Literal["auto", "warm", "spawn", "torchrun"] = Field(
        "auto",
        description="how the torch probe's ranks start: 'warm' forks them from a server that has imported "
        "torch already (single node), 'spawn' starts fresh processes (single node), 'torchrun' "
        "(any); 'auto' = warm on a single cpu node, spawn on a single accelerator node, torchrun "
        "across nodes",
    )
    cwd: str | None = Field(
        None,
        description="working directory of the probe; a relative path is relative to the "
        "spec file (default: where autotune runs)",
    )
    entry: str | None = Field(
        None,
        description="stack presets (megatron, mindspeed, torchtitan, deepspeed): the "
        "training entry point, a script path (pretrain_gpt.py, train.py) or '-m package.module' "
        "(torchtitan's default: -m torchtitan.train); run under torchrun --standalone",
    )
    args: list[str] = Field(
        default_factory=list,
        description="stack presets: the job's own arguments (data, "
        "tokenizer, --module/--config), after autotune's (Megatron keeps the last of a repeated flag); "
        "'{iterations}' is replaced by the iterations to run (also $AUTOTUNE_ITERATIONS)",
    )
    iterations: int | None = Field(
        None,
        gt=0,
        description="stack presets: training iterations per probe (default: "
        "workload.warmup_steps + measured_steps; the warm-up ones are not measured)",
    )

    @field_validator("argv", "args")
    @classmethod
    def _command_line(cls, v: list[str] | None) -> list[str] | None:
        for i, word in enumerate(v or []):
            if "\x00" in word:
                raise ValueError(
                    f"word {i + 1} ({short_value(word, 60)}) contains a NUL character, which no command line can hold"
                )
        return v

    @field_validator("python", "cwd", "entry")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        problem = path_problem(v.removeprefix("-m ")) if v is not None else None
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("metric_patterns")
    @classmethod
    def _patterns_compile(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        for metric, pattern in v.items():
            try:
                groups = re.compile(pattern).groups
            except re.error as exc:
                raise ValueError(f"the pattern for {metric!r} is not a regular expression: {exc}") from None
            if groups < 1:
                raise ValueError(
                    f"the pattern for {metric!r} needs a group around the number, e.g. '{metric}[=:] *([0-9.eE+-]+)'"
                )
        return v

    @model_validator(mode="after")
    def _argv_for_command(self) -> "BackendSpec":
        if self.kind == "command" and not self.argv:
            raise ValueError(
                "backend kind 'command' needs argv, a list such as [python, train.py, --trial, '{trial_file}']"
            )
        if self.kind != "command" and self.argv:
            raise ValueError(f"argv is only used by backend kind 'command', not {self.kind!r}")
        if self.kind in STACK_PRESETS and not PRESET_ENTRIES[self.kind].default and not self.entry:
            raise ValueError(
                f"backend kind {self.kind!r} needs entry, the training script ({PRESET_ENTRIES[self.kind].example})"
            )
        if self.kind not in STACK_PRESETS and (self.entry or self.args or self.iterations):
            raise ValueError(
                f"entry, args and iterations are for the stack presets (kind {', '.join(STACK_PRESETS)}), "
                f"not {self.kind!r}"
            )
        return self


# ------------------------------------------------------------------------------------- objectives
class ObjectiveSpec(Strict):
    metric: str
    direction: Literal["maximize", "minimize"] | None = Field(None, description="default: the metric's own")


def _baseline_key(key: str) -> str:
    if key.startswith("env."):
        problem = env_name_problem(key[4:])
        if problem:
            raise ValueError(f"{problem} (an env.VAR key sets the environment variable VAR)")
    return key


BaselineKey = Annotated[str, AfterValidator(_baseline_key)]


class Spec(Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    model: ModelSpec
    workload: Workload = Field(discriminator="kind")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    backend: BackendSpec = Field(default_factory=BackendSpec)
    space: SpaceSpec = Field(default_factory=SpaceSpec)
    constraints: list[str] = Field(default_factory=list)
    objectives: list[ObjectiveSpec] = Field(default_factory=list)
    baseline: dict[BaselineKey, Any] | None = None
    target: TargetName | None = Field(
        None,
        description="the stack that will run the chosen config in production; the space keeps only configs it can "
        "launch and the exports launch exactly the measured config (default: mindformers for the "
        "mindspore backend, mindspeed on npu, megatron elsewhere); 'none': no stack in mind, the "
        "space is not restricted and each export format refuses what it cannot launch",
    )
    search: SearchSpec = Field(default_factory=SearchSpec)
    recommend: RecommendSpec = Field(default_factory=RecommendSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    ray: RaySpec = Field(default_factory=RaySpec)

    source_path: Path | None = Field(None, exclude=True, description="set by load_spec")

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, v: Any, info: Any) -> Any:
        if isinstance(v, str):
            if v in PRESETS:
                return {"name": v, **PRESETS[v]}
            problem = path_problem(v)
            if problem:  # neither a preset nor a path the OS could open
                raise ValueError(
                    f"unknown model preset {short_value(v)}; presets: {', '.join(PRESETS)}; or a path to "
                    f"a config.json, and as a path: {problem}"
                )
            config = read_by_the_loader(info, "model", v)  # a config.json (autotune.spec.files)
            if config is not None:
                return config
            raise ValueError(
                f"unknown model preset {short_value(v)}; presets: {', '.join(PRESETS)}; or a path to a config.json"
            )
        if isinstance(v, dict) and "preset" in v:
            preset = v["preset"]
            if not isinstance(preset, str) or preset not in PRESETS:
                raise ValueError(f"unknown model preset {short_value(preset)}; presets: {', '.join(PRESETS)}")
            rest = {k: x for k, x in v.items() if k != "preset"}
            return {"name": preset, **PRESETS[preset], **rest}
        return v

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_name(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v

    @field_validator("objectives", mode="before")
    @classmethod
    def _objective_names(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [{"metric": x} if isinstance(x, str) else x for x in v]
        return v

    # ---- derived views -----------------------------------------------------------------------
    @property
    def is_training(self) -> bool:
        return self.workload.kind == "train"
