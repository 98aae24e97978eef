"""The exporter contract and the header every export carries."""

from __future__ import annotations

import abc
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from autotune.workers.protocol import ENV_NAME

__all__ = [
    "Exporter",
    "ExportContext",
    "ExportRefused",
    "header_fields",
    "header_lines",
    "one_line",
    "bash_array",
    "script_arrays",
    "study_facts",
    "longest_lengths",
    "LAUNCHES",
]

# what the file of an exporter launches, by ``Exporter.launches`` (a study of another workload kind is refused)
LAUNCHES = {"train": "training", "serve": "serving"}


@dataclass
class ExportContext:
    """What an exporter may use: the study, the chosen trial and the spec's model/workload/cluster."""

    study: str
    trial: int
    config: dict[str, Any]
    metrics: dict[str, Any]
    source: str = ""  # measured | simulated | cache
    model: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    software: dict[str, str] = field(default_factory=dict)  # as the probe reported it
    target: str = ""  # the study's target stack (autotune.stacks); "" = unknown
    chosen_because: str = ""  # the trial's reason: best.env names the knobs the model could not tell apart
    searched: frozenset[str] | None = None  # the space's searched names (None: unknown)

    @classmethod
    def from_record(
        cls,
        study: str,
        record: Any,
        model: dict | None = None,
        workload: dict | None = None,
        cluster: dict | None = None,
        target: str = "",
        searched: Any = None,
    ) -> "ExportContext":
        info = getattr(record, "info", None) or {}
        return cls(
            study=study,
            trial=record.number,
            config=dict(record.config),
            metrics=dict(record.metrics),
            source=record.source or "",
            model=dict(model or {}),
            workload=dict(workload or {}),
            cluster=dict(cluster or {}),
            software={k: str(v) for k, v in (info.get("software") or {}).items()},
            target=target,
            chosen_because=getattr(record, "chosen_because", "") or "",
            searched=frozenset(searched) if searched is not None else None,
        )

    # what most exporters need
    def get(self, name: str, default: Any = None) -> Any:
        return self.config.get(name, default)

    @property
    def world_size(self) -> int:
        c = self.cluster
        return int(c.get("world_size") or int(c.get("nodes", 1) or 1) * int(c.get("devices_per_node", 1) or 1))

    @property
    def env(self) -> dict[str, str]:
        return {k[4:]: str(v) for k, v in self.config.items() if k.startswith("env.")}


def longest_lengths(workload: Any) -> tuple[int, int]:
    """The longest prompt and output a serving workload's traffic sends (0, 0 when it has none)."""
    traffic = (workload or {}).get("traffic") or {}
    pairs = traffic.get("length_pairs")
    if pairs:
        return max(int(p) for p, _ in pairs), max(int(o) for _, o in pairs)

    def high(length: Any) -> int:
        if isinstance(length, dict):
            return int(length.get("high") or 0)
        return int(length or 0)

    return high(traffic.get("prompt_len")), high(traffic.get("output_len"))


def study_facts(ctx: ExportContext) -> dict[str, Any]:
    """What a stack's rules know of the study besides the config (:func:`autotune.stacks.fact_columns`):
    the accelerator, the model and the workload."""
    return {"accelerator": ctx.cluster.get("accelerator", ""), "model": ctx.model, "workload": ctx.workload}


def header_fields(ctx: ExportContext) -> dict[str, Any]:
    return {
        "study": ctx.study,
        "trial": ctx.trial,
        "source": ctx.source or "unknown",
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metrics": {k: v for k, v in sorted(ctx.metrics.items()) if isinstance(v, (int, float))},
        "software": ctx.software or "not reported (simulated, or a command backend that did not say)",
    }


def one_line(text: Any) -> str:
    """Text from a probe or a spec, safe inside a one-line comment: control characters (a newline
    would end the comment, and the next line would run when the file is sourced) become spaces."""
    return "".join(ch if ch.isprintable() else " " for ch in str(text))


