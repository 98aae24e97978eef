"""The config's environment settings as a shell-sourceable file.

Each setting says, in a comment, why it has its value: one the study searched and the model (or
the probes) told apart, or a default of a knob the model could not distinguish (its layout's
"not distinguished by the model (probe to choose)" set, :data:`autotune.trial_attrs.UNDISTINGUISHED`,
which the trial's reason carries): exported so the launch matches the trial, but not chosen.
The comments sit on their own lines or after the value, so ``set -a; . best.env`` still works.
"""

from __future__ import annotations

import shlex

from ..trial_attrs import undistinguished_in
from ._base import ExportContext, Exporter, header_lines, one_line


def undistinguished(ctx: ExportContext) -> dict[str, str]:
    """``{env name: "120|200|400"}``: the env settings the model could not tell apart for the
    chosen trial's layout (from the trial's reason, ``ctx.chosen_because``)."""
    text = undistinguished_in(ctx.chosen_because or "")
    if not text:
        return {}
    # "env.A 1|2, precision bf16|fp16, env.B a:1,b:2|c": each knob starts at the text's start or
    # after ", " with its config name and a space (a value may hold commas)
    starts = sorted(
        (at, name)
        for name in ctx.config
        for at in [text.find(f"{name} ") if text.startswith(f"{name} ") else text.find(f", {name} ")]
        if at >= 0
    )
    out: dict[str, str] = {}
    for i, (at, name) in enumerate(starts):
        begin = at + len(name) + 1 + (0 if at == 0 and text.startswith(f"{name} ") else 2)
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        if name.startswith("env."):
            out[name[4:]] = text[begin:end].strip()
    return out


def _note(ctx: ExportContext, name: str, loose: dict[str, str]) -> str:
    searched = ctx.searched
    measured = ctx.source not in ("simulated", "")
    if name in loose:
        return f"default: the model could not tell {loose[name]} apart (probe to choose)"
    if searched is not None and f"env.{name}" not in searched:
        return "set by the spec (not searched)"
    if measured:
        return f"searched; trial {ctx.trial} measured with it"
    return "searched; the model predicts this value matters"


def env_exports(ctx: ExportContext) -> list[str]:
    env = ctx.env
    loose = undistinguished(ctx)
    lines = []
    for k, v in sorted(env.items()):
        lines.append(f"export {k}={shlex.quote(v)}  # {one_line(_note(ctx, k, loose))}")
    if "PYTORCH_NPU_ALLOC_CONF" in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        lines.append(
            f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(env['PYTORCH_NPU_ALLOC_CONF'])}"
            "  # the same allocator string on CUDA"
        )
    flags = ctx.get("graph_kernel_flags")
    if flags and "MS_DEV_GRAPH_KERNEL_FLAGS" not in env:
        lines.append(f"export MS_DEV_GRAPH_KERNEL_FLAGS={shlex.quote(str(flags))}  # MindSpore graph-kernel fusion")
    return lines


def provenance_lines(ctx: ExportContext) -> list[str]:
    """The file's summary of the settings: which were chosen, which are defaults (comments)."""
    env = ctx.env
    if not env:
        return []
    loose = undistinguished(ctx)
    chosen = [k for k in sorted(env) if k not in loose]
    how = "measured" if ctx.source not in ("simulated", "") else "predicted"
    lines = []
    if chosen:
        lines.append(f"# {how} to matter or set by the spec: {', '.join(chosen)}")
    if loose:
        lines.append(
            f"# defaults the model could not distinguish (probe to choose; any value of each prices the same): "
            f"{', '.join(sorted(loose))}"
        )
    return [one_line(line) for line in lines]


class EnvExporter(Exporter):
    name = "env"
    filename = "best.env"
    shell = True

    def render(self, ctx: ExportContext) -> str:
        return "\n".join([*header_lines(ctx), *provenance_lines(ctx), *env_exports(ctx)]) + "\n"
