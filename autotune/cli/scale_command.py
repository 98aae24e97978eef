"""``autotune scale RUN_DIR``: the study's best configs measured at several sizes (issue 45).

Apart from :mod:`autotune.cli.commands` (which declares the command and its options) because it
wires more than one stage: the run directory's spec and study (:mod:`autotune.cli.input`), the
backend and the profile the study ranked with (:mod:`autotune.cli.assembly`), the scaling study
(:mod:`autotune.scaling.study`) and its output (:mod:`autotune.finish.scaling_output`). Exit codes
are the command line's: 2 for input that cannot define a scaling study (a bad size, a run
directory without a successful trial), 3 when the cluster cannot place a size or Ray does not
answer, 1 when no point was measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table
from rich.text import Text

from .console import err, error, out, say, voice
from .exit_status import EXIT_INFRA, EXIT_INPUT, EXIT_NO_RESULT
from .input import load_run_or_spec, open_existing, run_dir_of
from ..spec.errors import escape_text

if TYPE_CHECKING:
    from ..scaling.summary import ScalingSummary
    from ..spec.schema import Spec

__all__ = ["scale_study"]


def scale_study(
    run_path: Path,
    nodes: Optional[str],
    devices: Optional[str],
    mode: str,
    top: int,
    repeats: int,
    backend: Optional[str],
    ray_address: Optional[str],
    no_tracking: bool,
    as_json: bool,
) -> None:
    from ..study.plan import Unplaceable
    from ..scaling.sizes import MODES, ScalingInputError, default_sizes, parse_sizes
    from ..scaling.study import SCALING_DIR, ScalingPlan, chosen_configs, run_scaling, shared_host_cores

    spec, run_dir = load_run_or_spec(run_path, None)
    if ray_address:
        spec = spec.model_copy(update={"ray": spec.ray.model_copy(update={"address": ray_address, "enabled": True})})
    directory = run_dir_of(spec, run_dir)
    try:
        if top < 1:
            raise ScalingInputError("--top", f"expected >= 1, got {top}")
        if repeats < 1:
            raise ScalingInputError("--repeats", f"expected >= 1, got {repeats}")
        modes = list(MODES) if mode == "both" else [mode]
        if any(m not in MODES for m in modes):
            raise ScalingInputError("--mode", f"expected strong, weak or both, got {mode!r}")
        sizes = default_sizes(spec, parse_sizes(nodes, "--nodes"), parse_sizes(devices, "--devices"))
        study = open_existing(spec, run_dir)
        configs = chosen_configs(spec, study, top)
    except ScalingInputError as exc:
        error(f"{escape_text(str(directory))}: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    from ..dispatch.backends import select_backend
    from .assembly import AssemblyFailed, dispatcher_for, measured_profile

    try:
        choice = select_backend(spec, backend)
    except ValueError as exc:
        error(str(exc))
        raise typer.Exit(EXIT_INPUT) from None
    err.print(Text.assemble(("backend: ", "bold"), escape_text(f"{choice.kind} — {choice.reason}")))
    try:
        spec = measured_profile(spec, choice, voice())
    except AssemblyFailed as exc:
        raise typer.Exit(EXIT_INFRA if exc.infrastructure else EXIT_INPUT) from None
    plan = ScalingPlan(configs, sizes, modes, repeats)
    say(
        err,
        f"scaling {len(configs)} config(s) (trial {', '.join(str(t) for t, _ in configs)}) over "
        f"{', '.join(s.label for s in sizes)} devices, {' and '.join(modes)} scaling, {repeats} reading(s) each",
    )
    from ..tracking.progress import phase

    try:
        with dispatcher_for(spec, choice, directory / SCALING_DIR) as dispatcher, phase(err, "measuring") as step:
            cores = shared_host_cores(dispatcher)
            summary = run_scaling(spec, directory, plan, choice, dispatcher, step.update, cores)
    except ScalingInputError as exc:
        error(f"{escape_text(str(directory))}: {exc}")
        raise typer.Exit(EXIT_INPUT) from None
    except (Unplaceable, ConnectionError) as exc:
        error(str(exc))
        raise typer.Exit(EXIT_INFRA) from None
    from ..finish.scaling_output import write_scaling_files

    from autotune.workers.hardware import links_note

    from ..spec.resolve import probe_context

    hardware = probe_context(spec).hardware
    context = {
        "study": spec.name,
        "backend": choice.kind,
        "modes": modes,
        "sizes": [s.to_json() for s in sizes],
        "repeats": repeats,
        # what the projection's link across each node count rests on (autotune calibrate --nodes)
        "links": [note for n in sorted({s.nodes for s in sizes}) if (note := links_note(hardware, n))],
    }
    files = write_scaling_files(summary, directory / SCALING_DIR, context)
    parent = study.user_attrs.get("autotune.parent_run_id")
    if not no_tracking and parent:
        _log_to_mlflow(spec, directory, parent, summary, files)
    if as_json:
        out.print_json(json.dumps({**context, **summary.to_json(), "files": [str(f) for f in files]}))
    else:
        _print_table(summary, files, context["links"])
    if not any(p.tokens_per_s_per_device for p in summary.points):
        error("no size was measured: see the notes for why each failed")
        raise typer.Exit(EXIT_NO_RESULT)


def _print_table(summary: "ScalingSummary", files: list[Path], links: list[str]) -> None:
    from ..finish.scaling_output import scaling_rows

    rows, notes = scaling_rows(summary)
    if not rows:
        return
    source = "simulated: the analytical model's predictions" if summary.simulated else "measured"
    table = Table(
        title=f"scaling, {source} (efficiency: tokens/s/device against the smallest size measured; "
        "projected: from that size by the calibrated model, its error against the measurement)",
        title_justify="left",
        box=None,
    )
    for name in rows[0]:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*(Text(escape_text(v)) for v in row.values()))
    out.print(table)
    for note in notes:
        say(out, note)
    projection = summary.to_json()["projection"]
    if projection["compared"]:
        say(
            out,
            f"the model's projection from the smallest size, against what was measured: median error "
            f"{100 * projection['median_abs_error']:.1f} % over {projection['compared']} point(s)",
        )
        for note in links:
            say(out, f"  {note}", style="dim")
    for f in files:
        say(err, f"wrote {f}", style="dim")


def _log_to_mlflow(spec: "Spec", directory: Path, parent: str, summary: "ScalingSummary", files: list[Path]) -> None:
    """The figures and files on the study's parent run; a store that cannot be written is said, not fatal."""
    from .assembly import AssemblyFailed, open_tracker
    from ..finish.scaling_output import log_scaling

    try:
        tracker = open_tracker(spec, directory, voice())
    except AssemblyFailed:
        return
    log_scaling(tracker, parent, summary, files)
    left = tracker.flush(timeout=60, retry_now=True)
    if left:
        say(err, f"MLflow: {left} write(s) left undone; the files are in {directory / 'scaling'}", style="yellow")
