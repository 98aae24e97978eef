"""The config's environment settings as a shell-sourceable file."""

from __future__ import annotations

import shlex

from ._base import ExportContext, Exporter, header_lines


def env_exports(ctx: ExportContext) -> list[str]:
    env = ctx.env
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    if "PYTORCH_NPU_ALLOC_CONF" in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        lines.append(
            f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(env['PYTORCH_NPU_ALLOC_CONF'])}"
            "  # the same allocator string on CUDA"
        )
    flags = ctx.get("graph_kernel_flags")
    if flags and "MS_DEV_GRAPH_KERNEL_FLAGS" not in env:
        lines.append(f"export MS_DEV_GRAPH_KERNEL_FLAGS={shlex.quote(str(flags))}  # MindSpore graph-kernel fusion")
    return lines


class EnvExporter(Exporter):
    name = "env"
    filename = "best.env"
    shell = True

    def render(self, ctx: ExportContext) -> str:
        return "\n".join([*header_lines(ctx), *env_exports(ctx)]) + "\n"
