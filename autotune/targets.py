"""The production stack a study tunes for (the spec's ``target:``), and what each stack can express.

A config is only worth recommending if the stack that will run it can launch *that* config.
Megatron-LM's distributed optimizer shards optimizer states only (ZeRO-1); torchtitan has no
ZeRO-1 and applies bf16 mixed precision only through FSDP; a DeepSpeed config file cannot say
"tensor parallel" on its own. So each target has rules, in the same vectorised form as the space's
own rules (:mod:`autotune.space` applies them while it enumerates, so a config the target cannot
express is never ranked nor probed), and each exporter refuses, with the same reason, a config its
format cannot express (``autotune export --format X`` of a study tuned for another stack).

One function per rule set (``_megatron_rules`` ...), each a list of (reason, predicate over config
columns). The columns are those of :meth:`autotune.space.Space._derive`: numpy arrays of canonical
parameters, ``recompute_layers`` an object column with ``None`` where every layer is recomputed.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["TARGETS", "FORMAT_TARGETS", "TARGET_FORMATS", "default_target", "target_violations",
           "unsupported_reasons", "SUPPORTED_VERSIONS", "memory_rule"]

TARGETS = ("mindspeed", "megatron", "deepspeed", "torchtitan", "mindformers")

# The export format that launches each target, and the targets each format can launch.
TARGET_FORMATS = {"mindspeed": "megatron", "megatron": "megatron", "deepspeed": "deepspeed",
                  "torchtitan": "torchtitan", "mindformers": "mindformers"}
FORMAT_TARGETS = {"megatron": ("mindspeed", "megatron"), "deepspeed": ("deepspeed",),
                  "torchtitan": ("torchtitan",), "mindformers": ("mindformers",)}

# What the exports were checked against (tests/test_export_targets.py); the README says the same.
SUPPORTED_VERSIONS = {
    "megatron": "Megatron-LM core_r0.12 and later (checked: main at d98e8a64, megatron-core 0.16)",
    "mindspeed": "MindSpeed-LLM 2.x on Megatron core_r0.8+ (flags of examples/mcore/llama2 at a9547f61)",
    "deepspeed": "DeepSpeed 0.14 and later (checked: 0.19.8)",
    "torchtitan": "torchtitan 0.3.x (config_registry modules + CLI overrides; the TOML files of <= 0.2 are not written)",
    "mindformers": "MindFormers 1.3 and later on MindSpore 2.4+ (checked against MindFormers' own batch rules)",
}

Rule = tuple[str, Callable[[dict[str, np.ndarray]], np.ndarray]]

# How each stack holds the model states (autotune.workers.simulate._memory.state_bytes_per_param)
_MEMORY_RULES = {"mindspeed": "megatron", "megatron": "megatron", "deepspeed": "deepspeed", "torchtitan": "fsdp2",
                 "mindformers": "mindspore", "none": "megatron"}


def memory_rule(target: str, backend_kind: str) -> str:
    """The memory rule the model prices: the probe's own when autotune's torch probe measures
    (its peaks are what a probe can run out of), else the target stack's."""
    return "torch-probe" if backend_kind == "torch" else _MEMORY_RULES.get(target, "megatron")


MINDSPORE_PARAMS = ("mode", "jit_level", "graph_kernel_flags")


def default_target(backend_kind: str, accelerator: str, searched: tuple[str, ...] = ()) -> str:
    """The stack a spec without ``target:`` is tuned for: MindFormers for MindSpore probes (or a
    space over MindSpore's own settings), MindSpeed-LLM on Ascend, Megatron-LM elsewhere."""
    if backend_kind == "mindspore" or any(name in MINDSPORE_PARAMS for name in searched):
        return "mindformers"
    return "mindspeed" if accelerator == "npu" else "megatron"


def _col(cols: dict[str, np.ndarray], name: str, default: Any, n: int) -> np.ndarray:
    value = cols.get(name)
    return np.full(n, default, dtype=object if isinstance(default, str) else None) if value is None else np.asarray(value)