def header_lines(ctx: ExportContext, comment: str = "#") -> list[str]:
    h = header_fields(ctx)
    metrics = one_line(", ".join(f"{k}={v:.6g}" for k, v in h["metrics"].items()))
    software = one_line(", ".join(f"{k} {v}" for k, v in ctx.software.items()) if ctx.software else h["software"])
    lines = [
        f"{comment} autotune export: study {ctx.study}, trial {ctx.trial}, {h['source']}",
        f"{comment} written {h['written']}",
        f"{comment} metrics ({h['source']}): {metrics}",
        f"{comment} software: {software}",
    ]
    if ctx.source == "simulated":
        lines.append(f"{comment} NOTE: simulated by the analytical model, not measured; probe it before production use")
    return lines


def script_arrays(script: str) -> dict[str, list[str]]:
    """The ``NAME=( ... )`` arrays of a script written here, as argv lists (for tests and presets)."""
    lines = script.splitlines()
    out: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        if line.endswith("=(") and line[:-2].isidentifier():
            end = lines.index(")", i)
            out[line[:-2]] = shlex.split(" ".join(lines[i + 1 : end]))
    return out


def bash_array(name: str, args: list[str] | tuple[str, ...]) -> list[str]:
    """A bash array of argv, one flag (with its value) per line, every word quoted."""
    lines = [f"{name}=("]
    i = 0
    while i < len(args):  # one flag (with its value) per line
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"    {shlex.quote(args[i])} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(f"    {shlex.quote(args[i])}")
            i += 1
    lines.append(")")
    return lines


class ExportRefused(ValueError):
    """The format cannot launch this config; the message says why (never exported as something else)."""


class Exporter(abc.ABC):
    """One target format. ``render`` returns the whole file, header included; ``unsupported``
    says why the format cannot launch a config (empty: it can)."""

    name: str = ""
    filename: str = ""
    executable: bool = False
    shell: bool = False  # the file is run or sourced by a shell: every env name in it must be a plain name
    launches: str = "train"  # the workload kind its file launches (LAUNCHES): a stack's exporter refuses the others
    # set by the stack registry (autotune.stacks.register), which holds this exporter: the stacks it
    # launches, in registration order, and their rules (why one of them cannot launch a config, given
    # the study's facts: study_facts)
    targets: tuple[str, ...] = ()
    target_rules: Callable[..., list[str]] | None = None

    @abc.abstractmethod
    def render(self, ctx: ExportContext) -> str:
        """The file's text for this context (call ``unsupported`` first: ``write_exports`` does)."""

    def unsupported(self, ctx: ExportContext) -> list[str]:
        """Reasons this format cannot launch ``ctx.config`` exactly. A format for one family of
        stacks (Megatron/MindSpeed, DeepSpeed, torchtitan, MindFormers; vLLM; MindIE) applies that
        stack's rules (:mod:`autotune.stacks`: the stacks whose descriptor holds this exporter, with
        the study's facts: the accelerator, the model, the traffic); a study tuned for another stack
        gets them too, since the same config is exported. A launch of another workload kind than
        the study's (a training launch of a serving study, a serving one of a training study) is
        refused first."""
        unsafe = [name for name in ctx.env if not ENV_NAME.fullmatch(name)] if self.shell else []
        if unsafe:  # `export NAME=...` cannot quote a name: `X=1;touch PWNED;#` would run as a command
            return [f"env name(s) {', '.join(map(repr, unsafe))} are not shell variable names ([A-Za-z_][A-Za-z0-9_]*)"]
        targets = self.targets
        if not targets:
            return []
        kind = ctx.workload.get("kind", "train")
        if kind != self.launches:  # a launch of another workload would launch something else
            return [
                f"{self.name} writes a {LAUNCHES.get(self.launches, self.launches)} launch, and this study tuned a "
                f"{kind} workload: its config is in best_config.yaml and best.env"
                + (" (and its serving engine's own launch: vllm, mindie)" if kind == "serve" else "")
            ]
        target = ctx.target if ctx.target in targets else targets[0]
        rules = self.target_rules(target, ctx.config, study_facts(ctx)) if self.target_rules is not None else []
        return rules + self.workload_reasons(ctx)

    def workload_reasons(self, ctx: ExportContext) -> list[str]:
        """Why the format cannot launch the study's model and workload (default: none)."""
        return []
