"""What a production stack is: one :class:`Stack` descriptor, and the pieces stacks share.

A config is only worth recommending if the stack that will run it can launch *that* config. So a
stack says, in one place: what the space may contain for it (its rules, each a reason and a
vectorised predicate over config columns, applied by :mod:`autotune.space` while it enumerates),
how it holds the model states (the simulator's memory rule), the exporter that writes its launch
(which refuses, with the same reasons, a config the rules forbid), and, for a stack autotune can
run as the probe (a backend preset), how a trial becomes its launch and which reader of
:mod:`autotune.workers.stack_logs` reads its log.

The columns a rule sees are those of :meth:`autotune.space.Space._derive`: numpy arrays of
canonical parameters, ``recompute_layers`` an object column with ``None`` where every layer is
recomputed. Nothing here imports :mod:`autotune.spec` (the spec derives its stack names from the
registry) nor the workers' log readers (those run on worker nodes; a stack names its reader).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from autotune.export import Exporter

__all__ = [
    "MINDSPORE_PARAMS",
    "PresetLaunch",
    "PresetRun",
    "Rule",
    "Stack",
    "col",
    "compiled",
    "mindspore_only",
    "partial_recompute",
    "uses_mindspore",
]

Rule = tuple[str, Callable[[dict[str, np.ndarray]], np.ndarray]]

# MindSpore's own settings: a config (or a searched space) with any of them runs on MindSpore
MINDSPORE_PARAMS = ("mode", "jit_level", "graph_kernel_flags")


@dataclass(frozen=True)
class PresetRun:
    """What every preset launch shares, built by :func:`autotune.stack_presets.preset_launch`:
    the trial, ``launcher`` (``python -m torch.distributed.run ... --nproc-per-node N``), the
    entry point as argv words, the user's ``args`` (``{iterations}`` filled in) and the sizes."""

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


@dataclass(frozen=True)
class Stack:
    """One production stack (the spec's ``target:``; a backend preset when it has a ``launch``).

    - ``rules(n)``: ``[(reason, predicate over config columns -> bool array of n)]``, the configs
      the stack cannot launch as measured;
    - ``memory_rule``: how it holds the model states (``workload['memory_rule']`` of
      :mod:`autotune.workers.simulate._memory`);
    - ``exporter``: the :class:`~autotune.export.Exporter` writing its launch (stacks may share
      one: MindSpeed-LLM and Megatron-LM both launch ``pretrain_gpt.py``);
    - ``supported_versions``: what the export was checked against (the README says the same);
    - ``default_when(backend_kind, accelerator, searched)``: whether a spec without ``target:`` is
      tuned for this stack (the registered conditions exclude one another);
    - ``launch(run) -> PresetLaunch``: the stack as the probe (``backend: {kind: NAME}``), with
      ``log_reader`` the key of :data:`autotune.workers.stack_logs.STACK_LOGS` reading its log,
      ``default_entry`` the entry point when the spec names none (else ``entry_example`` is
      what the spec must name) and ``extra_iterations`` run beyond warm-up + measured steps.
    """

    name: str
    rules: Callable[[int], list[Rule]]
    memory_rule: str
    exporter: Exporter
    supported_versions: str
    default_when: Callable[[str, str, tuple[str, ...]], bool] | None = None
    launch: Callable[[PresetRun], PresetLaunch] | None = None
    log_reader: str | None = None
    default_entry: str | None = None
    entry_example: str = ""
    extra_iterations: int = 0

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"a stack name is a lower-case identifier, not {self.name!r}")
        if (self.launch is None) != (self.log_reader is None):
            raise ValueError(f"stack {self.name!r}: a backend preset has both a launch and a log reader")

    @property
    def preset(self) -> bool:
        """Whether autotune runs this stack as the probe (``backend: {kind: NAME}``)."""
        return self.launch is not None

    def violations(self, cols: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """``{reason: bool array}``: which of ``n`` configs (as columns) the stack cannot launch."""
        return {
            f"target {self.name}: {reason}": np.broadcast_to(np.asarray(check(cols), dtype=bool), (n,))
            for reason, check in self.rules(n)
        }

    def unsupported(self, config: dict[str, Any]) -> list[str]:
        """Why the stack cannot launch this one config (empty when it can)."""
        cols = {
            k: np.asarray([v], dtype=object if isinstance(v, str) or v is None else None) for k, v in config.items()
        }
        return [reason for reason, bad in self.violations(cols, 1).items() if bad[0]]


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


def partial_recompute(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Full recompute of only some layers of each stage (``recompute_layers`` set)."""
    rl = cols.get("recompute_layers")
    if rl is None:
        return np.zeros(n, dtype=bool)
    return np.array([v is not None for v in np.asarray(rl, dtype=object)], dtype=bool)


def compiled(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """torch.compile on."""
    return col(cols, "compile", "none", n).astype(str) != "none"


def mindspore_only(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Every config, when MindSpore's own settings are part of it."""
    return np.full(n, any(name in cols for name in MINDSPORE_PARAMS))
