"""The config and its metrics as YAML (autotune's own form; the input of `--baseline`-style reuse)."""

from __future__ import annotations

import yaml

from ._base import ExportContext, Exporter, header_lines


class YamlExporter(Exporter):
    name = "yaml"
    filename = "best_config.yaml"

    def render(self, ctx: ExportContext) -> str:
        body = {
            "study": ctx.study,
            "trial": ctx.trial,
            "source": ctx.source,
            "params": ctx.config,
            "metrics": dict(ctx.metrics),
            "software": ctx.software,
        }
        written = {name: f"params.{name}" for name in ctx.config}
        return "\n".join(header_lines(ctx, written=written)) + "\n" + yaml.safe_dump(body, sort_keys=False)