def _partial_recompute(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Full recompute of only some layers of each stage (``recompute_layers`` set)."""
    rl = cols.get("recompute_layers")
    if rl is None:
        return np.zeros(n, dtype=bool)
    return np.array([v is not None for v in np.asarray(rl, dtype=object)], dtype=bool)


def _compiled(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    return _col(cols, "compile", "none", n).astype(str) != "none"


def _mindspore_only(cols: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Every config, when MindSpore's own settings are part of it."""
    return np.full(n, any(name in cols for name in MINDSPORE_PARAMS))


def _megatron_rules(n: int) -> list[Rule]:
    return [
        ("ZeRO-2/3 cannot be expressed: Megatron's --use-distributed-optimizer shards optimizer states only (ZeRO-1)",
         lambda c: _col(c, "zero_stage", 0, n).astype(int) >= 2),
        ("recompute_layers must be a multiple of vpp: --recompute-method block counts layers per virtual stage",
         lambda c: _partial_recompute(c, n) & (_col(c, "vpp", 1, n).astype(int) > 1)
         & np.array([(v or 0) % max(int(p), 1) != 0 for v, p in
                     zip(np.asarray(_col(c, "recompute_layers", None, n), dtype=object), _col(c, "vpp", 1, n))])),
        ("torch.compile has no Megatron flag", lambda c: _compiled(c, n)),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: _mindspore_only(c, n)),
    ]


def _deepspeed_rules(n: int) -> list[Rule]:
    return [
        ("a DeepSpeed config cannot express tp/pp/cp > 1 (model parallelism lives in the model code: "
         "Megatron-DeepSpeed or a PipelineModule)",
         lambda c: (_col(c, "tp", 1, n).astype(int) * _col(c, "pp", 1, n).astype(int)
                    * _col(c, "cp", 1, n).astype(int)) > 1),
        ("DeepSpeed has no selective recompute, nor a recomputed-layer count (activation checkpointing is per "
         "block, in the model code)",
         lambda c: (_col(c, "recompute", "none", n).astype(str) == "selective") | _partial_recompute(c, n)),
        ("torch.compile is not set by the DeepSpeed config", lambda c: _compiled(c, n)),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: _mindspore_only(c, n)),
    ]


def _torchtitan_rules(n: int) -> list[Rule]:
    zero = lambda c: _col(c, "zero_stage", 0, n).astype(int)  # noqa: E731
    precision = lambda c: _col(c, "precision", "bf16", n).astype(str)  # noqa: E731
    return [
        ("torchtitan has no ZeRO-1 (FSDP2 shards parameters too)", lambda c: zero(c) == 1),
        ("torchtitan has no fp16 training (no loss scaling)", lambda c: precision(c) == "fp16"),
        ("torchtitan applies bf16 mixed precision only through FSDP: bf16 needs zero_stage 2 or 3",
         lambda c: (precision(c) == "bf16") & (zero(c) < 2)),
        ("torchtitan 0.3 checkpoints every block: no recomputed-layer count", lambda c: _partial_recompute(c, n)),
        ("torchtitan's compile has no mode: only compile 'default' is expressible",
         lambda c: np.isin(_col(c, "compile", "none", n).astype(str), ["reduce-overhead", "max-autotune"])),
        ("MindSpore settings (mode, jit_level, graph_kernel_flags) do not apply", lambda c: _mindspore_only(c, n)),
    ]


def _mindformers_rules(n: int) -> list[Rule]:
    return [
        ("ZeRO-2/3 cannot be expressed: MindSpore's parallel optimizer shards the optimizer (ZeRO-1)",
         lambda c: _col(c, "zero_stage", 0, n).astype(int) >= 2),
        ("torch.compile does not apply to MindSpore", lambda c: _compiled(c, n)),
    ]


_RULES = {"megatron": _megatron_rules, "mindspeed": _megatron_rules, "deepspeed": _deepspeed_rules,
          "torchtitan": _torchtitan_rules, "mindformers": _mindformers_rules}


def target_violations(target: str, cols: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """``{reason: bool array}``: which of ``n`` configs (as columns) ``target`` cannot launch."""
    if target not in _RULES:
        raise ValueError(f"unknown target {target!r}; expected one of {', '.join(TARGETS)}")
    return {f"target {target}: {reason}": np.broadcast_to(np.asarray(check(cols), dtype=bool), (n,))
            for reason, check in _RULES[target](n)}


def unsupported_reasons(target: str, config: dict[str, Any]) -> list[str]:
    """Why ``target`` cannot launch this one config (empty when it can)."""
    cols = {k: np.asarray([v], dtype=object if isinstance(v, str) or v is None else None) for k, v in config.items()}
    return [reason for reason, bad in target_violations(target, cols, 1).items() if bad[0]]
