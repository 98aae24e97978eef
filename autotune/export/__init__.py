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

from ._base import ExportContext, Exporter, ExportRefused, header_fields, header_lines
from ._deepspeed import DeepSpeedExporter
from ._env import EnvExporter
from ._megatron import MegatronExporter, megatron_args
from ._mindformers import MindFormersExporter
from ._torchtitan import TorchtitanExporter
from ._yaml import YamlExporter

__all__ = ["Exporter", "ExportContext", "ExportRefused", "EXPORTERS", "DEFAULT_FORMATS", "header_lines",
           "header_fields", "megatron_args", "write_exports", "parse_formats", "default_formats", "refusals"]

EXPORTERS: dict[str, Exporter] = {e.name: e for e in (
    YamlExporter(), EnvExporter(), MegatronExporter(), DeepSpeedExporter(), MindFormersExporter(), TorchtitanExporter(),
)}
DEFAULT_FORMATS = ("yaml", "env", "megatron")  # what `autotune run` writes for the default targets


def default_formats(target: str, workload_kind: str = "train") -> tuple[str, ...]:
    """The exports a finished study gets: autotune's own YAML, the env file, and the launch form
    of the study's target stack (:mod:`autotune.targets`); an inference study gets no training
    launch (every launch format is a training one)."""
    from autotune.targets import TARGET_FORMATS

    if workload_kind != "train":
        return ("yaml", "env")
    return ("yaml", "env", TARGET_FORMATS.get(target, "megatron"))


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


def refusals(context: ExportContext, formats: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``{format: reasons}`` for the formats that cannot launch the context's config exactly."""
    return {name: reasons for name in formats if (reasons := EXPORTERS[name].unsupported(context))}


def write_exports(context: ExportContext, out_dir: Path, formats: list[str] | tuple[str, ...] = DEFAULT_FORMATS
                  ) -> dict[str, Path]:
    """Write each format's file. A format that cannot launch the config exactly raises
    :class:`ExportRefused` with the reasons, before any file is written: a config is never
    exported as something else."""
    refused = refusals(context, formats)
    if refused:
        raise ExportRefused("; ".join(f"{name} cannot launch trial {context.trial}'s config: {', '.join(reasons)}"
                                      for name, reasons in refused.items()))
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
