"""Every export format, and writing them: autotune's own YAML and env file, and each registered
stack's launch (:mod:`autotune.stacks`). Above both the formats (:mod:`autotune.export`) and the
stacks that hold them, so that neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from ..export import EnvExporter, ExportContext, Exporter, ExportRefused, YamlExporter
from ..stacks import exporters, target_format

__all__ = ["EXPORTERS", "DEFAULT_FORMATS", "default_formats", "parse_formats", "refusals", "write_exports"]


class _Exporters(Mapping[str, Exporter]):
    """``{format: Exporter}``: autotune's own yaml and env, then each registered stack's exporter
    (:func:`autotune.stacks.exporters`), read from the registry at each use (a stack registered
    later is exported too)."""

    _own: tuple[Exporter, ...] = (YamlExporter(), EnvExporter())

    def _all(self) -> dict[str, Exporter]:
        return {**{e.name: e for e in self._own}, **exporters()}

    def __getitem__(self, name: str) -> Exporter:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"EXPORTERS({', '.join(self)})"


EXPORTERS: Mapping[str, Exporter] = _Exporters()
DEFAULT_FORMATS = ("yaml", "env", "megatron")  # what `autotune run` writes for the default targets


def default_formats(target: str, workload_kind: str = "train") -> tuple[str, ...]:
    """The exports a finished study gets: autotune's own YAML, the env file, and the launch form
    of the study's target stack for its workload (:func:`autotune.stacks.target_format`): a
    training launch for a training study, a serving engine's for a serving study (vLLM's
    ``serve_vllm.sh`` by default, MindIE's config.json for ``target: mindie``); an inference study
    gets no launch."""
    fmt = target_format(target, workload_kind)
    return ("yaml", "env", fmt) if fmt else ("yaml", "env")


def parse_formats(text: str) -> list[str]:
    """``"megatron,deepspeed"`` or ``"all"`` -> exporter names; unknown names raise ValueError."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(EXPORTERS)
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown or not names:
        raise ValueError(
            f"unknown export format(s) {', '.join(unknown) or '(none)'}: expected a comma-separated list "
            f"of {', '.join(EXPORTERS)}, or all"
        )
    return names


def refusals(context: ExportContext, formats: list[str] | tuple[str, ...]) -> dict[str, list[str]]:
    """``{format: reasons}`` for the formats that cannot launch the context's config exactly."""
    return {name: reasons for name in formats if (reasons := EXPORTERS[name].unsupported(context))}


def write_exports(
    context: ExportContext, out_dir: Path, formats: list[str] | tuple[str, ...] = DEFAULT_FORMATS
) -> dict[str, Path]:
    """Write each format's file. A format that cannot launch the config exactly raises
    :class:`ExportRefused` with the reasons, before any file is written: a config is never
    exported as something else."""
    refused = refusals(context, formats)
    if refused:
        raise ExportRefused(
            "; ".join(
                f"{name} cannot launch trial {context.trial}'s config: {', '.join(reasons)}"
                for name, reasons in refused.items()
            )
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in formats:
        exporter = EXPORTERS[name]
        path = out_dir / exporter.file_name(context)
        path.write_text(exporter.render(context))
        mode = exporter.file_mode(context)
        if mode is not None:
            path.chmod(mode)
        paths[name] = path
    return paths
