"""Launch-ready forms of a chosen config, one small exporter per target stack.

``autotune export RUN_OR_SPEC --format megatron,deepspeed,mindformers,torchtitan,env,yaml`` (or
``all``). Each exporter is an :class:`Exporter`: a name, a file name and ``render(context)``; the
implementations live in private modules. Every file starts with the same header (in the file
format's comment syntax, or an ``_autotune`` key in JSON): study, trial, whether the numbers were
measured or simulated, the metrics, and the software the probe saw (torch / torch_npu / CANN /
MindSpore / driver versions), so a file found later explains itself.
"""

from __future__ import annotations

from pathlib import Path

from ._base import ExportContext, Exporter, header_fields, header_lines
from ._deepspeed import DeepSpeedExporter
from ._env import EnvExporter
from ._megatron import MegatronExporter, megatron_args
from ._mindformers import MindFormersExporter
from ._torchtitan import TorchtitanExporter
from ._yaml import YamlExporter

__all__ = ["Exporter", "ExportContext", "EXPORTERS", "DEFAULT_FORMATS", "header_lines", "header_fields",
           "megatron_args", "write_exports", "parse_formats", "default_formats"]

EXPORTERS: dict[str, Exporter] = {e.name: e for e in (
    YamlExporter(), EnvExporter(), MegatronExporter(), DeepSpeedExporter(), MindFormersExporter(), TorchtitanExporter(),
)}
DEFAULT_FORMATS = ("yaml", "env", "megatron")  # what `autotune run` writes at the end of a study


def default_formats(backend: str) -> tuple[str, ...]:
    """The exports a finished study gets: a MindSpore study's launch form is MindFormers'."""
    return ("yaml", "env", "mindformers") if backend == "mindspore" else DEFAULT_FORMATS


def parse_formats(text: str) -> list[str]:
    """``"megatron,deepspeed"`` or ``"all"`` -> exporter names; unknown names raise ValueError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(EXPORTERS)
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown or not names:
        raise ValueError(f"unknown export format(s) {', '.join(unknown) or '(none)'}: expected a comma-separated list "
                         f"of {', '.join(EXPORTERS)}, or all")
    return names


def write_exports(context: ExportContext, out_dir: Path, formats: list[str] | tuple[str, ...] = DEFAULT_FORMATS
                  ) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in formats:
        exporter = EXPORTERS[name]
        path = out_dir / exporter.filename
        path.write_text(exporter.render(context))
        if exporter.executable:
            path.chmod(0o755)
        paths[name] = path
    return paths
