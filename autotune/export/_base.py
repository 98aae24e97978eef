"""The exporter contract and the header every export carries."""

from __future__ import annotations

import abc
import json
import math
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from autotune.objectives.intervals import between_runs_words
from autotune.trial_attrs import roomiest_in, undistinguished_in
from autotune.workers.protocol import ENV_NAME

__all__ = [
    "Exporter",
    "ExportContext",
    "ExportRefused",
    "header_fields",
    "header_lines",
    "undistinguished_knobs",
    "unchosen_notes",
    "args_written",
    "one_line",
    "bash_array",
    "script_arrays",
    "study_facts",
    "longest_lengths",
    "LAUNCHES",
    "json_text",
    "unsafe_settings",
]

# the sources whose numbers were measured: a probe's result, or one answered from the result cache
MEASURED_SOURCES = ("measured", "cache")
# how a trial answered from the result cache says so in its reason (autotune.study.search)
_FROM_CACHE = re.compile(r"answered from the result cache \(([^)]*)\)")

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
    # the trial's figure between runs, where the study's repeats measured its noise (issue 44:
    # StudyResult.certificate["between_runs"], for the study's best only); None: not known
    between_runs: dict[str, Any] | None = None

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
        between_runs: dict[str, Any] | None = None,
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
            between_runs=dict(between_runs) if between_runs else None,
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

    # how the exported values were obtained: the one wording every export's sentences use
    @property
    def measured(self) -> bool:
        """Whether the trial's numbers were measured (by its probe, or by an earlier run's, from
        the result cache); a simulated or unknown source is never said to be measured."""
        return self.source in MEASURED_SOURCES

    @property
    def cached_from(self) -> str:
        """Where a result answered from the cache was measured (``study X, trial N``; ``an earlier
        run`` when the reason does not say); "" for a result measured by this run or not measured."""
        if not self.measured:
            return ""
        found = _FROM_CACHE.search(self.chosen_because or "")
        if found:
            return one_line(found.group(1))
        return "an earlier run" if self.source == "cache" else ""

    @property
    def how(self) -> str:
        """How the trial's numbers were obtained, in words that fit "as {how}", "{how} at sequence
        length N" and "({how})": ``measured``, ``predicted by the simulator``, or (a source the
        record does not name) ``recorded (source unknown)``."""
        if self.measured:
            return "measured"
        if self.source == "simulated":
            return "predicted by the simulator"
        return "recorded (source unknown)"

    @property
    def provenance(self) -> str:
        """The header's sentence on the metrics: how they were obtained, and on what hardware
        (``measured on npu, 1 node x 8 devices``; a cached result: in an earlier run)."""
        where = self.hardware
        if self.measured:
            cached = self.cached_from
            earlier = f" in an earlier run ({cached}; answered from the result cache)" if cached else ""
            if cached == "an earlier run":
                earlier = " in an earlier run (answered from the result cache)"
            return f"measured{earlier}{f' on {where}' if where else ''}"
        if self.source == "simulated":
            return f"predicted by the simulator{f' for {where}' if where else ''} (not measured)"
        return "of unknown source (the record does not say how they were obtained)"

    @property
    def hardware(self) -> str:
        """``npu, 1 node x 8 devices``: the accelerator and the cluster ("" when unknown)."""
        accelerator = one_line(self.cluster.get("accelerator", "") or "")
        if not accelerator:
            return ""
        nodes = int(self.cluster.get("nodes", 1) or 1)
        per_node = self.world_size // max(1, nodes)
        return (
            f"{accelerator}, {nodes} node{'s' if nodes != 1 else ''} x {per_node} device{'s' if per_node != 1 else ''}"
        )


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
    return {
        "accelerator": ctx.cluster.get("accelerator", ""),
        "devices_per_node": ctx.cluster.get("devices_per_node") or 0,
        "model": ctx.model,
        "workload": ctx.workload,
    }


def undistinguished_knobs(ctx: ExportContext) -> dict[str, str]:
    """``{config name: "0.85|0.9|0.95"}``: every knob (``tp``, ``memory_utilization``,
    ``env.HCCL_BUFFSIZE``, ...) the model could not tell apart for the chosen trial's layout, from
    the trial's reason (``ctx.chosen_because``: "not distinguished by the model (probe to choose):
    replicas 1|4, tp 2|8, env.A a:1,b:2|c"). The trial's value of each was not chosen by evidence."""
    return _knobs_named(undistinguished_in(ctx.chosen_because or ""), ctx)


