"""What a production stack is: one :class:`Stack` descriptor, and the pieces stacks share.

A config is only worth recommending if the stack that will run it can launch *that* config. So a
stack says, in one place: what the space may contain for it (its rules, each a reason and a
vectorised predicate over config columns, applied by :mod:`autotune.spec.space` while it enumerates),
how it holds the model states (the simulator's memory rule), the exporter that writes its launch
(which refuses, with the same reasons, a config the rules forbid), and, for a stack autotune can
run as the probe (a backend preset), how a trial becomes its launch and which reader of
:mod:`autotune.workers.stack_logs` reads its log.

The columns a rule sees are those of :meth:`autotune.spec.space.Space._derive`: numpy arrays of
canonical parameters, ``recompute_layers`` an object column with ``None`` where every layer is
recomputed. Facts of the study that are not parameters (the accelerator, the model's name, the
longest prompt and output the traffic sends) reach the rules as columns named ``@NAME``
(:func:`fact`; :func:`fact_columns` builds them from ``{"accelerator", "model", "workload"}``):
what an engine can launch depends on where it runs. A rule reading a fact that is not given
(``""`` / ``0``) does not fire. Nothing here imports :mod:`autotune.spec.schema` (the spec derives its
stack names from the registry) nor the workers' log readers (those run on worker nodes; a stack
names its reader).

A stack is a target of some workloads (``workloads``): the training stacks of ``train`` (and
``infer``, whose exports are autotune's own), the serving stacks (vLLM, MindIE) of ``serve``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.export._base import longest_lengths
from autotune.workers.parameters import default

if TYPE_CHECKING:
    from autotune.export import Exporter

__all__ = [
    "FACTS",
    "MINDSPORE_PARAMS",
    "PresetLaunch",
    "PresetRun",
    "Rule",
    "Stack",
    "WORKLOAD_KINDS",
    "col",
    "compiled",
    "disaggregated",
    "engine_names",
    "fact",
    "fact_columns",
    "longest_lengths",
    "mindspore_only",
    "param",
    "partial_recompute",
    "uneven_pipeline",
    "uses_mindspore",
]

Rule = tuple[str, Callable[[dict[str, np.ndarray]], np.ndarray]]

# MindSpore's own settings: a config (or a searched space) with any of them runs on MindSpore
MINDSPORE_PARAMS = ("mode", "jit_level", "graph_kernel_flags")
WORKLOAD_KINDS = ("train", "infer", "serve")
# the study's facts a rule may read (column "@NAME"), and their value when unknown
FACTS: dict[str, Any] = {
    "accelerator": "",
    "model": "",
    "max_prompt_len": 0,
    "max_output_len": 0,
    "max_model_len": 0,
    "devices_per_node": 0,  # 0: not known (a rule that needs it then refuses nothing)
}


@dataclass(frozen=True)
class PresetRun:
    """What every preset launch shares, built by :func:`autotune.dispatch.stack_presets.preset_launch`:
    the trial, ``launcher`` (``python -m torch.distributed.run ... --nproc-per-node N``; for a
    serving stack the engine's interpreter, ``backend.python``), the entry point as argv words,
    the user's ``args`` (``{iterations}`` filled in) and the sizes (``devices``: the world, or a
    serving trial's ``replicas x tp x pp``)."""

    request: Any
    launcher: list[str]
    entry: list[str]
    user: list[str]
    iterations: int
    devices: int
    global_batch_size: int
    layers: int

    @property
    def config(self) -> dict[str, Any]:
        return self.request.params

    @property
    def model(self) -> dict[str, Any]:
        return self.request.model

    @property
    def workload(self) -> dict[str, Any]:
        return self.request.workload

    @property
    def cluster(self) -> dict[str, Any]:
        return self.request.cluster


@dataclass(frozen=True)
class PresetLaunch:
    """A stack's part of a trial's launch: the whole ``argv``, and the ``env`` and ``files``
    (name -> text, written beside the trial file; ``{trial_dir}`` in argv names that folder) it adds."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


# the serving presets' part of a trial's launch (vLLM, MindIE): the serving probe reads what to start
# from ``engine.json`` in the trial's folder (workers/serve_probe/probe.py's ENGINE_FILE)
ENGINE_FILE = "engine.json"
SERVING_PROBE_ARGV = [sys.executable, "-m", "autotune.workers.serve_probe", "--engine", "{trial_dir}/" + ENGINE_FILE]
SERVED_MODEL_NAME = "autotune-model"  # the name every serving preset serves the model under


def serving_engine_launch(
    engine: str,
    replicas: list[dict[str, Any]],
    files: dict[str, str],
    ports: tuple[str, str],
    metrics_names: Any,
    startup_failures: Any,
    workload: dict[str, Any],
    version: str,
) -> PresetLaunch:
    """The launch of a serving preset: the serving probe, given ``engine.json``, the one contract
    every engine fills the same way (its replicas' argv/env/devices/files, the OpenAI-compatible
    routes, the ``/metrics`` names it reads, the start-up failures it recognises). ``ports``: the
    names of the ports ``/metrics`` and ``/health`` answer on (vLLM serves both on ``port``, MindIE
    on its metrics and management ports)."""
    description = {
        "engine": engine,
        "replicas": replicas,
        "files": files,
        "api": {
            "completions": "/v1/completions",
            "health": "/health",
            "metrics": "/metrics",
            "metrics_port": ports[0],
            "health_port": ports[1],
            "model": SERVED_MODEL_NAME,
        },
        "metrics_names": metrics_names,
        "startup_failures": startup_failures,
        "prompt": "token_ids",
        "startup_timeout_s": float(workload.get("startup_timeout_s") or 600.0),
        "version": version,
    }
    return PresetLaunch(list(SERVING_PROBE_ARGV), files={ENGINE_FILE: json.dumps(description, indent=1)})


@dataclass(frozen=True)
class Stack:
    """One production stack (the spec's ``target:``; a backend preset when it has a ``launch``).

    - ``rules(n)``: ``[(reason, predicate over config columns -> bool array of n)]``, the configs
      the stack cannot launch as measured (the study's facts as ``@NAME`` columns, :func:`fact`);
    - ``memory_rule``: how a training stack holds the model states (``workload['memory_rule']``
      of :mod:`autotune.workers.simulate._memory`); None for a serving engine (the simulator
      prices its weights and KV cache itself);
    - ``exporter``: the :class:`~autotune.export.Exporter` writing its launch (stacks may share
      one: MindSpeed-LLM and Megatron-LM both launch ``pretrain_gpt.py``);
    - ``supported_versions``: what the export was checked against (docs/EXPORTS.md says the same);
    - ``workloads``: the workload kinds it is a target of (``train``/``infer`` for the training
      stacks, ``serve`` for a serving engine);
    - ``default_when(backend_kind, accelerator, searched)``: whether a spec of one of its
      ``workloads`` without ``target:`` is tuned for this stack (the registered conditions of the
      stacks of one workload exclude one another);
    - ``launch(run) -> PresetLaunch``: the stack as the probe (``backend: {kind: NAME}``). A
      training preset names ``log_reader``, the key of
      :data:`autotune.workers.stack_logs.STACK_LOGS` reading its log, and ``extra_iterations``
      run beyond warm-up + measured steps; a serving preset has no log reader: its launch runs
      autotune's serving probe (``autotune.workers.serve_probe``), which starts the engine from
      ``engine.json`` and prints the probe protocol itself. ``default_entry`` is the entry point
      when the spec names none (else ``entry_example`` is what the spec must name).
    """

    name: str
    rules: Callable[[int], list[Rule]]
    memory_rule: str | None
    exporter: Exporter
    supported_versions: str
    default_when: Callable[[str, str, tuple[str, ...]], bool] | None = None
    launch: Callable[[PresetRun], PresetLaunch] | None = None
    log_reader: str | None = None
    default_entry: str | None = None
    entry_example: str = ""
    extra_iterations: int = 0
    workloads: tuple[str, ...] = ("train", "infer")

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"a stack name is a lower-case identifier, not {self.name!r}")
        unknown = [w for w in self.workloads if w not in WORKLOAD_KINDS]
        if not self.workloads or unknown:
            raise ValueError(f"stack {self.name!r}: workloads are some of {', '.join(WORKLOAD_KINDS)}, not {unknown}")
        if self.serving:
            if self.log_reader is not None:
                raise ValueError(f"stack {self.name!r}: a serving preset's probe prints the protocol: no log reader")
        elif (self.launch is None) != (self.log_reader is None):
            raise ValueError(f"stack {self.name!r}: a backend preset has both a launch and a log reader")
        if self.memory_rule is None and not self.serving:
            raise ValueError(f"stack {self.name!r}: a training stack names its memory rule")

    @property
    def preset(self) -> bool:
        """Whether autotune runs this stack as the probe (``backend: {kind: NAME}``)."""
        return self.launch is not None

    @property
    def serving(self) -> bool:
        """A serving engine (a target of ``workload.kind: serve``)."""
        return "serve" in self.workloads

    def violations(
        self, cols: dict[str, np.ndarray], n: int, facts: Mapping[str, Any] | None = None
    ) -> dict[str, np.ndarray]:
        """``{reason: bool array}``: which of ``n`` configs (as columns) the stack cannot launch,
        given the study's ``facts`` (``{"accelerator", "model", "workload"}``, :func:`fact_columns`)."""
        if facts:
            cols = {**fact_columns(facts, n), **cols}
        return {
            f"target {self.name}: {reason}": np.broadcast_to(np.asarray(check(cols), dtype=bool), (n,))
            for reason, check in self.rules(n)
        }

    def unsupported(self, config: dict[str, Any], facts: Mapping[str, Any] | None = None) -> list[str]:
        """Why the stack cannot launch this one config (empty when it can)."""
        cols = {
            k: np.asarray([v], dtype=object if isinstance(v, str) or v is None else None) for k, v in config.items()
        }
        return [reason for reason, bad in self.violations(cols, 1, facts).items() if bad[0]]


# ------------------------------------------------------------------- helpers the rules share
def uses_mindspore(backend_kind: str, searched: tuple[str, ...] = ()) -> bool:
    """MindSpore probes, or a space over MindSpore's own settings."""
    return backend_kind == "mindspore" or any(name in MINDSPORE_PARAMS for name in searched)


def col(cols: dict[str, np.ndarray], name: str, default: Any, n: int) -> np.ndarray:
    """Column ``name``, or ``default`` for every config when the space does not have it."""
    value = cols.get(name)
    if value is None:
        return np.full(n, default, dtype=object if isinstance(default, str) else None)
    return np.asarray(value)


def param(cols: dict[str, np.ndarray], name: str, n: int) -> np.ndarray:
    """Column ``name`` of a canonical parameter, or its default (the parameter table's, study-wide)
    for every config when the space does not have it."""
    return col(cols, name, default(name), n)


def disaggregated(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The configs with a prefill pool of their own (``prefill_replicas`` >= 1): a stack's rules for a
    disaggregated deployment apply to these only."""
    return param(cols, "prefill_replicas", n).astype(int) > 0


def param_on_device(cols: dict[str, np.ndarray], name: str, n: int) -> np.ndarray:
    """Column ``name``, or for each config the table's default on the study's accelerator (the
    ``@accelerator`` fact) when the space does not have it: a default that differs per device
    (``block_size``)."""
    value = cols.get(name)
    if value is not None:
        return np.asarray(value)
    accelerators = fact(cols, "accelerator", n).astype(str)
    return np.array([default(name, a if a else None) for a in accelerators])


def _is_set(cols: dict[str, np.ndarray], name: str, n: int) -> np.ndarray:
    """Where a parameter whose default is None (unset) has a value."""
    column = cols.get(name)
    if column is None:
        return np.zeros(n, dtype=bool)
    return np.array([v is not None for v in np.asarray(column, dtype=object)], dtype=bool)


def partial_recompute(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Full recompute of only some layers of each stage (``recompute_layers`` set)."""
    return _is_set(cols, "recompute_layers", n)


def uneven_pipeline(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Fewer (or more) layers on the first pipeline stage (``first_stage_layers`` set)."""
    return _is_set(cols, "first_stage_layers", n)


def compiled(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """torch.compile on."""
    return param(cols, "compile", n).astype(str) != "none"


def mindspore_only(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Every config, when MindSpore's own settings are part of it."""
    return np.full(n, any(name in cols for name in MINDSPORE_PARAMS))


# ------------------------------------------------------------------ the study's facts, as columns
def fact_columns(facts: Mapping[str, Any], n: int) -> dict[str, np.ndarray]:
    """The ``@NAME`` columns of a study's facts: ``facts`` holds ``accelerator`` (npu | cuda |
    cpu), ``model`` (the spec's model mapping, or its name), ``workload`` (the workload
    mapping: the longest prompt/output and ``max_model_len`` of a serving traffic) and
    ``devices_per_node`` (the cluster's)."""
    model = facts.get("model")
    name = model.get("name", "") if isinstance(model, Mapping) else str(model or "")
    workload = facts.get("workload") or {}
    prompt, output = longest_lengths(workload)
    values = {
        "accelerator": str(facts.get("accelerator") or ""),
        "model": name,
        "max_prompt_len": prompt,
        "max_output_len": output,
        "max_model_len": int(workload.get("max_model_len") or 0) or (prompt + output),
        "devices_per_node": int(facts.get("devices_per_node") or 0),
    }
    return {f"@{k}": np.full(n, v, dtype=object if isinstance(v, str) else int) for k, v in values.items()}


def fact(cols: dict[str, np.ndarray], name: str, n: int) -> np.ndarray:
    """The study's fact ``name`` (:data:`FACTS`) for every config; its unknown value when not given."""
    value = cols.get(f"@{name}")
    if value is None:
        default = FACTS[name]
        return np.full(n, default, dtype=object if isinstance(default, str) else int)
    return np.asarray(value)


def engine_names(cols: dict[str, np.ndarray]) -> list[str]:
    """The engine's own settings a config sets (``engine.NAME`` columns), by NAME."""
    return [k[len("engine.") :] for k in cols if k.startswith("engine.")]
