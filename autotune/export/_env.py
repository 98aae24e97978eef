"""The config's environment settings as a shell-sourceable file.

Each setting says, in a comment, why it has its value: one the study searched and the model (or
the probes) told apart, or a default of a knob the model could not distinguish (its layout's
"not distinguished by the model (probe to choose)" set, :data:`autotune.trial_attrs.UNDISTINGUISHED`,
which the trial's reason carries): exported so the launch matches the trial, but not chosen.
The comments sit on their own lines or after the value, so ``set -a; . best.env`` still works.
"""

from __future__ import annotations

import shlex

from ..workers.parameters import value
from ._base import ExportContext, Exporter, header_lines, one_line, roomiest_knobs, undistinguished_knobs


def undistinguished(ctx: ExportContext) -> dict[str, str]:
    """``{env name: "120|200|400"}``: the env settings the model could not tell apart for the
    chosen trial's layout (the env part of :func:`undistinguished_knobs`)."""
    return {name[4:]: values for name, values in undistinguished_knobs(ctx).items() if name.startswith("env.")}


def _note(ctx: ExportContext, name: str, loose: dict[str, str]) -> str:
    if name in loose:
        return f"default: the model could not tell {loose[name]} apart (probe to choose)"
    room = roomiest_knobs(ctx).get(f"env.{name}")
    if room:
        return f"default: the model prices {room} alike in speed and took its roomiest (probe to choose)"
    if ctx.searched is not None and f"env.{name}" not in ctx.searched:
        return "set by the spec (not searched)"
    if ctx.measured:
        earlier = f" (in an earlier run: {ctx.cached_from})" if ctx.cached_from else ""
        return f"searched; trial {ctx.trial} {ctx.how} with it{earlier}"
    return f"searched; {ctx.how} to matter"


def env_written(ctx: ExportContext) -> dict[str, str]:
    """``{"env.NAME": "export NAME"}``: what a shell file writes for each env setting (the header
    names it beside a value the evidence did not choose)."""
    return {f"env.{name}": f"export {name}" for name in ctx.env}


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
    flags = value(ctx.config, "graph_kernel_flags")
    if flags and "MS_DEV_GRAPH_KERNEL_FLAGS" not in env:
        lines.append(f"export MS_DEV_GRAPH_KERNEL_FLAGS={shlex.quote(str(flags))}  # MindSpore graph-kernel fusion")
    return lines


def provenance_lines(ctx: ExportContext) -> list[str]:
    """The file's summary of the settings: which were chosen, which are defaults (comments)."""
    env = ctx.env
    if not env:
        return []
    loose = undistinguished(ctx)
    loose.update({k[4:]: v for k, v in roomiest_knobs(ctx).items() if k.startswith("env.") and k[4:] not in loose})
    chosen = [k for k in sorted(env) if k not in loose]
    lines = []
    if chosen:
        lines.append(f"# {ctx.how} to matter or set by the spec: {', '.join(chosen)}")
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
        lines = [*header_lines(ctx, written=env_written(ctx)), *provenance_lines(ctx), *env_exports(ctx)]
        return "\n".join(lines) + "\n"