def roomiest_knobs(ctx: ExportContext) -> dict[str, str]:
    """``{config name: "120|200|400"}``: the knobs the model prices alike in speed, of which the trial
    has the value it predicts roomiest (its reason's :data:`autotune.trial_attrs.ROOMIEST` part):
    chosen for memory by the model, not for speed by evidence."""
    return _knobs_named(roomiest_in(ctx.chosen_because or ""), ctx)


def _knobs_named(text: str, ctx: ExportContext) -> dict[str, str]:
    """``{name: values}`` of a reason's ``name v1|v2, name2 ...`` list (the config's names split it)."""
    if not text:
        return {}
    # each knob starts at the text's start or after ", " with its config name and a space (a value
    # may hold commas, so only the config's own names split the text)
    starts = sorted(
        (at, name)
        for name in ctx.config
        for at in [0 if text.startswith(f"{name} ") else text.find(f", {name} ")]
        if at >= 0
    )
    out: dict[str, str] = {}
    for i, (at, name) in enumerate(starts):
        begin = at + len(name) + 1 + (0 if at == 0 and text.startswith(f"{name} ") else 2)
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out[name] = text[begin:end].strip()
    return out


def unchosen_notes(ctx: ExportContext, written: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per value the evidence did not choose (the knobs the model could not tell
    apart), naming what the file writes for it (``written``: knob -> its flag or key here):
    ``not chosen by evidence: memory_utilization 0.95 (--gpu-memory-utilization 0.95): the model
    could not tell 0.85|0.9|0.95 apart; probe to choose``."""
    written = written or {}
    notes = []
    why = {name: f"the model could not tell {values} apart" for name, values in undistinguished_knobs(ctx).items()}
    for name, values in roomiest_knobs(ctx).items():
        why.setdefault(name, f"the model prices {values} alike in speed and took the value it predicts roomiest")
    for name, because in why.items():
        where = written.get(name) or (f"{name[4:]} in best.env" if name.startswith("env.") else "")
        notes.append(
            one_line(
                f"not chosen by evidence: {name} {ctx.config.get(name)}{f' ({where})' if where else ''}: "
                f"{because}; probe to choose"
            )
        )
    return notes


def args_written(args: list[str] | tuple[str, ...], flags: Mapping[str, str | tuple[str, ...]]) -> dict[str, str]:
    """``{knob: "--flag value"}`` for the knobs whose flag is in ``args`` (``flags``: knob -> its
    flag, also found in its ``--no-`` form, or a tuple of every form): what a launch writes for each knob."""
    out = {}
    for knob, flag in flags.items():
        for word in flag if isinstance(flag, tuple) else (flag, "--no-" + flag[2:]):
            if word in args:
                i = args.index(word)
                value = args[i + 1] if i + 1 < len(args) and not str(args[i + 1]).startswith("--") else ""
                out[knob] = f"{word} {value}".strip()
                break
    return out


def _software(ctx: ExportContext) -> Any:
    if ctx.software:
        return ctx.software
    if ctx.source == "simulated":
        return "none ran (simulated)"
    return "not reported (a command backend that did not say)"


def header_fields(ctx: ExportContext, written: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The header of a JSON export (its ``_autotune`` key): what ``header_lines`` says, as fields."""
    fields: dict[str, Any] = {
        "study": ctx.study,
        "trial": ctx.trial,
        "source": ctx.source or "unknown",
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "metrics": {  # numbers only, finite ones (NaN has no JSON form, and is no measurement)
            k: v
            for k, v in sorted(ctx.metrics.items())
            if isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))
        },
        "metrics_are": ctx.provenance,
        "software": _software(ctx),
    }
    if ctx.between_runs:
        fields["between_runs"] = between_runs_words(ctx.between_runs)
    if not ctx.measured:
        fields["note"] = _note(ctx)
    notes = unchosen_notes(ctx, written)
    if notes:
        fields["not_chosen_by_evidence"] = notes
    return fields


def _label(ctx: ExportContext) -> str:
    """The header's first line's word for the source."""
    if ctx.measured:
        return "measured in an earlier run (cached)" if ctx.cached_from else "measured"
    return ctx.source or "source unknown"


def _note(ctx: ExportContext) -> str:
    if ctx.source == "simulated":
        return "simulated by the analytical model, not measured; probe it before production use"
    return "the record names no source for its numbers (a probe or the simulator); probe it before production use"


def one_line(text: Any) -> str:
    """Text from a probe or a spec, safe inside a one-line comment: control characters (a newline
    would end the comment, and the next line would run when the file is sourced) become spaces."""
    return "".join(ch if ch.isprintable() else " " for ch in str(text))


def header_lines(ctx: ExportContext, comment: str = "#", written: Mapping[str, str] | None = None) -> list[str]:
    """The header of a file with comments: study, trial, how the metrics were obtained (and on
    what), the software, and one line per value the evidence did not choose (``written``: knob ->
    what this file writes for it, :func:`unchosen_notes`)."""
    h = header_fields(ctx, written)
    metrics = one_line(", ".join(f"{k}={v:.6g}" for k, v in h["metrics"].items()))
    software = one_line(", ".join(f"{k} {v}" for k, v in ctx.software.items()) if ctx.software else h["software"])
    lines = [
        f"{comment} autotune export: study {one_line(ctx.study)}, trial {ctx.trial}, {one_line(_label(ctx))}",
        f"{comment} written {h['written']}",
        f"{comment} metrics {one_line(ctx.provenance)}: {metrics}",
        f"{comment} software: {software}",
    ]
    if h.get("between_runs"):
        lines.append(f"{comment} {one_line(h['between_runs'])}")
    if not ctx.measured:
        lines.append(f"{comment} NOTE: {_note(ctx)}")
    lines += [f"{comment} {note}" for note in h.get("not_chosen_by_evidence", [])]
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


# control characters (C0, DEL, C1), line separators and bidi controls: no exported value holds one
# (bash drops a NUL silently, so a script would launch something other than the measured config; a
# U+202E shows a line other than as it runs); the spec refuses them (autotune.spec.schema)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c]")


def unsafe_settings(config: Mapping[str, Any], *, flags: bool = False) -> list[str]:
    """Why the config's ``env.*`` / ``engine.*`` values cannot be written into a launch file, one
    reason each: a non-finite number (strict JSON has no NaN or Infinity), a control character
    (NUL...), and with ``flags`` (the value follows ``--NAME`` on a command line) an engine string
    that starts with ``-``, which an argument parser reads as a flag of its own. The spec refuses all
    of these; this guards a config from elsewhere (an older run's record)."""
    out = []
    for name, value in config.items():
        if not str(name).startswith(("env.", "engine.")):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            out.append(f"{one_line(name)} is {value}, not a finite number")
        elif isinstance(value, str):
            bad = _CONTROL.search(value)
            if bad:
                out.append(f"{one_line(name)} holds the control character U+{ord(bad.group()):04X}")
            elif flags and str(name).startswith("engine.") and value.startswith("-"):
                out.append(
                    f"{one_line(name)} is {one_line(repr(value[:60]))}, which starts with '-': after --NAME it "
                    "would be read as a flag of its own (--model, --host)"
                )
    return out


def json_text(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` for an exported file: ``allow_nan=False``, the last guard against NaN or
    Infinity (which no strict JSON parser, MindIE's included, reads): a ValueError, never such a file."""
    return json.dumps(data, allow_nan=False, **kwargs)


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
    # how the file writes engine.* values: "" (not at all), "flags" (after --NAME: a value starting
    # with '-' would be a flag), "json" (in a JSON file); shell files and these check the env/engine
    # values (unsafe_settings)
    engine_values: str = ""

    @abc.abstractmethod
    def render(self, ctx: ExportContext) -> str:
        """The file's text for this context (call ``unsupported`` first: ``write_exports`` does)."""

    def file_name(self, ctx: ExportContext) -> str:
        """The file's name for this context (``filename``; a format whose file differs by layout says so)."""
        return self.filename

    def file_mode(self, ctx: ExportContext) -> int | None:
        """The file's permissions where the tool reading it checks them (None: the default; 0o755
        for an ``executable`` one)."""
        return 0o755 if self.executable else None

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
        values = (
            unsafe_settings(ctx.config, flags=self.engine_values == "flags") if self.shell or self.engine_values else []
        )
        targets = self.targets
        if not targets:
            return values
        kind = ctx.workload.get("kind", "train")
        if kind != self.launches:  # a launch of another workload would launch something else
            return [
                f"{self.name} writes a {LAUNCHES.get(self.launches, self.launches)} launch, and this study tuned a "
                f"{kind} workload: its config is in best_config.yaml and best.env"
                + (" (and its serving engine's own launch: vllm, mindie)" if kind == "serve" else "")
            ]
        target = ctx.target if ctx.target in targets else targets[0]
        rules = self.target_rules(target, ctx.config, study_facts(ctx)) if self.target_rules is not None else []
        return values + rules + self.workload_reasons(ctx)

    def workload_reasons(self, ctx: ExportContext) -> list[str]:
        """Why the format cannot launch the study's model and workload (default: none)."""
        return []
